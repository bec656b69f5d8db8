"""On a real GPU: the collectives on CuPy buffers, MPI staging, the NCCL backend, training with
``--device cuda``. Every check compares against the host (NumPy) result.

These tests skip, saying why, where CuPy or a GPU is missing (CI has neither); the fake-CuPy tests
(test_device_*.py, test_nccl_backend.py) cover the same code paths on the CPU. On a GPU machine:

    python -m pytest tests/test_gpu.py -v -rs

The session header names the GPU (tests/conftest.py). NCCL needs one GPU per rank: with a single GPU
its multi-rank checks are replaced by the check that two ranks on one GPU are refused clearly.
"""
import json

import numpy as np
import pytest

from minidist import run_local
from minidist.device import gpu_count
from tests.mpi.harness import REPO, find_mpiexec, run_mpi
from tests.test_collectives import assert_all_equal, expected, rank_inputs

cupy = pytest.importorskip("cupy", reason="CuPy is not installed: the GPU tests skip")
if gpu_count() == 0:
    pytest.skip("CuPy sees no GPU: the GPU tests skip", allow_module_level=True)
needs_mpi = pytest.mark.skipif(find_mpiexec() is None, reason="mpiexec not found")
TRAIN = ("-m", "minidist.train")
TINY = ["--n-layer", "2", "--n-head", "4", "--n-embd", "32", "--block-size", "32", "--batch-size", "8",
        "--steps", "5", "--eval-every", "100", "--eval-iters", "1", "--sample-tokens", "0", "--dtype", "float64",
        "--optimizer", "sgd"]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
def test_collectives_on_gpu_buffers_equal_numpy(n, dtype):
    """Ranks as threads sharing the GPU: every collective on CuPy arrays equals NumPy's reference."""
    for op in ("sum", "prod", "max", "min", "avg"):
        for length in (0, 1, n + 1, 100_003):
            inputs = rank_inputs(n, (length,), dtype, op, seed=length)
            device = [cupy.asarray(x) for x in inputs]
            want = expected(inputs, op)

            def body(g):
                total = g.all_reduce(device[g.rank].copy(), op)
                part = g.reduce_scatter(device[g.rank], op)
                return total, g.all_gather(part, count=length), g.broadcast(device[g.rank].copy(), n - 1)
            for total, gathered, broadcast in run_local(body, n, segment_bytes=64 * 1024):
                assert isinstance(total, cupy.ndarray)
                assert_all_equal([total.get()], want)  # a float16 average: within its bound
                assert_all_equal([gathered.get()], want)
                np.testing.assert_array_equal(broadcast.get(), inputs[n - 1])


@needs_mpi
@pytest.mark.parametrize("cuda_aware", ["detect", "no"])
def test_ring_over_mpi_on_gpu_buffers(cuda_aware):
    """Two processes sharing the GPU, backend "ring" over MPI: staged through pinned host memory
    (the pip MPICH) or handed to a CUDA-aware MPI; the results equal the host run's."""
    run = run_mpi(2, "device_staging.py", cuda_aware, "real", timeout=300)
    assert "OK" in run.stdout, run.output


@needs_mpi
def test_nccl_backend_equals_the_ring():
    """As many ranks as GPUs (at most 4): every collective and point-to-point call of backend "nccl"
    gives the ring's results exactly."""
    n = min(gpu_count(), 4)
    run = run_mpi(n, "nccl_checks.py", timeout=300)
    assert "OK" in run.stdout, run.output


@needs_mpi
@pytest.mark.skipif(gpu_count() != 1, reason="needs a machine with exactly one GPU")
def test_nccl_refuses_two_ranks_on_one_gpu():
    run = run_mpi(2, "nccl_checks.py", timeout=300, check=False)
    assert run.returncode != 0
    assert "2 ranks on this node but only 1 GPU" in run.output, run.output


@needs_mpi
def test_the_gpu_lesson_runs_on_two_ranks():
    run = run_mpi(2, REPO / "tutorials" / "08_gpu.py", timeout=300)
    assert "Every GPU result equals the host ring's" in run.stdout, run.output


def losses(out_dir):
    return [json.loads(line)["loss"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@needs_mpi
@pytest.mark.parametrize("layout", [[], ["--dp", "2"], ["--dp", "2", "--zero", "1"], ["--tp", "2"],
                                    ["--pp", "2", "--micro-batches", "2"]])
def test_training_on_the_gpu_follows_the_cpu(tmp_path, layout):
    """``--device cuda`` trains (float64, SGD) to the CPU's losses; parallel layouts over backend
    "ring" share the one GPU between their processes."""
    n = int(np.prod([int(v) for f, v in zip(layout[::2], layout[1::2]) if f in ("--dp", "--tp", "--pp")] or [1]))
    common = TINY + ["--data-dir", str(tmp_path / "data")] + layout
    run_mpi(n, *TRAIN, *common, "--out", tmp_path / "cpu", timeout=300)
    run_mpi(n, *TRAIN, *common, "--device", "cuda", "--out", tmp_path / "gpu", timeout=300)
    np.testing.assert_allclose(losses(tmp_path / "gpu"), losses(tmp_path / "cpu"), rtol=1e-10)


@needs_mpi
@pytest.mark.skipif(gpu_count() < 2, reason="NCCL needs one GPU per rank: 2 GPUs")
@pytest.mark.parametrize("layout", [["--dp", "2"], ["--dp", "2", "--zero", "3"], ["--tp", "2"],
                                    ["--pp", "2", "--micro-batches", "4"]])
def test_training_over_nccl_follows_the_cpu(tmp_path, layout):
    """``--backend nccl``, one GPU per rank: the CPU run's losses (float64, SGD)."""
    common = TINY + ["--data-dir", str(tmp_path / "data")] + layout
    run_mpi(2, *TRAIN, *common, "--out", tmp_path / "cpu", timeout=300)
    run_mpi(2, *TRAIN, *common, "--device", "cuda", "--backend", "nccl", "--out", tmp_path / "gpu", timeout=300)
    np.testing.assert_allclose(losses(tmp_path / "gpu"), losses(tmp_path / "cpu"), rtol=1e-10)
