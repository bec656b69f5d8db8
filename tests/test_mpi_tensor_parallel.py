"""The tensor-parallel GPT in separate MPI processes: one mpiexec launch of 4 ranks checks tp=4 and
dp=2 x tp=2, with and without sequence parallelism, on the hand-written and MPI's own collectives,
against one process (see tests/mpi/tp_parity.py). Lesson 3 under mpiexec: tests/test_tutorials.py."""
import re

import pytest

from tests.mpi.harness import find_mpiexec, run_mpi


@pytest.mark.skipif(find_mpiexec() is None, reason="mpiexec not found")
def test_tensor_parallel_gpt_matches_one_process_under_mpi():
    run = run_mpi(4, "tp_parity.py", timeout=120)
    cases = re.findall(r"OK backend=(\w+) dp=(\d) tp=(\d) sequence_parallel=(\w+)", run.stdout)
    assert len(cases) == 8, run.output  # 2 backends x 2 layouts x with/without sequence parallelism

