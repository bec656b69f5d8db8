"""Pipeline parallelism under real MPI: one ``mpiexec -n 4`` launch (tests/mpi/pp_checks.py) trains
pp in {2, 4} with each schedule (the zero-bubble ones too), alone and with dp or tp, against one
process; measures in-flight micro-batches, and checks each rank ran the simulator's order. (8-rank dp x tp x pp: tests/test_pipeline_3d.py, in-process.)"""
import json
import re

import pytest

from tests.mpi.harness import find_mpiexec, run_mpi

pytestmark = pytest.mark.skipif(find_mpiexec() is None, reason="mpiexec not found")


LAYOUTS = [
    "dp=1 pp=2 tp=1 schedule=gpipe m=4 v=1", "dp=1 pp=2 tp=1 schedule=1f1b m=4 v=1",
    "dp=1 pp=2 tp=1 schedule=interleaved m=2 v=2", "dp=1 pp=4 tp=1 schedule=gpipe m=4 v=1",
    "dp=1 pp=4 tp=1 schedule=1f1b m=8 v=1", "dp=1 pp=4 tp=1 schedule=interleaved m=4 v=2",
    "dp=2 pp=2 tp=1 schedule=1f1b m=2 v=1", "dp=1 pp=2 tp=2 schedule=interleaved m=2 v=2",
    "dp=1 pp=2 tp=2 schedule=1f1b m=4 v=1", "dp=1 pp=2 tp=1 schedule=zb-h1 m=4 v=1",
    "dp=1 pp=4 tp=1 schedule=zb-h1 m=8 v=1", "dp=1 pp=2 tp=1 schedule=zbv m=4 v=2",
    "dp=1 pp=4 tp=1 schedule=zbv m=8 v=2", "dp=2 pp=2 tp=1 schedule=zb-h1 m=2 v=1",
    "dp=1 pp=2 tp=2 schedule=zbv m=2 v=2",
]


def test_every_layout_and_schedule_under_mpi(request):
    """One launch, one test (so that pytest-xdist runs it on one worker, once; three tests sharing a
    module fixture launched it on each worker that drew one of them):

    - every layout matches one process: by default each trains with one optimizer, SGD and AdamW
      alternating down the list, so both run over pp 2 and 4 and every schedule; with --slow every
      layout trains with both;
    - the peak of micro-batches in flight is m for GPipe and min(p - stage, m) for 1F1B (ZB-H1 keeps
      1F1B's peak until W);
    - across processes, on the machine's shared clock, each rank's compute actions run in the
      simulator's order, no F (B) before its input (gradient) came (tests/test_pipeline_engine.py's
      ``as_scheduled``). The measured bubble is printed beside the formula (BUBBLE lines), not
      asserted: it is a timing."""
    both = ["--both-optimizers"] if request.config.getoption("--slow") else []
    launch = run_mpi(4, "pp_checks.py", *both, timeout=240)
    for layout in LAYOUTS:
        found = set(re.findall(rf"PARITY {layout} optimizer=(\w+)\n", launch.stdout))
        assert found and found <= {"sgd", "adamw"}, f"{layout}: no parity line\n{launch.output}"
    assert set(re.findall(r"PARITY .* optimizer=(\w+)\n", launch.stdout)) == {"sgd", "adamw"}, launch.output

    peaks = {(s, int(p), int(m)): json.loads(v) for s, p, m, v in
             re.findall(r"INFLIGHT schedule=([\w-]+) pp=(\d) m=(\d+) peaks=(\[[\d, ]+\])", launch.stdout)}
    assert peaks[("gpipe", 2, 4)] == [4, 4] and peaks[("gpipe", 4, 4)] == [4, 4, 4, 4], launch.output
    assert peaks[("1f1b", 2, 4)] == [2, 1] and peaks[("1f1b", 4, 8)] == [4, 3, 2, 1], launch.output
    assert max(peaks[("zb-h1", 4, 8)]) == 4, launch.output  # ZB-H1: 1F1B's peak, held until W

    found = re.findall(r"SCHEDULED schedule=([\w-]+) .* problems=(\d+)", launch.stdout)
    assert {s for s, _ in found} == {"gpipe", "1f1b", "interleaved", "zb-h1", "zbv"}, launch.output
    assert all(n == "0" for _, n in found), launch.output
