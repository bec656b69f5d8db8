"""python -m minidist.plan on numbers a careless user or an attacker types.

The rules: every numeric flag out of its range (negative, zero where a count must be positive, nan,
inf, past the largest count the planner takes) exits 2 with a message naming the flag, never 0 with
"0 layouts fit", never a traceback; so does a model the search would divide by (``--n-head 0``).
A plan is bounded before any of it is done: a pipeline too long to simulate or too many stages to
balance, and a search estimated at more than a minute, exit 2 naming the bound, in seconds and
megabytes. ``--seq 0`` and ``--global-batch-size 0`` are refused, not taken as "the default".
"""
import pytest

from minidist.plan.__main__ import build_parser, main
from minidist.plan.hardware import PROFILES
from minidist.plan.layout import RunSpec
from minidist.plan.limits import MAX_PARTITION_STEPS, MAX_SCHEDULE_ACTIONS
from minidist.plan.models import preset, with_shape
from minidist.plan.search import SEARCH_SECONDS, candidates, estimate
from tests.fuzz import assert_fails_well, flags_of, run_command


def plan(capsys, *args):
    """(exit status, stdout, stderr) of ``python -m minidist.plan *args``, run in this process."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:  # argparse's own refusals (not a number, a choice it lacks)
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args, message", [
    (["--search", "--gpus", "-4"], "--gpus must be in [1, 1e6], got -4"),
    (["--search", "--gpus", "8", "--memory-gib", "-1"], "--memory-gib must be positive, got -1.0"),
    (["--search", "--gpus", "8", "--memory-gib", "0"], "--memory-gib must be positive, got 0.0"),
    (["--search", "--gpus", "8", "--memory-gib", "nan"], "--memory-gib must be positive, got nan"),
    (["--search", "--gpus", "8", "--memory-gib", "inf"], "--memory-gib must be positive and finite, got inf"),
    (["--search", "--gpus", "8", "--global-batch-size", "0"], "--global-batch-size must be in [1, 1e12], got 0"),
    (["--search", "--gpus", "8", "--top", "-1"], "--top must be >= 0, got -1"),
    (["--search", "--gpus", "8", "--micro-batch-size", "0"], "--micro-batch-size must be in [1, 1e12], got 0"),
    (["--search", "--gpus", "8", "--n-head", "0", "--hardware", "local"], "--n-head must be >= 1, got 0"),
    (["--seq", "0"], "--seq must be in [1, 1e12], got 0"),
    (["--vocab", "0"], "--vocab must be in [1, 1e12], got 0"),
    (["--n-kv-head", "0"], "--n-kv-head must be in [1, 1e12], got 0"),
    (["--ffn", "-5"], "--ffn must be in [1, 1e12], got -5"),
    (["--n-embd", str(10**400)], "--n-embd 1" + "0" * 400 + " is more than the planner takes (at most 1e+12)"),
])
def test_a_number_out_of_range_exits_2_naming_the_flag(capsys, args, message):
    code, out, err = plan(capsys, *args)
    assert code == 2 and message in err and "layouts fit" not in out


def numeric_flags() -> list[str]:
    return [f.option for f in flags_of(build_parser()) if f.kind in ("int", "float")]


@pytest.mark.parametrize("value", ["-1", "nan", "inf", str(10**20)])
def test_every_numeric_flag_refuses_what_it_cannot_take(capsys, value):
    """-1, nan, inf and 10^20 on every numeric flag: exit 2 naming the flag (argparse's "invalid int
    value" for nan and inf on an integer flag), except where the value is a real one (memory and
    --top have no upper end that matters)."""
    takes = {("--memory-gib", str(10**20)), ("--top", str(10**20))}
    for option in numeric_flags():
        args = [option, value] + (["--search", "--gpus", "8"] if option != "--gpus" else ["--search"])
        code, out, err = plan(capsys, *args)
        if (option, value) in takes:
            assert code == 0, (args, err)
        else:
            assert code == 2 and option in err and "Traceback" not in err, (args, err)


def test_a_pipeline_too_long_to_simulate_is_refused_naming_the_bounds():
    """The issue's case: 10^5 stages of 10^5 micro-batches used to allocate 74.5 GiB; now refused
    at once, under a 1 GiB address-space limit, naming both bounds."""
    done = run_command("minidist.plan", ["--pp", 100000, "--micro-batches", 100000, "--n-layer", 100000],
                       timeout_s=60, memory_bytes=1 << 30)
    assert_fails_well(done)
    assert done.rc == 2 and f"{MAX_SCHEDULE_ACTIONS:,}" in done.stderr and f"{MAX_PARTITION_STEPS:,}" in done.stderr


def test_a_search_past_a_minute_is_refused_before_it_starts(capsys):
    code, out, err = plan(capsys, "--search", "--gpus", 10**12)
    assert code == 2 and "--gpus must be in [1, 1e6]" in err
    code, out, err = plan(capsys, "--search", "--gpus", 8, "--n-layer", 100000, "--global-batch-size", 8)
    assert code == 2 and f"over the {SEARCH_SECONDS} s the planner allows" in err and "360 layouts" in err


def test_the_estimate_counts_every_candidate_and_is_within_the_bound_for_the_documented_search():
    model, base, hw = preset("llama3-70b"), RunSpec(seq=8192), PROFILES["h100"]
    count, seconds = estimate(model, 1024, hw, base, 1024)
    assert count == len(list(candidates(model, 1024, base, 1024, hw))) and seconds < SEARCH_SECONDS
    deep = with_shape(preset("gpt2"), n_layer=2000)
    assert estimate(deep, 16, hw, RunSpec(seq=1024), 16)[0] == len(list(candidates(deep, 16, RunSpec(seq=1024), 16, hw)))


def test_a_schedule_over_the_bound_is_one_reason_among_the_search_rejections(capsys):
    code, out, err = plan(capsys, "--search", "--gpus", 2, "--global-batch-size", 4096)  # pp 2 x 4096 micro-batches
    assert code == 0 and "larger than the planner simulates (4,096)" in out
