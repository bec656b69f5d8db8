"""``--explain`` and ``--trace`` of the trainer under real MPI.

- --explain prints, once and from rank 0, one block per rank in rank order: its groups, what it
  holds, and its first step's calls, each with the label its call site gave (a tensor-parallel rank
  names its shards; a pipeline stage sends each micro-batch's activations to the next stage's rank
  after its forward, and receives their gradients from it).
- --trace DIR leaves a run directory that ``python -m minidist.inspect DIR`` reads: per-rank trace
  events and memory rows, with the metrics of --out DIR.
"""
import re
import subprocess
import sys

import pytest

from tests.mpi.harness import REPO, find_mpiexec, run_mpi

pytestmark = pytest.mark.skipif(find_mpiexec() is None, reason="needs mpiexec")
TINY = ["--n-layer", 2, "--n-head", 4, "--n-embd", 16, "--block-size", 16, "--batch-size", 8,
        "--eval-iters", 1, "--sample-tokens", 0]


def blocks(stdout):
    """The ranks of the --explain blocks, in printed order."""
    return [int(r) for r in re.findall(r"^=== rank (\d+): ", stdout, flags=re.M)]


def test_explain_prints_one_block_per_rank_in_rank_order(tmp_path):
    run = run_mpi(4, "-m", "minidist.train", *TINY, "--steps", 1, "--dp", 2, "--tp", 2, "--explain",
                  "--data-dir", tmp_path, timeout=120)
    assert blocks(run.stdout) == [0, 1, 2, 3], run.output
    rank0 = run.stdout[run.stdout.index("=== rank 0:"):run.stdout.index("=== rank 1:")]
    rank3 = run.stdout[run.stdout.index("=== rank 3:"):]
    assert "=== rank 3: DP(1)-PP(0)-TP(1)-Rank(3) ===" in rank3
    assert "tp[dp1,pp0] = ranks [2, 3]" in rank3 and "dp[pp0,tp1] = ranks [1, 3]" in rank3
    assert "the same step as rank 0, with its own groups and partners (above)" in rank3  # only what differs
    assert re.search(r"holds transformer\.h\.\{0,1\}\.mlp\.c_fc\.weight +\(32, 16\) +column shard of \(64, 16\)", rank0)
    # forward: the vocab-parallel embedding's g, Megatron's g after attention and MLP in each of 2 blocks
    g = re.findall(r"^  (?:(\d) x )?all_reduce 4.0 KiB on tp\[dp0,pp0\] with rank 1 \(doubling\) — activation: .*"
                   r"partial sums added over tp \(g\) \[during (.*)\]$", rank0, flags=re.M)
    assert [place for _, places in g for place in places.split(", ")] == ["embedding", "h.0", "h.0", "h.1", "h.1"]
    for k in (1, 2, 3):  # the vocab-parallel cross-entropy's three all-reduces
        assert f"— activation: cross-entropy {k}/3, " in rank0


def test_a_pipeline_explains_its_activation_sends_and_inspect_reads_its_trace(tmp_path):
    run = run_mpi(4, "-m", "minidist.train", *TINY, "--steps", 2, "--dp", 2, "--pp", 2, "--micro-batches", 2,
                  "--explain", "--trace", tmp_path, "--out", tmp_path, "--data-dir", tmp_path / "data", timeout=120)
    assert blocks(run.stdout) == [0, 1, 2, 3], run.output
    rank0 = run.stdout[run.stdout.index("=== rank 0:"):run.stdout.index("=== rank 1:")]
    # 2 micro-batches' activations up after their forwards, their gradients down before their backwards
    assert len(re.findall(r"^forward micro-batch \d of stage 0 .*, then:\n  isend 2.0 KiB to rank 1 "
                          r"\(pp\[dp0,tp0\] rank 1\) — ", rank0, flags=re.M)) == 2
    assert len(re.findall(r"^  irecv 2.0 KiB from rank 1 \(pp\[dp0,tp0\] rank 1\) — .*\nbackward micro-batch", rank0,
                          flags=re.M)) == 2
    done = subprocess.run([sys.executable, "-m", "minidist.inspect", str(tmp_path)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "4 ranks" in done.stdout and "steps 0..1" in done.stdout
    for group in ("pp[dp0,tp0]", "pp[dp1,tp0]", "dp[pp0,tp0]", "dp[pp1,tp0]"):
        assert group in done.stdout
    assert "after last step" in done.stdout  # every rank's memory row
