"""The planner takes a preset as people write it, and sizes a custom shape for the sequence it is given.

Issue 36: ``--model llama-3-70b`` was refused (the preset is ``llama3-70b``), and a custom shape with
``--seq 2048`` was refused because its learned positions stayed at minidist's 64.
"""
import json

import pytest

from minidist.plan.__main__ import main
from minidist.plan.models import ALIASES, PRESETS, preset, spelling


def plan(capsys, *args):
    """(exit status, stdout, stderr) of ``python -m minidist.plan *args``, run in this process."""
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", ["llama3-70b", "llama-3-70b", "Llama-3-70B", "LLAMA_3_70B", "llama 3 70b",
                                  "Llama3-70B", "llama_3-70B"])
def test_every_natural_spelling_names_the_same_preset(name):
    assert preset(name) is PRESETS["llama3-70b"]


@pytest.mark.parametrize("name, key", [("GPT-2", "gpt2"), ("gpt2-XL", "gpt2-xl"), ("GPT2 Medium", "gpt2-medium"),
                                       ("gpt-3-175B", "gpt3-175b"), ("GPT2-1.5B", "gpt2-xl"), ("gpt2_124M", "gpt2"),
                                       ("Llama-3-8B", "llama3-8b"), ("Llama.3-405B", "llama3-405b")])
def test_gpt_and_llama_presets_and_their_aliases(name, key):
    assert preset(name) is PRESETS[key]


def test_a_dot_between_digits_is_kept_so_no_two_names_meet():
    assert spelling("GPT2-1.5B") == "gpt21.5b" and spelling("Llama-3.1-70B") == "llama3.170b"
    keys = [spelling(n) for n in list(PRESETS) + list(ALIASES)]
    assert len(set(keys)) == len(keys)
    with pytest.raises(ValueError, match="did you mean llama3-70b"):
        preset("Llama-3.1-70B")  # another model (Llama 3.1), not silently this one


def test_an_unknown_name_lists_the_presets(capsys):
    code, out, err = plan(capsys, "--model", "llama9")
    assert code == 2 and not out
    assert "unknown model preset 'llama9'" in err and all(name in err for name in PRESETS)


def test_the_command_line_takes_the_spelling(capsys):
    code, out, err = plan(capsys, "--model", "Llama-3-70B", "--seq", "8192", "--json")
    assert code == 0, err
    assert json.loads(out)["model"]["name"] == "llama3-70b"


def test_a_custom_shape_has_learned_positions_for_its_sequence(capsys):
    """Without a preset, the position table is as long as --seq (minidist's GPT learns one position
    per token of its block), so --seq 2048 plans; --block-size still decides when given."""
    code, out, err = plan(capsys, "--n-layer", 2, "--n-embd", 64, "--n-head", 4, "--seq", 2048, "--json")
    assert code == 0, err
    p = json.loads(out)
    assert p["model"]["block_size"] == 2048
    assert p["parameters"] == 2 * 12 * 64 * 64 + 2 * 13 * 64 + 256 * 64 + 2048 * 64 + 2 * 64  # blocks, wte, wpe, ln_f
    code, out, err = plan(capsys, "--seq", 2048, "--block-size", 64)
    assert code == 2 and "the sequence of 2048 is longer than the model's 64 learned positions" in err
    assert "--block-size 2048" in err  # and says what to do
    code, out, err = plan(capsys, "--model", "gpt2", "--seq", 2048)  # a preset keeps its published table
    assert code == 2 and "the model's 1024 learned positions" in err
    code, out, err = plan(capsys, "--seq", 0)  # refused by its own name only
    assert code == 2 and "--seq must be in [1, 1e12], got 0" in err and "--block-size" not in err
