"""Tutorial 2 (data parallelism) runs both ways, over MPI and as threads in one process, shows the
buckets, the overlap timeline and accumulation, and passes its own checks against one process; and
those checks do fail on a wrong gradient (the classic missing 1/N)."""
import importlib.util
import os
import subprocess
import sys

import pytest

from minidist import run_local
from tests.mpi.harness import REPO, find_mpiexec, run_mpi

TUTORIAL = REPO / "tutorials" / "02_data_parallel.py"


def load_tutorial():
    spec = importlib.util.spec_from_file_location("tutorial_02", TUTORIAL)  # the name starts with a digit
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_lesson_ran(stdout, n_ranks=2):
    assert "=== 1. 7 buckets of >= 128 KiB" in stdout
    for r in range(n_ranks):
        assert f"rank {r}: " in stdout and "% of the all-reduce time ran while backward" in stdout
    assert stdout.count("    bucket 6  |") == n_ranks  # a timeline row per bucket per rank
    assert "backward of micro-batch 0: 0 all-reduces started" in stdout
    assert "backward of micro-batch 1: 7 all-reduces started" in stdout
    assert stdout.count("= one process's on the full batch") == 3  # 2 gradients, then the weights
    assert f"all {n_ranks} replicas hold bitwise identical weights" in stdout


@pytest.mark.skipif(find_mpiexec() is None, reason="mpiexec not found")
def test_tutorial_02_checks_itself_against_one_process_under_mpi():
    run = run_mpi(2, TUTORIAL, timeout=120)
    assert_lesson_ran(run.stdout)


def test_tutorial_02_checks_itself_against_one_process_in_process():
    run = subprocess.run([sys.executable, str(TUTORIAL), "--local", "2"], capture_output=True, text=True,
                         cwd=REPO, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert_lesson_ran(run.stdout)


def test_the_tutorials_check_fails_on_every_rank_when_gradients_are_summed_not_averaged():
    tutorial = load_tutorial()
    reference = tutorial.one_process_gradients()

    def fn(group):
        model = tutorial.GPT(tutorial.CONFIG, seed=0, dtype="float64")
        dp = tutorial.DataParallel(model, group, bucket_bytes=tutorial.BUCKET_BYTES)
        tutorial.forward_backward(model, [tutorial.my_rows(group, 0)], dp.no_sync, group.trace)
        dp.finish()
        summed = {name: group.size * p.grad for name, p in model.named_parameters()}  # forgot the 1/N
        with pytest.raises(AssertionError, match="differs from one process"):
            tutorial.check(group, "summed gradients", tutorial.worst_error(summed, reference))
        averaged = {name: p.grad.copy() for name, p in model.named_parameters()}
        return tutorial.worst_error(averaged, reference)

    assert all(worst < 1e-12 for worst in run_local(fn, world_size=2))
