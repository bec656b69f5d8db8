"""Fuzzing ``python -m minidist.inspect`` and ``python -m minidist.plan`` (tests/fuzz.py's harness).

Each case runs the command in a process of its own under a time and a memory limit, with arguments
built from the command's real flags at extreme values (negative, zero, huge, nan, inf, strings,
repeats, paths to files, folders, links, FIFOs); inspect also gets hostile run folders: a healthy run
damaged as a crash, a careless copy or an attacker would (a trace cut mid-line, garbled and
over-long lines, JSON nested past any parser, a memory report without rows, FIFOs and links named
like its files, events with absurd values, random bytes for a trace or the metrics, the run moved
into a population's member-0/). Every case must exit 0 or 2, never with a traceback,
never past its time or memory limit. The default suite runs a few cases of each; ``--slow`` runs
200 of each and writes the counts (cases, exit statuses, seconds) to ``<tmp>/minidist-fuzz/``.
"""
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.comm import Event, Trace
from minidist.inspect.__main__ import build_parser as inspect_parser
from minidist.inspect.write import write_memory_report, write_trace
from minidist.plan.__main__ import build_parser as plan_parser
from tests.fuzz import Tally, argument_lists, assert_fails_well, flags_of, fuzz_settings, hostile_paths, run_command

SHORT, LONG = 6, 200  # cases per command: the default suite's, --slow's
PATHS_ROOT = Path(tempfile.mkdtemp(prefix="minidist-fuzz-paths-"))
PATHS = hostile_paths(PATHS_ROOT)
ROOT = Path(tempfile.mkdtemp(prefix="minidist-fuzz-runs-"))  # one folder per inspect case inside
TALLIES = {}


def tally(name: str) -> Tally:
    return TALLIES.setdefault(name, Tally(name))


@pytest.fixture(scope="module", autouse=True)
def write_tallies():
    yield
    for t in TALLIES.values():
        t.write()
    for folder in (PATHS_ROOT, ROOT):
        shutil.rmtree(folder, ignore_errors=True)


def plan_case(args, name):
    result = run_command("minidist.plan", args)
    tally(name).add(result)
    assert_fails_well(result)


@fuzz_settings(SHORT)
@given(argument_lists(flags_of(plan_parser()), PATHS))
def test_plan_fails_well_on_any_flags(args):
    plan_case(args, "minidist.plan (default suite)")


@pytest.mark.slow
@fuzz_settings(LONG)
@given(argument_lists(flags_of(plan_parser()), PATHS))
def test_plan_fails_well_on_any_flags_long(args):
    plan_case(args, "minidist.plan")


DAMAGES = (
    "cut trace", "garbled line", "deep line", "long line", "odd event", "absurd times", "empty trace",
    "fifo trace", "link trace", "dangling trace", "folder trace", "no trace folder", "trace folder a file",
    "no rows", "memory not json", "memory deep", "memory odd columns", "fifo memory", "no memory",
    "metrics garbled", "null loss", "fifo metrics", "no metrics", "expert rows", "odd expert rows", "no optimizer",
    "random trace", "random metrics", "population",
)
"""What a hostile run folder may have suffered, each applied to a healthy run of 2 ranks and 3 steps."""


def healthy_run(path: Path) -> None:
    for r in range(2):
        trace = Trace(r)
        for s in range(3):
            t = 10.0 * s
            trace.events.append(Event("forward", "world", "", 0, t, t + 1, s, r, kind="compute", thread=1))
            trace.events.append(Event("h.0", "module", "forward", 512, t, t + 0.5, s, r, kind="compute", thread=1))
            trace.events.append(Event("all_reduce", "dp[pp0,tp0]", "ring", 4096, t + 1, t + 2, s, r, thread=1,
                                      label="gradient: DDP bucket 0 average"))
            trace.events.append(Event("send", "pp[dp0,tp0]", "", 64, t + 2, t + 2.1, s, r, peer=1 - r, kind="p2p"))
            trace.events.append(Event("optimizer", "world", "", 0, t + 2, t + 3, s, r, kind="compute", thread=1))
        write_trace(path, trace)
        write_memory_report(path, r, [dict(label="after step", parameters=1024, gradients=1024, optimizer=2048)])
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in range(3)))


def replace_with(path: Path, kind: str) -> None:
    """Put a FIFO, a link to a file, a dangling link or a folder where file ``path`` was (if its
    folder is still a folder)."""
    if not path.parent.is_dir() or path.parent.is_symlink():
        return
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        path.symlink_to(PATHS["junk_file"])
    elif kind == "dangling":
        path.symlink_to(path.parent / "nowhere")
    else:
        path.mkdir()


