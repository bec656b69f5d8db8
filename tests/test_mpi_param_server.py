"""Parameter-server training under real MPI (one mpiexec launch, 4 ranks, several layouts).

In-process tests (tests/test_param_server.py) prove the rules; this one proves the same code runs
over MPI processes: synchronous training with 1 and 2 servers equals one process to 1e-10, an
asynchronous run keeps its staleness bound, and asynchronous training with one worker is exact.
"""
import re

import pytest

from tests.mpi.harness import find_mpiexec, run_mpi


@pytest.mark.skipif(find_mpiexec() is None, reason="mpiexec not found")
def test_parameter_server_layouts_under_mpi():
    run = run_mpi(4, "ps_parity.py", timeout=120)
    assert len(re.findall(r"^OK ", run.stdout, re.M)) == 4, run.output
    assert re.search(r"OK sgd servers=1 workers=3 staleness=1: 3[0-2] updates, max staleness [1-6]", run.stdout), run.output
    assert "PS OK" in run.stdout, run.output
