"""The stop matrix: SIGINT and SIGTERM x ``--mode collective | ps | pbt`` x (a save in progress, offload to
files, ``--data`` read ahead). Each cell starts a 2-rank job, signals its ranks once the run has shown a
step (a population: a ready point), and checks what one run's life promises (minidist/train/life.py):

- every rank exits within 10 s of the signal, with 128 + the signal's number;
- rank 0 prints one line, naming the newest checkpoint (a population: its newest population file);
- that checkpoint verifies (each of a population's members' newest), and nothing is left behind: no
  unfinished save (``.saving-*``, ``.abandoned-*``), no temporary file (``*.tmp*``), no offload file but the folders' locks.

The parameter servers keep no checkpoints and offload nothing (``--mode ps`` refuses both): their cells
are the data's and a plain run. The default suite runs a sample that holds each signal, mode and
situation; ``--slow`` runs the whole matrix five times over (a hang seen 3 times in 8 needs repeats).
"""
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minidist.checkpoint.format import step_dirs
from minidist.checkpoint.reader import latest_valid
from minidist.checkpoint.writer import LEFTOVERS
from minidist.data.corpus import default_corpus
from minidist.data.prepare import main as prepare
from minidist.process_tree import signal_processes
from tests.mpi.harness import REPO, find_mpiexec, mpiexec_command
from tests.test_stopping import assert_quiet, finish, ranks_of, wait_for

