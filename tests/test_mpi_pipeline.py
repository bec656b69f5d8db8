"""Pipeline parallelism under real MPI: one ``mpiexec -n 4`` launch (tests/mpi/pp_checks.py) trains
pp in {2, 4} with each schedule (the zero-bubble ones too), alone and with dp or tp, against one
process; measures in-flight micro-batches, and checks each rank ran the simulator's order. (8-rank dp x tp x pp: tests/test_pipeline_3d.py, in-process.)"""
import json
import re

import pytest

from tests.mpi.harness import find_mpiexec, run_mpi

pytestmark = pytest.mark.skipif(find_mpiexec() is None, reason="mpiexec not found")


@pytest.fixture(scope="module")
def launch(request):
    """One launch: each layout with one optimizer, alternating (with --slow: both)."""
    both = ["--both-optimizers"] if request.config.getoption("--slow") else []
    return run_mpi(4, "pp_checks.py", *both, timeout=240)


@pytest.mark.parametrize("layout", [
    "dp=1 pp=2 tp=1 schedule=gpipe m=4 v=1", "dp=1 pp=2 tp=1 schedule=1f1b m=4 v=1",
    "dp=1 pp=2 tp=1 schedule=interleaved m=2 v=2", "dp=1 pp=4 tp=1 schedule=gpipe m=4 v=1",
    "dp=1 pp=4 tp=1 schedule=1f1b m=8 v=1", "dp=1 pp=4 tp=1 schedule=interleaved m=4 v=2",
    "dp=2 pp=2 tp=1 schedule=1f1b m=2 v=1", "dp=1 pp=2 tp=2 schedule=interleaved m=2 v=2",
    "dp=1 pp=2 tp=2 schedule=1f1b m=4 v=1", "dp=1 pp=2 tp=1 schedule=zb-h1 m=4 v=1",
    "dp=1 pp=4 tp=1 schedule=zb-h1 m=8 v=1", "dp=1 pp=2 tp=1 schedule=zbv m=4 v=2",
    "dp=1 pp=4 tp=1 schedule=zbv m=8 v=2", "dp=2 pp=2 tp=1 schedule=zb-h1 m=2 v=1",
    "dp=1 pp=2 tp=2 schedule=zbv m=2 v=2",
])
def test_every_layout_matches_one_process_with_sgd_and_adamw(launch, layout):
    """By default each layout trains with one optimizer, SGD and AdamW alternating down the list, so
    both run over pp 2 and 4 and every schedule; with --slow every layout trains with both."""
    found = set(re.findall(rf"PARITY {layout} optimizer=(\w+)\n", launch.stdout))
    assert found and found <= {"sgd", "adamw"}, launch.output
    assert set(re.findall(r"PARITY .* optimizer=(\w+)\n", launch.stdout)) == {"sgd", "adamw"}, launch.output


def test_peak_in_flight_is_m_for_gpipe_and_min_p_minus_stage_m_for_1f1b(launch):
    peaks = {(s, int(p), int(m)): json.loads(v) for s, p, m, v in
             re.findall(r"INFLIGHT schedule=([\w-]+) pp=(\d) m=(\d+) peaks=(\[[\d, ]+\])", launch.stdout)}
    assert peaks[("gpipe", 2, 4)] == [4, 4] and peaks[("gpipe", 4, 4)] == [4, 4, 4, 4], launch.output
    assert peaks[("1f1b", 2, 4)] == [2, 1] and peaks[("1f1b", 4, 8)] == [4, 3, 2, 1], launch.output
    assert max(peaks[("zb-h1", 4, 8)]) == 4, launch.output  # ZB-H1: 1F1B's peak, held until W


def test_every_rank_runs_its_schedule_in_order_keeping_every_dependency(launch):
    """Across processes, on the machine's shared clock: each rank's compute actions in the simulator's
    order, no F (B) before its input (gradient) came (tests/test_pipeline_engine.py's ``as_scheduled``).
    The measured bubble is printed beside the formula (BUBBLE lines), not asserted: it is a timing."""
    found = re.findall(r"SCHEDULED schedule=([\w-]+) .* problems=(\d+)", launch.stdout)
    assert {s for s, _ in found} == {"gpipe", "1f1b", "interleaved", "zb-h1", "zbv"}, launch.output
    assert all(n == "0" for _, n in found), launch.output
