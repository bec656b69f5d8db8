"""The restarting launcher (``python -m minidist.run``) on a tiny checkpointed job (tests/mpi/restartable.py):

- a rank killed at step k: the whole job restarts with --resume from the latest valid checkpoint,
  and its final state equals an uninterrupted run's, bitwise;
- elastic: the restart may use another number of ranks; the checkpoint reshards on load;
- a corrupted latest checkpoint is skipped with a message naming the file, the previous one is used;
- a job that keeps failing is given up after --max-restarts, with a non-zero exit code; with no
  checkpoint to resume from it restarts from the start WITHOUT --resume (which would refuse);
- SIGTERM, SIGHUP and SIGINT end the whole job (mpiexec and every rank; SIGKILL after --grace for a
  rank that ignores them) and nothing restarts; the launcher exits 128 + the signal's number;
- a configuration error (exit 2), a collective mismatch (exit 4) and mpiexec refusing the job before
  it started anything (exit 255, then 2) are not retried; a collective time-out (exit 3) and the
  launcher's own --timeout are named as what they are;
- bad launcher arguments fail at once with a clear message.
"""
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from minidist.checkpoint.format import rank_file, step_dir
from minidist.process_tree import read_process
from minidist.launchers import job_command, mpiexec_flags, mpiexec_flavour
from minidist.run import checkpoint_dir, parse_args
from tests.mpi.harness import HERE, REPO, find_mpiexec, run_mpi

SCRIPT = str(HERE / "restartable.py")
JOB = str(HERE / "launcher_job.py")


def launch(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "minidist.run", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout)


def uninterrupted(tmp_path, n=2, steps=10):
    run_mpi(n, SCRIPT, "--ckpt-dir", tmp_path / "ref-ckpt", "--steps", steps, "--out", tmp_path / "ref.npy",
            timeout=60)
    return np.load(tmp_path / "ref.npy")


def job_args(tmp_path, *extra):
    return ["--", SCRIPT, "--ckpt-dir", tmp_path / "ckpt", "--steps", 10, "--save-every", 3,
            "--out", tmp_path / "w.npy", *extra]


def test_a_killed_rank_restarts_the_job_from_the_checkpoint_and_ends_as_if_never_interrupted(tmp_path):
    run = launch("-n", 2, "--max-restarts", 2, "--timeout", 60,
                 *job_args(tmp_path, "--fail-at-step", 7, "--fail-rank", 1))
    assert run.returncode == 0, run.stderr
    assert "attempt 1 exited with code" in run.stderr
    assert f"restart 1/2 on 2 ranks with --resume from checkpoint {step_dir(tmp_path / 'ckpt', 6)}" in run.stderr
    assert "resumed from step-000006 (saved on 2 ranks) at step 6 on 2 ranks" in run.stdout
    assert np.array_equal(np.load(tmp_path / "w.npy"), uninterrupted(tmp_path))


def test_elastic_restart_on_another_world_size_reshards_the_checkpoint(tmp_path):
    run = launch("-n", 2, "--max-restarts", 1, "--elastic-n", 3, "--timeout", 60,
                 *job_args(tmp_path, "--fail-at-step", 4, "--fail-rank", 0))
    assert run.returncode == 0, run.stderr
    assert "resumed from step-000003 (saved on 2 ranks) at step 3 on 3 ranks" in run.stdout
    # the same numbers; only the all-reduce's order of summation over 2 or 3 ranks differs
    np.testing.assert_allclose(np.load(tmp_path / "w.npy"), uninterrupted(tmp_path), rtol=1e-13)


def test_a_corrupted_latest_checkpoint_is_skipped_with_a_clear_message(tmp_path):
    first = launch("-n", 2, *job_args(tmp_path, "--fail-at-step", 8, "--fail-rank", 0))
    assert first.returncode != 0 and "giving up after 0 restart(s)" in first.stderr
    bad = step_dir(tmp_path / "ckpt", 6) / rank_file(1)
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit pattern in the last value
    bad.write_bytes(bytes(data))
    run = launch("-n", 2, *job_args(tmp_path, "--resume"))
    assert run.returncode == 0, run.stderr
    assert f"checkpoint step-000006 skipped: {bad}: checksum mismatch" in run.stderr
    assert "resumed from step-000003" in run.stdout
    assert np.array_equal(np.load(tmp_path / "w.npy"), uninterrupted(tmp_path))


