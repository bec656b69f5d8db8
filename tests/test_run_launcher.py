"""The restarting launcher (``python -m minidist.run``) on a tiny checkpointed job (tests/mpi/restartable.py):

- a rank killed at step k: the whole job restarts with --resume from the latest valid checkpoint,
  and its final state equals an uninterrupted run's, bitwise;
- elastic: the restart may use another number of ranks; the checkpoint reshards on load;
- a corrupted latest checkpoint is skipped with a message naming the file, the previous one is used;
- a job that keeps failing is given up after --max-restarts, with a non-zero exit code;
- bad launcher arguments fail at once with a clear message.
"""
import subprocess
import sys

import numpy as np
import pytest

from minidist.checkpoint.format import rank_file, step_dir
from minidist.run import checkpoint_dir, job_command, parse_args
from tests.mpi.harness import HERE, REPO, run_mpi

SCRIPT = str(HERE / "restartable.py")


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


def test_job_command_substitutes_n_and_adds_resume_once():
    assert job_command("mpiexec", 3, ["-m", "minidist.train", "--dp", "{n}"], resume=True) == \
        ["mpiexec", "-n", "3", sys.executable, "-m", "minidist.train", "--dp", "3", "--resume"]
    assert job_command("mpiexec", 2, ["s.py", "--resume"], resume=True)[-2:] == ["s.py", "--resume"]
    assert checkpoint_dir(["s.py", "--ckpt-dir", "a"]) == "a" and checkpoint_dir(["--ckpt-dir=b"]) == "b"
    assert checkpoint_dir(["s.py"]) is None


@pytest.mark.parametrize("argv, message", [
    (["-n", "2"], "nothing to run"),
    (["-n", "0", "--", "s.py"], "-n and --elastic-n must be >= 1"),
    (["-n", "2", "--max-restarts", "-1", "--", "s.py"], "--max-restarts must be >= 0"),
])
def test_bad_arguments_fail_clearly(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err
