"""Checkpoints through the command line under real MPI: save, die, restart, resume in another layout.

- Saved at (dp 2, tp 2), a run resumes at (tp 2, pp 2) and at (dp 4) and ends where those layouts'
  uninterrupted runs end (float64, 1e-10).
- Resumed in the same layout it is bitwise the uninterrupted run (float32); an asynchronous save
  writes the very files a blocking one writes.
- ``python -m minidist.run --max-restarts 2`` restarts a job whose rank 1 was killed at step 5 from
  checkpoint 4, and the job ends with the weights of a run that never died.
- A corrupted newest checkpoint is skipped, saying which file is wrong; the one before it is used.
  Another run's checkpoint (--seed differs) is refused by every rank: exit status 2, naming the field.
"""
import shutil
import subprocess
import sys

import numpy as np
import pytest

from minidist.checkpoint import step_dir
from tests.mpi.harness import REPO, find_mpiexec, run_mpi

pytestmark = pytest.mark.skipif(find_mpiexec() is None, reason="needs mpiexec")
TINY = ["--n-layer", 2, "--n-head", 4, "--n-embd", 16, "--block-size", 16, "--batch-size", 8, "--steps", 6,
        "--eval-every", 100, "--eval-iters", 1, "--sample-tokens", 0, "--warmup", 2, "--lr", 1e-2,
        "--bucket-mb", 0.01]


def train(n, *flags, timeout=120):
    """``mpiexec -n n python -m minidist.train TINY flags``; its output."""
    return run_mpi(n, "-m", "minidist.train", *TINY, *flags, timeout=timeout).stdout


def weights(path):
    return dict(np.load(path))


def assert_close(a, b, rtol):
    assert a.keys() == b.keys()
    for k, v in b.items():
        assert np.abs(a[k] - v).max() <= rtol * np.abs(v).max(), k


def test_saved_at_dp2_tp2_resumes_in_other_layouts(data_dir, tmp_path):
    common = ["--data-dir", data_dir, "--dtype", "float64", "--optimizer", "sgd"]
    ckpt = tmp_path / "ckpt"
    train(4, *common, "--dp", 2, "--tp", 2, "--ckpt-dir", ckpt, "--save-every", 3)
    shutil.rmtree(step_dir(ckpt, 6))  # as if the job had died during steps 3..5
    for i, layout in enumerate([["--tp", 2, "--pp", 2, "--micro-batches", 2], ["--dp", 4]]):
        out = train(4, *common, *layout, "--ckpt-dir", ckpt, "--resume", "--export", tmp_path / f"resumed{i}.npz")
        assert f"resumed from {step_dir(ckpt, 3)} (step 3, saved by dp 2 x pp 1 x tp 2 = 4 ranks)" in out
        train(4, *common, *layout, "--export", tmp_path / f"whole{i}.npz")
        assert_close(weights(tmp_path / f"resumed{i}.npz"), weights(tmp_path / f"whole{i}.npz"), 1e-10)


def test_same_layout_resume_is_bitwise_and_async_saves_write_the_same_files(data_dir, tmp_path):
    common = ["--data-dir", data_dir, "--dtype", "float32", "--dp", 2, "--save-every", 3]
    train(2, *common, "--ckpt-dir", tmp_path / "sync", "--export", tmp_path / "whole.npz")
    train(2, *common, "--ckpt-dir", tmp_path / "async", "--async-save", "--export", tmp_path / "async.npz")
    for step in (3, 6):
        for r in range(2):
            name = f"rank-{r:05d}.safetensors"
            assert (step_dir(tmp_path / "sync", step) / name).read_bytes() == \
                (step_dir(tmp_path / "async", step) / name).read_bytes(), (step, name)
    shutil.rmtree(step_dir(tmp_path / "async", 6))
    train(2, *common, "--ckpt-dir", tmp_path / "async", "--resume", "--export", tmp_path / "resumed.npz")
    whole, resumed = weights(tmp_path / "whole.npz"), weights(tmp_path / "resumed.npz")
    assert all(np.array_equal(resumed[k], v) for k, v in whole.items())


def test_the_launcher_restarts_a_killed_job_from_its_last_checkpoint(data_dir, tmp_path):
    common = [*map(str, TINY), "--data-dir", str(data_dir), "--dp", "2", "--optimizer", "adamw"]
    train(2, *common, "--export", tmp_path / "whole.npz")
    done = subprocess.run([sys.executable, "-m", "minidist.run", "-n", "2", "--max-restarts", "2", "--timeout", "120",
                           "--", "-m", "minidist.train", *common, "--ckpt-dir", str(tmp_path / "ckpt"),
                           "--save-every", "2", "--fail-at-step", "5", "--fail-rank", "1",
                           "--export", str(tmp_path / "restarted.npz")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "attempt 1 " in done.stderr and "restart 1/2" in done.stderr and "attempt 2 finished" in done.stderr
    assert f"resumed from {step_dir(tmp_path / 'ckpt', 4)} (step 4," in done.stdout
    whole, restarted = weights(tmp_path / "whole.npz"), weights(tmp_path / "restarted.npz")
    assert all(np.array_equal(restarted[k], v) for k, v in whole.items())


def test_a_corrupted_newest_checkpoint_falls_back_to_the_one_before(data_dir, tmp_path):
    common = ["--data-dir", data_dir, "--dp", 2, "--ckpt-dir", tmp_path / "ckpt", "--save-every", 2]
    train(2, *common)
    broken = step_dir(tmp_path / "ckpt", 6) / "rank-00001.safetensors"
    data = bytearray(broken.read_bytes())
    data[-1] ^= 0xFF
    broken.write_bytes(bytes(data))
    out = train(2, *common, "--resume", "--steps", 6)
    assert f"checkpoint step-000006 skipped: {broken}: checksum mismatch" in out
    assert f"resumed from {step_dir(tmp_path / 'ckpt', 4)} (step 4," in out
    other = run_mpi(2, "-m", "minidist.train", *TINY, *common, "--resume", "--seed", 1, timeout=120, check=False)
    assert other.returncode == 2, other.output  # another run's checkpoint: every rank refuses, none hangs
    assert "is a checkpoint of another run; it differs in\n    seed: saved 0, now 1" in other.stderr
