"""The collectives on GPU (CuPy) arrays, checked on the CPU with the fake-CuPy double.

The double's "device" arrays live in host memory but, like CuPy's, refuse to mix with NumPy arrays:
any scratch buffer, output or reduction the engine made on the host for a device input would raise
here. Results must equal NumPy's reference exactly (integer-valued inputs, as in test_collectives).
Over MPI (tests/mpi/device_staging.py) the double also counts host<->device copies, which shows
whether a message was staged through host memory or handed to MPI as it is.
"""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist import run_local
from tests.mpi.harness import run_mpi
from tests.test_collectives import SETTINGS, assert_all_equal, dtypes, expected, ops, rank_inputs, seeds


@pytest.fixture(scope="module")
def cupy():
    from tests.doubles import fake_cupy
    try:
        yield fake_cupy.install()
    finally:
        fake_cupy.uninstall()


def on_device(cp, inputs):
    return [cp.asarray(x) for x in inputs]


def check(cp, results, want):
    for got in results:
        assert type(got) is cp.ndarray, f"the result left the device: {type(got)}"
    assert_all_equal([got.get() for got in results], want)  # a float16 average: within its bound


@SETTINGS
@given(st.integers(1, 6), st.integers(0, 3000), dtypes, ops, st.sampled_from(["auto", "ring", "doubling"]), seeds)
def test_all_reduce_on_device_arrays(cupy, n, length, dtype, op, algorithm, seed):
    inputs = rank_inputs(n, (length,), dtype, op, seed)
    device = on_device(cupy, inputs)
    results = run_local(lambda g: g.all_reduce(device[g.rank], op, algorithm=algorithm), n, segment_bytes=1024)
    check(cupy, results, expected(inputs, op))


@SETTINGS
@given(st.integers(1, 6), st.integers(0, 500), dtypes, ops, seeds)
def test_reduce_scatter_and_all_gather_on_device_arrays(cupy, n, rows, dtype, op, seed):
    inputs = rank_inputs(n, (rows, 2), dtype, op, seed)
    device = on_device(cupy, inputs)

    def body(g):
        part = g.reduce_scatter(device[g.rank], op)
        return part, g.all_gather(part, count=rows)
    results = run_local(body, n, segment_bytes=256)
    want = expected(inputs, op)
    check(cupy, [whole for _, whole in results], want)
    for r, (part, _) in enumerate(results):
        check(cupy, [part], np.array_split(want, n)[r])


@SETTINGS
@given(st.integers(1, 6), st.data(), st.integers(0, 100), dtypes, ops, seeds)
def test_broadcast_and_reduce_on_device_arrays(cupy, n, data, length, dtype, op, seed):
    root = data.draw(st.integers(0, n - 1))
    inputs = rank_inputs(n, (length,), dtype, op, seed)
    device = on_device(cupy, inputs)
    reduced = run_local(lambda g: g.reduce(device[g.rank].copy(), root, op), n)
    check(cupy, [reduced[root]], expected(inputs, op))
    broadcast = run_local(lambda g: g.broadcast(device[g.rank].copy(), root), n)
    check(cupy, broadcast, inputs[root])


def test_mixing_host_and_device_buffers_is_refused_before_sending(cupy):
    def body(g):
        with pytest.raises(ValueError, match="GPU \\(cupy\\) memory but the input is in host"):
            g.all_gather(np.ones(2), out=cupy.zeros(2 * g.size))
        with pytest.raises(ValueError, match="must be a numpy or cupy array"):
            g.all_reduce([1.0, 2.0])
        return g.seq
    assert run_local(body, 2) == [0, 0]  # nothing was numbered, so nothing was sent


@pytest.mark.parametrize("cuda_aware", ["no", "yes"])
def test_mpi_stages_device_buffers_unless_cuda_aware(cuda_aware):
    """Under mpiexec: every collective on device arrays equals the host result; with a non-CUDA-aware
    MPI every message was copied through host memory, with a CUDA-aware one none was."""
    run = run_mpi(3, "device_staging.py", cuda_aware, timeout=90)
    assert "OK" in run.stdout, run.stdout + run.stderr
