"""The rules of each collective, checked against NumPy over the in-process transport.

Inputs are integer-valued (as in nccl-tests), so sums and products are exact in every dtype and
order: any difference from NumPy is a bug, not rounding.
"""
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minidist import run_local
from minidist.comm.ops import GROUP_OPS

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
worlds = st.integers(1, 8)
lengths = st.one_of(st.integers(0, 24), st.integers(0, 100_000))  # tiny (often < n) and large
dtypes = st.sampled_from(["float16", "float32", "float64", "int32", "int64"])
ops = st.sampled_from(GROUP_OPS)
seeds = st.integers(0, 2**32 - 1)


def rank_inputs(n, shape, dtype, op, seed):
    """One integer-valued array per rank, small enough that no result leaves float16's exact range."""
    rng = np.random.default_rng(seed)
    values = [-2, -1, 0, 1, 2] if op == "prod" else range(-8, 9)
    return [rng.choice(values, size=shape).astype(dtype) for _ in range(n)]


class Approx(np.ndarray):
    """An expected answer known only to within ``atol``: a float16 average divides every input by n
    before the sum (comm/ops.py ``averages_first``), so it rounds n + (n - 1) times, in the
    algorithm's order. Each rounding is at most half a float16 unit (2**-11 relative) of a partial
    sum no larger than max |x| <= 8 here."""

    def __array_finalize__(self, obj):
        self.atol = getattr(obj, "atol", 0.0)


def expected(inputs, op):
    """The answer, computed by NumPy on the stacked inputs (a float16 average: an :class:`Approx`)."""
    stacked = np.stack(inputs)  # (n, ...)
    if op == "avg" and stacked.dtype == np.float16:
        n = len(inputs)
        want = np.asarray(stacked.astype(np.float64).sum(axis=0) / n).astype(np.float16).view(Approx)
        want.atol = (2 * n) * 2.0 ** -11 * 8
        return want
    ufunc = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum, "avg": np.add}[op]
    total = ufunc.reduce(stacked, dtype=stacked.dtype)  # in the inputs' dtype: int32 stays int32
    if op != "avg":
        return total
    n = len(inputs)
    if total.dtype.kind == "f":
        return total / np.array(n, total.dtype)
    return (np.abs(total) // n * np.sign(total)).astype(total.dtype)  # integers truncate toward zero


def assert_all_equal(results, want):
    for got in results:
        assert got.dtype == want.dtype and got.shape == want.shape
        if isinstance(want, Approx):
            np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=0, atol=want.atol)
        else:
            np.testing.assert_array_equal(got, want)
    assert len({got.tobytes() for got in results}) == 1, "ranks differ bitwise"


@SETTINGS
@given(worlds, lengths, dtypes, ops, st.sampled_from(["auto", "ring", "doubling", "halving"]), seeds)
def test_all_reduce_gives_every_rank_the_same_reduction(n, length, dtype, op, algorithm, seed):
    inputs = rank_inputs(n, (length,), dtype, op, seed)
    results = run_local(lambda g: g.all_reduce(inputs[g.rank].copy(), op, algorithm=algorithm), n)
    assert_all_equal(results, expected(inputs, op))


@SETTINGS
@given(worlds, st.lists(st.integers(0, 6), min_size=0, max_size=3), dtypes, ops, seeds)
def test_all_reduce_works_in_place_on_any_shape(n, shape, dtype, op, seed):
    inputs = rank_inputs(n, tuple(shape), dtype, op, seed)

    def fn(g):
        x = inputs[g.rank].copy()
        assert g.all_reduce(x, op) is x
        return x

    assert_all_equal(run_local(fn, n), expected(inputs, op))


ring_from = st.sampled_from([0, 1 << 62])  # the ring always, or halving/doubling wherever n is a power of two


@SETTINGS
@given(worlds, st.integers(0, 3000), st.integers(1, 3), dtypes, ops, st.booleans(), ring_from, seeds)
def test_reduce_scatter_leaves_each_rank_its_array_split_part(n, rows, width, dtype, op, give_out, ring_from_bytes,
                                                              seed):
    inputs = rank_inputs(n, (rows, width), dtype, op, seed)
    want = np.array_split(expected(inputs, op), n)  # rank r gets part r along axis 0

    def fn(g):
        x = inputs[g.rank].copy()
        out = np.empty_like(want[g.rank]) if give_out else None
        shard = g.reduce_scatter(x, op, out=out)
        assert out is None or shard is out
        np.testing.assert_array_equal(x, inputs[g.rank])  # the input is untouched
        return shard

    for r, shard in enumerate(run_local(fn, n, ring_from_bytes=ring_from_bytes)):
        assert_all_equal([shard], want[r])


@SETTINGS
@given(worlds, st.integers(0, 3000), st.integers(1, 3), dtypes, st.sampled_from(["count", "equal", "in place"]),
       ring_from, seeds)