def test_a_job_that_keeps_failing_is_given_up(tmp_path):
    run = launch("-n", 2, "--max-restarts", 1, *job_args(tmp_path, "--always-fail"))
    assert run.returncode != 0
    assert run.stderr.count("exited with code") == 2 and "giving up after 1 restart(s)" in run.stderr
    assert f"from the start (no valid checkpoint in {tmp_path / 'ckpt'})" in run.stderr
    second = next(line for line in run.stderr.splitlines() if "attempt 2/2:" in line)
    assert "--resume" not in second  # the trainer's --resume refuses to start without a checkpoint


def test_job_command_substitutes_n_and_adds_resume_once():
    assert job_command(["mpiexec"], 3, ["-m", "minidist.train", "--dp", "{n}"], resume=True) == \
        ["mpiexec", "-n", "3", sys.executable, "-m", "minidist.train", "--dp", "3", "--resume"]
    assert job_command(["mpiexec"], 2, ["s.py", "--resume"], resume=True)[-2:] == ["s.py", "--resume"]
    assert checkpoint_dir(["s.py", "--ckpt-dir", "a"]) == "a" and checkpoint_dir(["--ckpt-dir=b"]) == "b"
    assert checkpoint_dir(["s.py"]) is None


@pytest.mark.parametrize("says, flags", [("mpiexec (Open MPI) 5.0.11", ["--oversubscribe"]),
                                         ("HYDRA build details:", []), ("something else", [])])
def test_open_mpi_alone_gets_oversubscribe_so_more_ranks_than_cores_start(tmp_path, says, flags):
    fake = tmp_path / "mpiexec"
    fake.write_text(f"#!/bin/sh\necho '{says}'\n")
    fake.chmod(0o755)
    assert mpiexec_flags(str(fake)) == flags
    assert mpiexec_flags(str(fake), allow_root=True) == flags + ["--allow-run-as-root"] * bool(flags)
    assert job_command([str(fake), *flags], 2, ["s.py"], False) == [str(fake), *flags, "-n", "2", sys.executable, "s.py"]


