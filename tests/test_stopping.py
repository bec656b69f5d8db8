"""Stopping a training job: SIGINT (Ctrl-C), SIGTERM and SIGHUP sent to a running ``mpiexec -n 2 python -m
minidist.train`` stop every rank at once, without a traceback; rank 0 prints one line, how far the run
got and the newest checkpoint (or that there is none), and the job exits with 128 + the signal's number.

MPICH's ``mpiexec`` (hydra) forwards SIGINT and SIGTERM to the ranks, SIGINT after two lines of its own
(minidist/train/stopping.py says which, and why they cannot be avoided). A signal sent to the ranks (as a
batch system or ``python -m minidist.run`` does) stops them alike under MPICH and Open MPI; Open MPI's
``mpiexec`` adds a boxed note of its own when a rank exits non-zero, which is its word, not the job's. SIGHUP sent to ``mpiexec``
itself is hydra's to handle, not the trainer's, and is not tested here: it usually killed ``mpiexec``
and with it the ranks, silently, but once in a default-suite run (27 Nov) the job trained on, so a test
of it failed by chance.

Each test signals once a line of the run's output says it is training, never after a time.
"""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from minidist.process_tree import descendants, signal_processes, wait_gone
from minidist.launchers import mpiexec_flavour
from tests.mpi.harness import REPO, find_mpiexec, mpiexec_command, ranks_said

TINY = ["--n-layer", "2", "--n-head", "4", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--eval-iters", "1", "--sample-tokens", "0"]
HYDRA_SIGINT = ["Sending Ctrl-C to processes as requested", "Press Ctrl-C again to force abort"]


def start(tmp_path, *args):
    """``mpiexec -n 2 python -m minidist.train`` on a tiny model with a long run, its output piped."""
    cmd = [*mpiexec_command(find_mpiexec(), 2), sys.executable, "-m", "minidist.train", *TINY,
           "--dp", "2", "--steps", "1000000", "--data-dir", str(tmp_path / "data"), *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), start_new_session=True)


def wait_for(job, pattern: str) -> list[str]:
    """The job's stdout lines up to the first that matches ``pattern``."""
    lines = []
    for line in job.stdout:
        lines.append(line)
        if re.match(pattern, line):
            return lines
    raise AssertionError("the job ended before " + pattern + ":\n" + "".join(lines) + job.stderr.read())


def finish(job, timeout: float = 60.0) -> tuple[str, str]:
    """The rest of the job's (stdout, stderr) once it has ended; past ``timeout`` it is killed, ranks and all."""
    try:
        return job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        ranks = descendants(job.pid)
        os.killpg(job.pid, signal.SIGKILL)
        signal_processes(ranks, signal.SIGKILL)
        wait_gone(ranks, 5.0)
        raise AssertionError("the job did not stop: " + "".join(job.communicate()))


def ranks_of(job) -> list:
    """The job's ranks: the processes under mpiexec that run the trainer."""
    def runs_trainer(process):
        try:
            return b"minidist.train" in Path(f"/proc/{process.pid}/cmdline").read_bytes()
        except OSError:
            return False
    return [p for p in descendants(job.pid) if runs_trainer(p)]


def assert_quiet(before: list[str], after: str, stderr: str) -> str:
    """The job's only line on stderr (which it returns); nothing on stdout after the signal but hydra's
    SIGINT lines, progress lines and a checkpoint's "saved" (or "saving ... in the background") line; no traceback anywhere."""
    everything = "".join(before) + after + stderr
    for noise in ("Traceback", "KeyboardInterrupt", "BAD TERMINATION", "YOUR APPLICATION TERMINATED"):
        assert noise not in everything, everything
    said = ranks_said(stderr)  # without Open MPI's own note on a rank's non-zero exit
    assert len(said.splitlines()) == 1, everything
    for line in after.splitlines():
        assert (any(h in line for h in HYDRA_SIGINT) or re.search(r"\bsteps?\b.*\bloss\b", line)
                or line.startswith(("saved ", "saving "))), everything
    return said.strip()