def test_all_gather_concatenates_shards_in_rank_order(n, rows, width, dtype, mode, ring_from_bytes, seed):
    full = rank_inputs(1, (rows if mode != "equal" else rows // n * n, width), dtype, "sum", seed)[0]
    shards = np.array_split(full, n)

    def fn(g):
        if mode == "in place":  # the shard is this rank's slot of the output
            out = np.zeros_like(full)
            mine = np.array_split(out, n)[g.rank]
            mine[...] = shards[g.rank]
            assert g.all_gather(mine, count=rows, out=out) is out
            return out
        return g.all_gather(shards[g.rank].copy(), count=rows if mode == "count" else None)

    assert_all_equal(run_local(fn, n, ring_from_bytes=ring_from_bytes), full)


@SETTINGS
@given(worlds, lengths, dtypes, ops, ring_from, seeds)
def test_reduce_scatter_then_all_gather_is_all_reduce(n, length, dtype, op, ring_from_bytes, seed):
    inputs = rank_inputs(n, (length,), dtype, op, seed)

    def fn(g):
        return g.all_gather(g.reduce_scatter(inputs[g.rank], op), count=length)

    gathered = run_local(fn, n, ring_from_bytes=ring_from_bytes)
    assert_all_equal(gathered, expected(inputs, op))  # NumPy's answer ...
    if ring_from_bytes == 0:  # both rings: ...
        reduced = run_local(lambda g: g.all_reduce(inputs[g.rank].copy(), op, algorithm="ring"), n)[0]
        assert_all_equal(gathered, reduced)  # ... and the ring all_reduce's, bitwise: its two halves


@SETTINGS
@given(worlds, st.data(), lengths, dtypes, seeds)
def test_broadcast_copies_the_roots_buffer_everywhere(n, data, length, dtype, seed):
    root = data.draw(st.integers(0, n - 1), label="root")
    inputs = rank_inputs(n, (length,), dtype, "sum", seed)
    assert_all_equal(run_local(lambda g: g.broadcast(inputs[g.rank].copy(), src=root), n), inputs[root])


@SETTINGS
@given(worlds, st.data(), lengths, dtypes, ops, seeds)
def test_reduce_lands_on_the_root_and_leaves_others_alone(n, data, length, dtype, op, seed):
    root = data.draw(st.integers(0, n - 1), label="root")
    inputs = rank_inputs(n, (length,), dtype, op, seed)
    results = run_local(lambda g: g.reduce(inputs[g.rank].copy(), dst=root, op=op), n)
    assert_all_equal([results[root]], expected(inputs, op))
    for r in range(n):
        if r != root:
            np.testing.assert_array_equal(results[r], inputs[r])


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_barrier_lets_nobody_leave_before_everybody_arrived(n):
    arrived, left = [0.0] * n, [0.0] * n

    def fn(g):
        time.sleep(0.01 * g.rank)  # ranks arrive one after another
        arrived[g.rank] = time.monotonic()
        g.barrier()
        left[g.rank] = time.monotonic()

    run_local(fn, n)
    assert min(left) >= max(arrived)


@SETTINGS
@given(st.integers(2, 8), st.data(), st.integers(0, 50), seeds)
def test_split_groups_reduce_among_their_members_only(n, data, length, seed):
    colors = data.draw(st.lists(st.integers(-1, 2), min_size=n, max_size=n), label="colors")
    inputs = rank_inputs(n, (length,), "int64", "sum", seed)

    def fn(g):
        sub = g.split(colors[g.rank], key=-g.rank)  # key reverses the order within each group
        if sub is None:
            return None
        return sub.rank, sub.size, sub.all_reduce(inputs[g.rank].copy())

    for r, result in enumerate(run_local(fn, n)):
        if colors[r] < 0:
            assert result is None
            continue
        members = [m for m in range(n) if colors[m] == colors[r]]
        sub_rank, sub_size, total = result
        assert (sub_rank, sub_size) == (sorted(members, reverse=True).index(r), len(members))
        np.testing.assert_array_equal(total, expected([inputs[m] for m in members], "sum"))


def test_sub_groups_of_sub_groups_and_their_trace():
    def fn(g):
        rows = g.split(g.rank // 2, name="row")  # {0,1} {2,3}
        pairs = rows.split(0, name="pair")  # the same members, a fresh communicator
        x = np.array([g.rank], dtype=np.int64)
        pairs.all_reduce(x)
        return x[0], [(e.op, e.group, e.seq) for e in g.trace.events]

    results = run_local(fn, 4)
    assert [total for total, _ in results] == [1, 1, 5, 5]
    assert results[0][1] == [("split", "world", 1), ("split", "row", 1), ("all_reduce", "pair", 1)]
