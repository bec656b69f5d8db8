"""The algorithm functions themselves (the contract ``native.py`` copies), called on a raw transport:
any counts, tiny segments, and bitwise-identical results even where an op is not bitwise commutative."""
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minidist import run_local
from minidist.comm import doubling, ring

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.lists(st.integers(0, 40), min_size=1, max_size=8), st.sampled_from([1, 8, 24, 256]),
       st.sampled_from(["sum", "max"]), st.integers(0, 2**32 - 1))
def test_ring_reduce_scatter_and_all_gather_take_any_counts_and_segment_size(counts, segment_bytes, op, seed):
    n, total = len(counts), sum(counts)
    rng = np.random.default_rng(seed)
    inputs = [rng.integers(-9, 10, total).astype(np.float64) for _ in range(n)]
    want = np.add.reduce(inputs) if op == "sum" else np.maximum.reduce(inputs)
    starts = np.cumsum([0] + counts)

    def fn(g):
        t = g.transport
        shard = np.empty(counts[t.rank])
        ring.reduce_scatter(t, inputs[t.rank].copy(), counts, op, shard, segment_bytes=segment_bytes)
        full = np.empty(total)
        ring.all_gather(t, shard, counts, full, segment_bytes=segment_bytes)
        return shard, full

    for r, (shard, full) in enumerate(run_local(fn, n)):
        np.testing.assert_array_equal(shard, want[starts[r]:starts[r + 1]])
        np.testing.assert_array_equal(full, want)


@SETTINGS
@given(st.integers(1, 8), st.integers(0, 300), st.sampled_from([1, 8, 40]), st.integers(0, 2**32 - 1))
def test_ring_all_reduce_with_many_double_buffered_segments(n, length, segment_bytes, seed):
    rng = np.random.default_rng(seed)
    inputs = [rng.integers(-9, 10, length).astype(np.float32) for _ in range(n)]

    def fn(g):
        buf = inputs[g.rank].copy()
        ring.all_reduce(g.transport, buf, "sum", segment_bytes=segment_bytes)
        return buf

    for got in run_local(fn, n):
        np.testing.assert_array_equal(got, np.add.reduce(inputs))


@SETTINGS
@given(st.integers(1, 8), st.sampled_from(["max", "min"]), st.sampled_from(["ring", "doubling"]),
       st.integers(0, 2**32 - 1))
def test_signed_zeros_end_bitwise_identical_on_every_rank(n, op, algorithm, seed):
    # np.maximum(-0.0, 0.0) is 0.0 but np.maximum(0.0, -0.0) is -0.0: the order of operands shows in
    # the bits, so every rank must combine the same operands in the same order.
    rng = np.random.default_rng(seed)
    inputs = [rng.choice([-0.0, 0.0], 64) for _ in range(n)]

    def fn(g):
        buf = inputs[g.rank].copy()
        (ring if algorithm == "ring" else doubling).all_reduce(g.transport, buf, op)
        return buf.tobytes()

    assert len(set(run_local(fn, n))) == 1

