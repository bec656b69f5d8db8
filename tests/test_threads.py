"""Fast as written: ranks sharing a machine take their share of its cores for BLAS threads
(minidist/threads.py), through the trainer's main and every lesson's check_launch, unless the user
set OMP_NUM_THREADS; rank 0 says so in one line, only when it limits.

The pools are read with threadpoolctl's ``threadpool_info()`` in a fresh process (a pool is
process-wide). Each script first sizes NumPy's pool to 4 threads, as a 4-core machine's would be, so
the numbers do not depend on the machine the tests run on.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from minidist.threads import blas_threads, machine_cores
from tests.mpi.harness import REPO, find_mpiexec, mpiexec_command

SAID = re.compile(r"^(\d+) ranks share this machine's (\d+) cores: (\d+) BLAS threads? each "
                  r"\(set OMP_NUM_THREADS to choose\)$", flags=re.M)
POOL_OF_4 = "import numpy, threadpoolctl; threadpoolctl.threadpool_limits(4)\n"
POOLS = "print(json.dumps([p['num_threads'] for p in threadpoolctl.threadpool_info()]))\n"


def python(code: str, *args, omp: str | None = None):
    """Run ``code`` in a fresh interpreter with OMP_NUM_THREADS ``omp`` (None: unset); its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    done = subprocess.run([sys.executable, "-c", "import json\n" + code, *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("cores, ranks, threads", [(2, 8, 1), (2, 2, 1), (2, 1, 2), (16, 4, 4), (16, 3, 5),
                                                   (1, 8, 1), (64, 1, 64), (4, 0, 4)])
def test_each_rank_takes_its_share_of_the_cores_at_least_one(cores, ranks, threads):
    assert blas_threads(cores, ranks) == threads


LIMIT = POOL_OF_4 + """import sys
from minidist.threads import limit_blas_threads
limit = limit_blas_threads(sys.argv[1] or None, ranks_here=int(sys.argv[2]), cores=4)
print(json.dumps(limit))
""" + POOLS


@pytest.mark.parametrize("omp, ranks, limit, pools", [
    ("", 8, 1, [1]),  # 8 ranks on 4 cores: 1 thread each
    ("", 2, 2, [2]),  # 2 ranks: 2 each
    ("", 1, None, [4]),  # alone: the whole machine, nothing changed, nothing said
    ("3", 8, None, [4]),  # the user chose: nothing changed
])
def test_the_pool_is_limited_unless_omp_num_threads_is_set(omp, ranks, limit, pools):
    out = python(LIMIT, omp, ranks).splitlines()
    assert [json.loads(out[-2]), json.loads(out[-1])] == [limit, pools]
    said = SAID.findall("\n".join(out))
    assert said == ([(str(ranks), "4", str(limit))] if limit else [])


LESSON = POOL_OF_4 + """import argparse
from minidist.launch_check import check_launch
p = argparse.ArgumentParser()
p.add_argument("--local", type=int)
check_launch(p, p.parse_args())
""" + POOLS


def test_a_lesson_on_thread_ranks_limits_at_its_launch_check_and_respects_omp_num_threads():
    out = python(LESSON, "--local", 512)  # 512 ranks as threads of one process: 1 thread each
    assert SAID.findall(out) == [("512", str(machine_cores()), "1")] and json.loads(out.splitlines()[-1]) == [1]
    out = python(LESSON, "--local", 512, omp="2")  # read by check_launch, the entry point
    assert not SAID.search(out) and json.loads(out.splitlines()[-1]) == [4]


@pytest.mark.skipif(find_mpiexec() is None, reason="needs mpiexec")
@pytest.mark.skipif(machine_cores() < 2, reason="one core: a pool of one is every rank's share already")
def test_the_trainer_under_mpiexec_says_it_once_from_rank_0(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cmd = [*mpiexec_command(find_mpiexec(), 2), sys.executable, "-m", "minidist.train", "--dp", "2", "--n-layer", "2",
           "--n-head", "4", "--n-embd", "16", "--block-size", "16", "--steps", "2", "--eval-iters", "1",
           "--sample-tokens", "0", "--data-dir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    cores = machine_cores()
    assert SAID.findall(done.stdout) == [("2", str(cores), str(blas_threads(cores, 2)))], done.stdout
    assert done.stdout.index("ranks share this machine") < done.stdout.index("parameters on rank 0")