@pytest.mark.parametrize("argv, message", [
    (["-n", "2"], "nothing to run"),
    (["-n", "0", "--", "s.py"], "-n and --elastic-n must be >= 1"),
    (["-n", "2", "--max-restarts", "-1", "--", "s.py"], "--max-restarts must be >= 0"),
    (["-n", "2", "--timeout", "0", "--", "s.py"], "--timeout must be a positive number of seconds, got 0.0"),
    (["-n", "2", "--timeout", "nan", "--", "s.py"], "--timeout must be a positive number of seconds, got nan"),
    (["-n", "2", "--grace", "-1", "--", "s.py"], "--grace must be a number of seconds from 0 to 3600, got -1.0"),
    (["-n", "2", "--grace", "1e308", "--", "s.py"], "--grace must be a number of seconds from 0 to 3600, got 1e+308"),
])
def test_bad_arguments_fail_clearly(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def start_launcher(*args):
    return subprocess.Popen([sys.executable, "-m", "minidist.run", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)


def rank_pids(out, n=2, wait=60.0):
    """The pids the n ranks of launcher_job.py wrote, once all have."""
    deadline = time.monotonic() + wait
    files = [out / f"rank{r}.pid" for r in range(n)]
    while not all(f.exists() and f.read_text() for f in files):
        if time.monotonic() > deadline:
            raise AssertionError(f"the ranks did not start within {wait}s")
        time.sleep(0.1)
    return [int(f.read_text()) for f in files]


def running(pid):
    process = read_process(pid)
    return process is not None and process.state not in ("Z", "X")  # a zombie has ended


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_a_stop_signal_ends_the_whole_job_and_restarts_nothing(tmp_path, signum):
    launcher = start_launcher("-n", 2, "--max-restarts", 2, "--grace", 3, "--", JOB, "sleep", tmp_path)
    try:
        pids = rank_pids(tmp_path)
        launcher.send_signal(signum)
        _, stderr = launcher.communicate(timeout=60)  # a safety net: it ends within its grace
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signum, stderr
    assert f"stopped by {signum.name}: the job was ended" in stderr and "attempt 2" not in stderr
    assert not [pid for pid in pids if running(pid)], "a rank outlived the launcher"
    assert (tmp_path / "attempts").read_text().count("sleep") == 1


def test_a_job_that_ignores_the_stop_signal_is_killed_after_the_grace_period(tmp_path):
    launcher = start_launcher("-n", 2, "--grace", 1, "--", JOB, "sleep", tmp_path, "--ignore-signals")
    try:
        pids = rank_pids(tmp_path)
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=60)  # a safety net: it ends within its grace
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM, stderr
    if mpiexec_flavour(find_mpiexec()) != "openmpi":  # Open MPI's mpiexec SIGKILLs such ranks itself
        assert "did not end within 1s of SIGTERM: killing it (SIGKILL)" in stderr
    assert not [pid for pid in pids if running(pid)], "a rank outlived the launcher"


def test_the_launchers_time_limit_ends_the_job_and_is_named_a_time_limit(tmp_path):
    run = launch("-n", 2, "--timeout", 3, "--grace", 1, "--", JOB, "sleep", tmp_path)
    assert run.returncode == 124, run.stderr
    assert "attempt 1 hit the time limit of 3s (--timeout)" in run.stderr
    started = [int(f.read_text()) for f in tmp_path.glob("rank*.pid") if f.read_text()]  # however many had, in 3 s
    assert not [pid for pid in started if running(pid)]


def test_a_collective_time_out_is_named_and_retried(tmp_path):
    run = launch("-n", 2, "--max-restarts", 1, "--", JOB, "timeout", tmp_path)
    assert run.returncode == 3, run.stderr
    assert "attempt 1 exited with code 3: a collective timed out: a rank hung or was lost" in run.stderr
    assert "a rank died or raised" not in run.stderr
    assert (tmp_path / "attempts").read_text().count("timeout") == 2


def test_a_configuration_error_is_not_retried(tmp_path):
    run = launch("-n", 2, "--max-restarts", 2, "--", "-m", "minidist.train", "--dp", 3, "--data-dir", tmp_path)
    assert run.returncode == 2, run.stderr
    assert "world size 2 != dp * tp" in run.stderr
    assert "not restarting: the job refused its configuration" in run.stderr and "attempt 2" not in run.stderr


@pytest.mark.skipif(mpiexec_flavour(find_mpiexec()) == "openmpi", reason="hydra's exit status for its own errors")
@pytest.mark.parametrize("args", [["--no-such-flag"], ["-genv", "X"]], ids=["unknown-flag", "no-rank-started"])
def test_a_job_mpiexec_refused_before_any_rank_started_is_not_retried(args):
    """Was: exit 255 read as "a rank died or raised", and the refused job tried --max-restarts times
    again. (-genv X takes -n as X's value, and hydra's proxy then fails to start the program "1".)"""
    run = launch("-n", 1, "--max-restarts", 3, "--launcher-args", *args, "--", "-c", "pass")
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("minidist.run:")]
    assert lines[1:] == ["minidist.run: attempt 1: mpiexec refused the job (exit 255 before any rank started; its "
                         "own message is above): not restarting, a restart would be refused the same way"], lines


def test_exit_255_from_a_rank_that_started_is_still_retried():
    run = launch("-n", 1, "--max-restarts", 1, "--", "-c", "import sys; sys.exit(255)")
    assert run.returncode == 255 and "attempt 2/2" in run.stderr and "refused the job" not in run.stderr, run.stderr


def test_a_collective_mismatch_is_not_retried(tmp_path):
    run = launch("-n", 2, "--max-restarts", 2, "--", JOB, "mismatch", tmp_path)
    assert run.returncode == 4, run.stderr
    assert "not restarting: the ranks called different collectives" in run.stderr
    assert (tmp_path / "attempts").read_text().count("mismatch") == 1


def test_elastic_restart_with_the_failed_rank_outside_the_smaller_world(tmp_path):
    """--fail-rank 2 on 3 ranks, restarted on 2: fault injection is off when resuming, so the
    2-rank world must not reject --fail-rank 2."""
    run = launch("-n", 3, "--elastic-n", 2, "--max-restarts", 1, "--timeout", 120, "--",
                 "-m", "minidist.train", "--dp", "{n}", "--steps", 5, "--batch-size", 6, "--n-layer", 1,
                 "--n-head", 2, "--n-embd", 16, "--block-size", 16, "--eval-iters", 1, "--sample-tokens", 0,
                 "--data-dir", tmp_path / "data", "--ckpt-dir", tmp_path / "ckpt", "--save-every", 2,
                 "--fail-at-step", 3, "--fail-rank", 2, timeout=150)
    assert run.returncode == 0, run.stderr
    assert "restart 1/1 on 2 ranks with --resume from checkpoint" in run.stderr
    assert "final: train loss" in run.stdout
