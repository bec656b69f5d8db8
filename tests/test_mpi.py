"""The collective engine under real MPI: separate processes started by mpiexec.

Each test launches one mpiexec job (a rank script in tests/mpi/) and reads what the ranks printed.
The hand-written ring and all-to-all must equal MPI's own collectives bit for bit on 2, 3 and 4
ranks; a rank that skips a collective, a debug-mode mismatch, and a crashing rank must each end the
job with a clear error, never a hang (the harness kills a job that outlives its timeout, failing the
test).
"""
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.mpi.harness import find_mpiexec, run_mpi

needs_mpi = pytest.mark.skipif(find_mpiexec() is None, reason="mpiexec not found")


@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), 3, 4])  # 3: uneven; 4: a power of two
@needs_mpi
def test_ring_equals_mpi_for_every_collective_dtype_op_and_count(n):
    run = run_mpi(n, "ring_equals_mpi.py", timeout=120)
    assert re.search(rf"OK \d+ checks on {n} ranks", run.stdout), run.output


@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), 3, 4])
@needs_mpi
def test_all_to_all_equals_mpis_own_and_refuses_counts_that_disagree(n):
    run = run_mpi(n, "all_to_all_equals_mpi.py", timeout=60)
    assert re.search(rf"OK \d+ checks on {n} ranks", run.stdout), run.output


@pytest.mark.parametrize("n", [2, 4])
@needs_mpi
def test_rank_skipping_a_collective_times_out_on_the_others_naming_op_seq_rank_peer(n):
    run = run_mpi(n, "failures.py", "skip", timeout=60)
    lines = re.findall(r"TIMEOUT rank=(\d+) op=(\w+) seq=(\d+) peer=(\d+)", run.stdout)
    assert sorted(int(r) for r, *_ in lines) == list(range(n - 1)), run.output  # all but the skipper
    assert {op for _, op, _, _ in lines} == {"all_reduce"}, run.output
    assert len({seq for _, _, seq, _ in lines}) == 1, run.output  # the same call on every rank


@needs_mpi
def test_mismatch_in_debug_mode_raises_on_every_rank():
    run = run_mpi(3, "failures.py", "mismatch", timeout=60)
    assert sorted(re.findall(r"MISMATCH rank=(\d+)", run.stdout)) == ["0", "1", "2"], run.output


@needs_mpi
def test_uncaught_exception_on_one_rank_aborts_the_whole_job_quickly():
    run = run_mpi(3, "failures.py", "crash", timeout=150, check=False)
    assert run.returncode != 0, run.output
    assert "CommTimeoutError" not in run.stderr, run.output  # the abort ended the others, not their 120 s timeout
    assert "[rank 1]" in run.stderr and "rank 1 fails on purpose" in run.stderr, run.output


@needs_mpi
def test_harness_kills_a_hung_job_and_fails():
    with pytest.raises(AssertionError, match="hung for 2s and was killed"):  # killed: hang.py sleeps 600 s
        run_mpi(2, "hang.py", timeout=2)
    deadline = time.monotonic() + 60  # a safety net: killed ranks leave the process table once reaped
    while (leftovers := subprocess.run(["pgrep", "-f", "tests/mpi/hang.py"], capture_output=True,
                                       text=True).stdout) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers == "", f"ranks still running: {leftovers}"


@needs_mpi
def test_benchmark_quick_runs_and_the_backends_agree(tmp_path):
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "collectives.py"
    run_mpi(3, script, "--quick", "--json", tmp_path / "b.json", "--plot", tmp_path / "b.png", timeout=120)
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert {(r["collective"], r["backend"]) for r in rows} == {
        (c, b) for c in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all") for b in ("ring", "mpi")}
    for r in rows:
        assert r["wrong"] == 0 and r["time_us"] > 0
        assert r["algbw"] == pytest.approx(r["size"] / r["time_us"] / 1e3)  # GB/s
        factor = 2 * (3 - 1) / 3 if r["collective"] == "all_reduce" else (3 - 1) / 3  # nccl-tests' busbw
        assert r["busbw"] == pytest.approx(r["algbw"] * factor)
    assert (tmp_path / "b.png").stat().st_size > 0
