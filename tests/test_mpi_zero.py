"""ZeRO under real MPI (one mpiexec launch, 4 ranks): stages 0-3 on dp 4, dp 2 and dp 2 x tp 2 match
one process over 10 float64 steps with SGD+momentum and AdamW; recomputation changes nothing; stage
3 sends 1.5x plain data parallelism and stages 1-2 the same; each rank holds the ZeRO paper's bytes.
See tests/mpi/zero_parity.py for the rank script."""
import re

import pytest

from tests.mpi.harness import find_mpiexec, run_mpi

needs_mpi = pytest.mark.skipif(find_mpiexec() is None, reason="mpiexec not found")


@needs_mpi
def test_zero_stages_match_one_process_and_the_formulas_under_mpi():
    run = run_mpi(4, "zero_parity.py", timeout=240)
    assert re.search(r"OK 27 checks on 4 ranks", run.stdout), run.output
