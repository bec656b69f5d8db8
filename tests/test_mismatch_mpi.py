"""Under real MPI: ranks that disagree about a collective end the job with status 4 (EXIT_MISMATCH)
and a message naming the call and the ranks, with no debug flag; a stopped rank is named as the one
that never arrived by the ranks that time out waiting, whichever neighbour each of them waited on."""
import re

import pytest

from minidist.comm.transport import EXIT_MISMATCH
from tests.mpi.harness import find_mpiexec, run_mpi

needs_mpi = pytest.mark.skipif(find_mpiexec() is None, reason="mpiexec not found")


@pytest.mark.parametrize("backend", ["ring", "mpi"])
@needs_mpi
def test_a_mismatch_by_default_aborts_the_job_with_status_4_naming_op_and_ranks(backend):
    run = run_mpi(3, "failures.py", "disagree", backend, timeout=150, check=False)
    assert run.returncode == EXIT_MISMATCH, run.output
    # the rank whose abort wins tells it: rank 1 (its neighbours differ from it) or rank 0 or 2
    assert "CollectiveMismatchError: all_reduce #1 on group 'world': rank " in run.stderr, run.output
    assert "rank 1 called all_reduce with dtype float64, count 4" in run.stderr, run.output
    assert "CommTimeoutError" not in run.stderr, run.output  # the fingerprint caught it: nobody timed out


@needs_mpi
def test_a_stopped_rank_is_named_in_the_timeout_and_the_flight_record():
    run = run_mpi(4, "failures.py", "stopped", timeout=60, check=False)
    assert run.returncode != 0, run.output  # 3 (EXIT_COMM_TIMEOUT), or 9 when mpiexec reports the stopped rank's kill
    named = re.findall(r"CommTimeoutError: all_reduce #3 on group 'world': rank (\d) waited [\d.]+s for rank (\d).*"
                       r"Census: rank 3 never arrived at all_reduce #3 \(no answer in 1\.0s: stopped, hung or busy "
                       r"elsewhere\); ranks 0,1,2 waited in it", run.stderr)
    assert named, run.output  # at least the rank whose error aborted the job said it
    assert "flight recorder, rank" in run.stderr and "Census: rank 3 never arrived" in run.stderr
