"""The trainer's --trace directory, written by 4 MPI processes, read by python -m minidist.inspect."""
import json
import subprocess
import sys

import pytest

from tests.mpi.harness import REPO, find_mpiexec, run_mpi

pytestmark = pytest.mark.skipif(find_mpiexec() is None, reason="needs mpiexec")


def test_inspect_reads_what_the_trainer_wrote_under_mpi(tmp_path):
    run_mpi(4, "-m", "minidist.train", "--dp", 2, "--tp", 2, "--steps", 3, "--eval-iters", 1,
            "--sample-tokens", 0, "--trace", tmp_path, "--out", tmp_path, timeout=120)
    done = subprocess.run([sys.executable, "-m", "minidist.inspect", str(tmp_path)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "steps 0..2" in done.stdout
    for group in ("tp[dp0,pp0]", "tp[dp1,pp0]", "dp[pp0,tp0]", "dp[pp0,tp1]"):
        assert f"all_reduce     {group}" in done.stdout
    chrome = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in chrome if e["ph"] == "X"} == {0, 1, 2, 3}
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