TINY = ["--n-layer", "2", "--n-head", "4", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--eval-iters", "1", "--sample-tokens", "0", "--steps", "1000000"]
MODES = {
    "collective": ["--dp", "2", "--eval-every", "1"],
    "ps": ["--mode", "ps", "--servers", "1"],
    "pbt": ["--mode", "pbt", "--population", "2", "--ready-every", "2", "--lr-range", "1e-3", "1e-2"],
}
SITUATIONS = ("save", "offload", "data")
SHOWN = {"collective": r"step\s+4\s+train loss", "pbt": r"step\s+2\s+val loss"}  # ps prints no step: its CPU time


def situation_args(mode: str, situation: str, tmp_path: Path, data: Path) -> list[str]:
    """The flags of one situation (the parameter servers': the data's, or none)."""
    ckpt = {"collective": ["--ckpt-dir", str(tmp_path / "ckpt"), "--save-every", "2"],  # step 4 shown: one saved
            "pbt": ["--ckpt-dir", str(tmp_path / "ckpt")], "ps": []}[mode]  # (a population saves at each ready point)
    if situation == "save":  # a save every step, written in the background: one is in flight when the signal comes
        return ckpt + (["--save-every", "1", "--async-save"] if mode == "collective" else [])  # (the later flag counts)
    if situation == "offload":
        return ckpt + ["--zero", "1", "--offload", "optimizer", "--offload-dir", str(tmp_path / "offload")]
    return ckpt + ["--data", str(data)]


CELLS = [(s, m, c) for s, m, c in itertools.product((signal.SIGINT, signal.SIGTERM), MODES, SITUATIONS)
         if m != "ps" or c == "data"] + [(signal.SIGINT, "ps", "plain")]
SAMPLE = [(signal.SIGINT, "collective", "save"), (signal.SIGTERM, "pbt", "offload"), (signal.SIGINT, "ps", "data")]


def cell_id(cell) -> str:
    return f"{signal.Signals(cell[0]).name}-{cell[1]}-{cell[2]}"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A prepared folder of byte shards (the default corpus, several shards), read ahead by every run."""
    root = tmp_path_factory.mktemp("stop-data")
    text = default_corpus(str(root / "cache"))
    assert prepare([str(text), "--out", str(root / "shards"), "--shard-tokens", "200000", "--workers", "1"]) == 0
    return root / "shards"


def run_cell(tmp_path, data, signum, mode, situation):
    args = [*TINY, *MODES[mode], "--data-dir", str(tmp_path / "cache"), *situation_args(mode, situation, tmp_path, data)]
    cmd = [*mpiexec_command(find_mpiexec(), 2), sys.executable, "-m", "minidist.train", *args]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                           env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), start_new_session=True)
    before = wait_for(job, SHOWN[mode]) if mode in SHOWN else wait_busy(job)
    ranks = ranks_of(job)
    assert len(ranks) == 2, ranks
    sent = time.monotonic()
    signal_processes(ranks, signum)  # the ranks themselves, as a batch system does (the same under any MPI)
    after, stderr = finish(job, timeout=30.0)
    seconds = time.monotonic() - sent
    assert job.returncode == 128 + signum, after + stderr
    assert seconds < 10.0, f"the ranks took {seconds:.1f} s to stop"
    return assert_quiet(before, after, stderr)


def wait_busy(job, cpu_seconds: float = 3.0, timeout: float = 60.0) -> list:
    """Nothing printed yet (the parameter servers say nothing while they train): wait until each rank has
    used ``cpu_seconds`` of CPU, past its imports and its start."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ranks = ranks_of(job)
        used = [sum(int(x) for x in Path(f"/proc/{r.pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13])
                / os.sysconf("SC_CLK_TCK") for r in ranks] if len(ranks) == 2 else []
        if used and min(used) >= cpu_seconds:
            return []
        time.sleep(0.2)
    raise AssertionError("the job's ranks did not get going")


def check_left(tmp_path, data, mode, situation, line) -> None:
    """The stop line names what to continue from, it verifies, and nothing of the run is left behind."""
    ckpt, offload = tmp_path / "ckpt", tmp_path / "offload"
    if mode == "ps":
        assert line.endswith("no --ckpt-dir, so nothing to resume from"), line
    elif mode == "pbt":
        files = sorted((ckpt / "population").glob("step-*.json"))
        assert files and line.endswith(f"the newest population is {files[-1]}: --resume continues from it"), line
        for member in sorted(ckpt.glob("member-*")):
            newest = step_dirs(member)[-1]
            assert latest_valid(member, log=lambda _: None) == newest, member
    else:  # (by step 4 a save has completed: the one in flight when the signal came is removed)
        newest = step_dirs(ckpt)[-1]
        assert line.endswith(f"the newest checkpoint is {newest}: --resume continues from it"), line
        assert latest_valid(ckpt, log=lambda _: None) == newest
    every = [p for root in (ckpt, offload, data) if root.exists() for p in root.rglob("*")]
    left = [p for p in every if p.name.startswith(LEFTOVERS) or ".tmp" in p.name]
    assert not left, left
    if offload.exists():
        assert all(p.name == ".minidist.lock" for p in offload.rglob("*") if p.is_file()), list(offload.rglob("*"))


def check_cell(tmp_path, data, cell) -> None:
    signum, mode, situation = cell
    line = run_cell(tmp_path, data, signum, mode, situation)
    name = signal.Signals(signum).name
    assert line.startswith(f"python -m minidist.train: stopped by {name}"), line
    check_left(tmp_path, data, mode, situation, line)


@pytest.mark.parametrize("cell", SAMPLE, ids=cell_id)
def test_a_stop_ends_every_rank_at_once_and_leaves_nothing_behind(tmp_path, data, cell):
    check_cell(tmp_path, data, cell)


@pytest.mark.slow
@pytest.mark.parametrize("repeat", range(5))
@pytest.mark.parametrize("cell", CELLS, ids=cell_id)
def test_the_whole_stop_matrix_five_times_over(tmp_path, data, cell, repeat):
    check_cell(tmp_path, data, cell)


def test_the_sample_holds_every_signal_mode_and_situation():
    for i, values in enumerate(((signal.SIGINT, signal.SIGTERM), MODES, SITUATIONS)):
        assert {c[i] for c in SAMPLE} >= set(values), i
    assert set(SAMPLE) <= set(CELLS)
