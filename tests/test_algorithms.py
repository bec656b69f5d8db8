"""The algorithm functions themselves (the contract ``native.py`` copies), called on a raw transport:
any counts, tiny segments, and bitwise-identical results even where an op is not bitwise commutative."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minidist import run_local
from minidist.comm import doubling, halving, ring

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.lists(st.integers(0, 40), min_size=1, max_size=8), st.sampled_from([1, 8, 24, 256]),
       st.sampled_from(["sum", "max"]), st.integers(0, 2**32 - 1))
def test_ring_reduce_scatter_and_all_gather_take_any_counts_and_segment_size(counts, segment_bytes, op, seed):
    check_reduce_scatter_then_all_gather(
        counts, op, seed, lambda t, buf, shard: ring.reduce_scatter(t, buf, counts, op, shard, segment_bytes=segment_bytes),
        lambda t, shard, full: ring.all_gather(t, shard, counts, full, segment_bytes=segment_bytes))


def check_reduce_scatter_then_all_gather(counts, op, seed, reduce_scatter, all_gather):
    """On len(counts) ranks: ``reduce_scatter(t, buf, shard)`` leaves rank r's chunk of the
    reduction (counts[r] elements) in ``shard``, then ``all_gather(t, shard, full)`` the whole
    reduction in ``full`` on every rank, both equal to NumPy's."""
    n, total = len(counts), sum(counts)
    rng = np.random.default_rng(seed)
    inputs = [rng.integers(-9, 10, total).astype(np.float64) for _ in range(n)]
    want = np.add.reduce(inputs) if op == "sum" else np.maximum.reduce(inputs)
    starts = np.cumsum([0] + counts)

    def fn(g):
        t = g.transport
        shard = np.empty(counts[t.rank])
        reduce_scatter(t, inputs[t.rank].copy(), shard)
        full = np.empty(total)
        all_gather(t, shard, full)
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
@given(st.integers(0, 3), st.lists(st.integers(0, 40), min_size=8, max_size=8), st.sampled_from(["sum", "max"]),
       st.integers(0, 2**32 - 1))
def test_halving_reduce_scatter_and_doubling_all_gather_take_any_counts(log_n, counts, op, seed):
    counts = counts[:1 << log_n]  # both need a power of two
    check_reduce_scatter_then_all_gather(
        counts, op, seed, lambda t, buf, shard: halving.reduce_scatter(t, buf, counts, op, shard),
        lambda t, shard, full: doubling.all_gather(t, shard, counts, full))


def test_halving_and_doubling_gather_refuse_other_than_a_power_of_two():
    def fn(g):
        with pytest.raises(ValueError, match="power-of-two"):
            halving.reduce_scatter(g.transport, np.zeros(6), [2, 2, 2], "sum", np.zeros(2))
        with pytest.raises(ValueError, match="power-of-two"):
            doubling.all_gather(g.transport, np.zeros(2), [2, 2, 2], np.zeros(6))

    run_local(fn, 3)


@SETTINGS
@given(st.integers(1, 8), st.integers(0, 300), st.sampled_from([0, 1 << 40]), st.integers(0, 2**32 - 1))
def test_rabenseifner_all_reduce_folds_in_any_number_of_ranks_merged_or_not(n, length, merge_below, seed):
    rng = np.random.default_rng(seed)
    inputs = [rng.integers(-9, 10, length).astype(np.float32) for _ in range(n)]

    def fn(g):
        buf = inputs[g.rank].copy()
        halving.all_reduce(g.transport, buf, "sum")
        return buf

    default, halving.MERGE_BELOW_BYTES = halving.MERGE_BELOW_BYTES, merge_below  # 0: never merge; 2**40: always
    try:
        results = run_local(fn, n)
    finally:
        halving.MERGE_BELOW_BYTES = default
    for got in results:
        np.testing.assert_array_equal(got, np.add.reduce(inputs))


@SETTINGS
@given(st.integers(1, 8), st.sampled_from(["max", "min"]), st.sampled_from(["ring", "doubling", "halving"]),
       st.integers(0, 2**32 - 1))
def test_signed_zeros_end_bitwise_identical_on_every_rank(n, op, algorithm, seed):
    # np.maximum(-0.0, 0.0) is 0.0 but np.maximum(0.0, -0.0) is -0.0: the order of operands shows in
    # the bits, so every rank must combine the same operands in the same order.
    rng = np.random.default_rng(seed)
    inputs = [rng.choice([-0.0, 0.0], 64) for _ in range(n)]

    def fn(g):
        buf = inputs[g.rank].copy()
        {"ring": ring, "doubling": doubling, "halving": halving}[algorithm].all_reduce(g.transport, buf, op)
        return buf.tobytes()

    assert len(set(run_local(fn, n))) == 1