def stop_ranks(job, signum) -> None:
    """Send ``signum`` to the job's ranks themselves, as a batch system or ``python -m minidist.run``
    does: the trainer's stop under any MPI (Open MPI's mpiexec, signalled itself, ends the job its own way)."""
    ranks = ranks_of(job)
    assert len(ranks) == 2, ranks
    signal_processes(ranks, signum)


@pytest.mark.skipif(bool(find_mpiexec()) and mpiexec_flavour(find_mpiexec()) == "openmpi",
                    reason="hydra's forwarding (MPICH): Open MPI's mpiexec, sent SIGINT or SIGTERM, ends the ranks "
                           "itself and exits 1, and their stop line does not reach its output (Open MPI 5.0)")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_mpiexec_stops_the_job_with_one_line(tmp_path, signum):
    job = start(tmp_path, "--eval-every", 1000000)
    before = wait_for(job, r"step\s+1\s+train loss")
    job.send_signal(signum)
    after, stderr = finish(job)
    assert job.returncode == 128 + signum, after + stderr
    line = assert_quiet(before, after, stderr)
    name = signal.Signals(signum).name
    assert re.fullmatch(rf"python -m minidist\.train: stopped by {name} (after \d+ of 1000000 steps|before it "
                        r"finished a step); no --ckpt-dir, so nothing to resume from", line), line
    if signum == signal.SIGINT:  # hydra's own two lines, before it forwards Ctrl-C (stopping.py)
        assert [h for h in HYDRA_SIGINT if h in after] == HYDRA_SIGINT, after


def test_sighup_to_the_ranks_stops_the_job_with_one_line(tmp_path):
    job = start(tmp_path, "--eval-every", 1000000)
    before = wait_for(job, r"step\s+1\s+train loss")
    stop_ranks(job, signal.SIGHUP)
    after, stderr = finish(job)
    assert job.returncode == 128 + signal.SIGHUP, after + stderr
    assert "stopped by SIGHUP" in assert_quiet(before, after, stderr)


def test_a_stop_names_the_newest_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    job = start(tmp_path, "--ckpt-dir", ckpt, "--save-every", 1, "--eval-every", 1)
    before = wait_for(job, r"step\s+2\s+train loss")  # printed in the second step: the first one's checkpoint is saved
    stop_ranks(job, signal.SIGTERM)
    after, stderr = finish(job)
    assert job.returncode == 128 + signal.SIGTERM, after + stderr
    line = assert_quiet(before, after, stderr)
    found = re.fullmatch(rf"python -m minidist\.train: stopped by SIGTERM after (\d+) of 1000000 steps; the newest "
                         rf"checkpoint is {re.escape(str(ckpt))}/step-(\d+): --resume continues from it", line)
    assert found, line
    done, saved = int(found[1]), int(found[2])
    assert saved >= 1 and done <= saved <= done + 1  # a step counts as done just after its checkpoint
    assert sorted(p.name for p in ckpt.glob("step-*"))[-1] == f"step-{saved:06d}"


def test_a_stop_leaves_no_offload_file_behind(tmp_path):
    """ZeRO-Infinity's memory-mapped state under --offload-dir (several files per rank while the run
    lasts) goes when a signal stops the run, as when it ends or diverges: only the folders' lock files stay."""
    offload = tmp_path / "offload"
    job = start(tmp_path, "--zero", 2, "--offload", "optimizer", "--offload-dir", offload, "--eval-every", 1000000)
    before = wait_for(job, r"step\s+1\s+train loss")
    held = sorted(p.relative_to(offload).as_posix() for p in offload.rglob("*") if p.is_file())
    assert [p for p in held if p.startswith("rank0/") and not p.endswith(".minidist.lock")], held  # the state files
    stop_ranks(job, signal.SIGTERM)
    after, stderr = finish(job)
    assert job.returncode == 128 + signal.SIGTERM, after + stderr
    assert "stopped by SIGTERM" in assert_quiet(before, after, stderr)
    left = sorted(p.relative_to(offload).as_posix() for p in offload.rglob("*") if p.is_file())
    assert all(p.endswith(".minidist.lock") for p in left), left