def damage(run: Path, what: str) -> None:
    """Apply one of :data:`DAMAGES` to run folder ``run`` (its files may already be damaged)."""
    trace, memory, metrics = run / "trace" / "rank1.jsonl", run / "memory" / "rank0.json", run / "metrics.jsonl"

    def append(path, data: bytes):
        if path.is_file() and not path.is_symlink():
            with open(path, "ab") as f:
                f.write(data)
    event = dict(op="x", group="g", algorithm="", nbytes=8, start=1.0, end=2.0, seq=0, rank=1)
    if what == "cut trace" and trace.is_file() and not trace.is_symlink():
        data = trace.read_bytes()
        trace.write_bytes(data[:max(0, len(data) - 37)])
    elif what == "garbled line":
        append(trace, b"\x00\xffgarbage{\n")
    elif what == "deep line":
        append(trace, b"[" * 200_000 + b"\n")
    elif what == "long line":
        append(trace, b'"' + b"x" * (3 << 20) + b'"\n')
    elif what == "odd event":
        append(trace, json.dumps({**event, "kind": "dance", "nbytes": -1}).encode() + b"\n")
    elif what == "absurd times":
        append(trace, json.dumps({**event, "start": -1e300, "end": 1e300, "nbytes": 2**62}).encode() + b"\n")
    elif what == "empty trace" and trace.is_file():
        trace.write_bytes(b"")
    elif what in ("fifo trace", "link trace", "dangling trace", "folder trace"):
        replace_with(trace, what.split()[0])
    elif what == "no trace folder":
        shutil.rmtree(run / "trace", ignore_errors=True)
    elif what == "trace folder a file":
        shutil.rmtree(run / "trace", ignore_errors=True)
        (run / "trace").write_text("not a folder")
    elif what == "no rows" and memory.parent.is_dir():
        memory.write_text('{"rank": 0}')
    elif what == "memory not json" and memory.parent.is_dir():
        memory.write_text('{"rank": 0, "rows": [')
    elif what == "memory deep" and memory.parent.is_dir():
        memory.write_text("[" * 100_000)
    elif what == "memory odd columns" and memory.parent.is_dir():
        memory.write_text(json.dumps({"rank": 0, "rows": [{"label": "x", "weights": 1e308}]}))
    elif what == "fifo memory" and memory.parent.is_dir():
        replace_with(memory, "fifo")
    elif what == "no memory":
        shutil.rmtree(run / "memory", ignore_errors=True)
    elif what == "metrics garbled":
        append(metrics, b'NaN\n{"step": "x"}\n{"step": 3, "lo')
    elif what == "null loss":
        append(metrics, b'{"step": 3, "loss": null}\n{"step": 4, "loss": NaN}\n')
    elif what == "fifo metrics":
        replace_with(metrics, "fifo")
    elif what == "no metrics":
        replace_with(metrics, "folder")
        metrics.rmdir()
    elif what in ("expert rows", "odd expert rows"):
        rows = [1, 2] if what == "expert rows" else [1, 2, 3]
        append(metrics, json.dumps({"step": 5, "loss": 1.0, "expert_rows": rows, "expert_load": {"0": [0, 0]}}).encode()
               + b"\n")
    elif what in ("random trace", "random metrics"):  # not a trace or metrics at all: exit 2 naming the file
        path = trace if what == "random trace" else metrics
        if path.is_file() and not path.is_symlink():
            path.write_bytes(np.random.default_rng(len(what)).integers(0, 256, 3000, dtype=np.uint8).tobytes())
    elif what == "population" and not (run / "member-0").exists():  # a --mode pbt folder: the run is member-0's
        (run / "member-0").mkdir()
        for entry in list(run.iterdir()):
            if entry.name != "member-0":
                entry.rename(run / "member-0" / entry.name)
    elif what == "no optimizer" and trace.is_file() and not trace.is_symlink():
        kept = [line for line in trace.read_bytes().splitlines(keepends=True) if b'"optimizer"' not in line]
        trace.write_bytes(b"".join(kept))


def inspect_case(damages, target, args, name):
    case = Path(tempfile.mkdtemp(dir=ROOT))
    run = case / "run"
    run.mkdir()
    healthy_run(run)
    for what in damages:
        damage(run, what)
    run_dir = str(run) if target is None else target
    try:
        result = run_command("minidist.inspect", [run_dir, *args], cwd=case)  # relative --png paths land in case/
    finally:
        shutil.rmtree(case, ignore_errors=True)
    tally(name).add(result)
    assert_fails_well(result)


inspect_targets = st.one_of(*[st.none()] * 4, st.sampled_from(sorted(PATHS.values())))  # mostly a (damaged) run
inspect_args = st.one_of(st.just([]), argument_lists(flags_of(inspect_parser()), PATHS, max_flags=3))  # often none:
# the damaged run is then read to the end and drawn


@fuzz_settings(SHORT)
@given(st.lists(st.sampled_from(DAMAGES), max_size=3), inspect_targets, inspect_args)
def test_inspect_fails_well_on_any_run_folder_and_flags(damages, target, args):
    inspect_case(damages, target, args, "minidist.inspect (default suite)")


@pytest.mark.slow
@fuzz_settings(LONG)
@given(st.lists(st.sampled_from(DAMAGES), max_size=3), inspect_targets, inspect_args)
def test_inspect_fails_well_on_any_run_folder_and_flags_long(damages, target, args):
    inspect_case(damages, target, args, "minidist.inspect")
