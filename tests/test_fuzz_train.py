"""Fuzzing ``python -m minidist.train``: argument lists from the trainer's real flags (its own argparse
parser) with extreme values (tests/fuzz.py), and, so that half of them reach the trainer's own checks
instead of stopping in argparse, lists of numeric flags with values their type parses. Each runs as a
process of its own under a time and an address-space limit and must end well: exit 0 (it trained),
2 (it refused, with a short message) or 5 (it diverged, saying so); never a traceback, never a hang,
never past its memory. (--fail-at-step is left out: it is a crash on purpose, by SIGKILL.)

Fixed base arguments come first and keep a run that passes validation to one short step (the
generated corpus is made once, in a folder of the test's own; the paths it draws from include
prepared folders with a changed shard, a zeroed hash and a manifest nested 100,000 deep); a flag the fuzz sets comes later and
overrides them (argparse keeps the last). A run the limit stops passes only if it visibly trains
(its parameter line is out: ``--steps 2147483648`` is a long run, not a hang). The short version runs
in the default suite; the long one (``--slow``) is the 200-case run whose counts go to
benchmarks/RESULTS.md (written to ``<tmp>/minidist-fuzz/minidist.train.json``).
"""
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.comm.transport import EXIT_DIVERGED
from minidist.train.build import load_data
from minidist.train.config import TrainConfig
from minidist.train.cli import argument_parser
from tests.fuzz import (NUMBERS, Tally, argument_lists, assert_fails_well, flags_of, fuzz_settings, hostile_paths,
                        run_command)

FLAGS = flags_of(argument_parser(), skip=("--help", "--fail-at-step"))  # a crash on purpose: it dies of SIGKILL
BASE = ["--steps", "1", "--eval-every", "1", "--eval-iters", "1", "--sample-tokens", "0"]
NUMERIC = [f for f in FLAGS if f.kind in ("int", "float")]


def parses(text: str, kind: str) -> bool:
    try:
        {"int": int, "float": float}[kind](text)
    except ValueError:
        return False
    return True


def numeric_lists():
    """Argument lists that argparse accepts whole: one to three numeric flags, each with a value of
    :data:`tests.fuzz.NUMBERS` its type parses, written ``--flag=value`` (so ``-inf`` is a value, not
    a flag). They reach the trainer's own checks, where argument_lists' strings mostly stop in argparse."""
    one = st.sampled_from(NUMERIC).flatmap(
        lambda f: st.sampled_from([v for v in NUMBERS if parses(v, f.kind)]).map(lambda v: [f"{f.option}={v}"]))
    return st.lists(one, min_size=1, max_size=3).map(lambda parts: [word for part in parts for word in part])


def command_lines(paths):
    """Half of them any argument list of the real flags (tests/fuzz.py), half numeric ones that parse."""
    return st.one_of(argument_lists(FLAGS, paths), numeric_lists())


TALLIES = {"short": Tally("minidist.train (default suite)"), "long": Tally("minidist.train")}


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """(hostile paths, base arguments, working folder): the corpus generated once into the base's
    --data-dir; each run started in a folder three deep in the test's own, so relative paths the fuzz
    names ("0", "../..", "none") land there, never in the project; the trainer's output unbuffered,
    so a run stopped at its time limit shows how far it got."""
    root = tmp_path_factory.mktemp("fuzz-train")
    load_data(TrainConfig(data_dir=str(root / "data")))  # the default corpus, once
    cwd = root / "a" / "b" / "cwd"
    cwd.mkdir(parents=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONUNBUFFERED", "1")
        yield {**hostile_paths(root / "paths"), **hostile_data(root / "hostile-data")}, \
            BASE + ["--data-dir", str(root / "data")], cwd
    for tally in TALLIES.values():
        if tally.statuses:
            tally.write()


def hostile_data(root):
    """Prepared folders a careless copy or an attacker leaves (issue 48): a shard changed after
    prepare (same size), a manifest whose SHA-256 is zeros, a manifest nested 100,000 deep."""
    from minidist.data.prepare import prepare
    text = root / "text.txt"
    root.mkdir()
    text.write_text("the cat sees the dog. " * 500)
    made = {}
    for kind in ("changed_shard", "zeroed_hash", "deep_manifest"):
        folder = made[kind] = root / kind
        prepare([str(text)], folder, workers=1)
        if kind == "changed_shard":
            data = bytearray((folder / "train_000000.bin").read_bytes())
            data[-2] ^= 1  # the last token, still a byte
            (folder / "train_000000.bin").write_bytes(bytes(data))
        elif kind == "zeroed_hash":
            manifest = json.loads((folder / "manifest.json").read_text())
            manifest["shards"][0]["sha256"] = "0" * 64
            (folder / "manifest.json").write_text(json.dumps(manifest))
        else:
            (folder / "manifest.json").write_text("[" * 100_000)
    return {kind: str(folder) for kind, folder in made.items()}


def training(result) -> bool:
    """Whether a run stopped at its time limit was training (its parameter line is out)."""
    return "parameters on rank 0" in result.stdout


def check(args, setting, timeout_s, tally):
    _, base, cwd = setting
    result = run_command("minidist.train", base + args, timeout_s=timeout_s, cwd=cwd)
    tally.add(result)
    if result.rc == EXIT_DIVERGED:  # a diverged run (train/divergence.py) fails well too
        assert "the run diverged" in result.stderr and "Traceback" not in result.stderr, result.describe()
        return
    assert_fails_well(result, working=training)


@fuzz_settings(10)
@given(data=st.data())
def test_extreme_command_lines_fail_well(setting, data):
    """The default suite's sample: 10 argument lists (derandomized: the same ten every run)."""
    check(data.draw(command_lines(setting[0])), setting, 30, TALLIES["short"])


@pytest.mark.slow
@fuzz_settings(200)
@given(data=st.data())
def test_extreme_command_lines_fail_well_200_cases(setting, data):
    check(data.draw(command_lines(setting[0])), setting, 60, TALLIES["long"])
