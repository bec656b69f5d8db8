"""The rules of all_to_all, checked against NumPy over the in-process transport.

Rank i cuts its ``x`` along axis 0 into n chunks, ``send_counts[i][j]`` rows for rank j (equal chunks
when ``send_counts`` is None), and every rank returns what it received, in rank order: rank j's output
is the concatenation of chunk j of every rank. A counts matrix ``C`` (``C[i][j]``: rows from i to j)
describes one call: rank i passes row ``C[i]`` as ``send_counts`` and column ``C[:, i]`` as
``recv_counts`` (or None, to learn it from the peers). Unlike a reduction, nothing is computed, so
any float (not only integers) must arrive bit for bit.
"""
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist import run_local
from minidist.comm import CollectiveMismatchError, CommTimeoutError, alltoall
from minidist.comm.ops import bus_factor
from tests.test_collectives import SETTINGS, dtypes, seeds, worlds
from tests.test_mismatch import outcomes
from tests.test_nccl_backend import run_nccl

trailing = st.lists(st.integers(0, 3), max_size=2).map(tuple)  # () or (w,) or (w, v), zeros included


def rank_inputs(counts, tail, dtype, seed):
    """Rank i's input: ``sum(counts[i])`` rows of shape ``tail``, a shuffle of distinct values offset
    by 1000 per rank, so a chunk in the wrong place or order does not pass for the right one."""
    rng = np.random.default_rng(seed)
    return [(rng.permutation(int(counts[i].sum()) * int(np.prod(tail, dtype=int))) + 1000 * i)
            .astype(dtype).reshape((int(counts[i].sum()),) + tail) for i in range(len(counts))]


def reference(inputs, counts):
    """What each rank must return: chunk j of every rank's input, for rank j, in rank order."""
    n = len(inputs)
    chunks = [np.split(x, np.cumsum(c)[:-1]) for x, c in zip(inputs, counts)]  # chunks[i][j]: i -> j
    return [np.concatenate([chunks[i][j] for i in range(n)]) for j in range(n)]


def assert_each_equal(results, want):
    for got, w in zip(results, want, strict=True):
        assert got.dtype == w.dtype and got.shape == w.shape, (got.shape, w.shape)
        assert got.tobytes() == w.tobytes()


@st.composite
def count_matrices(draw, n, equal=False):
    """An n x n matrix of rows per (sender, receiver): each rank's rows to every rank alike
    (``equal``: the same k everywhere), or any, zeros, rows < n and 0-row ranks included."""
    if equal:
        return np.full((n, n), draw(st.integers(0, 5)), dtype=int)
    big = draw(st.booleans())
    cells = st.integers(0, 300) if big else st.integers(0, 4)
    return np.array(draw(st.lists(st.lists(cells, min_size=n, max_size=n), min_size=n, max_size=n)), dtype=int)


@SETTINGS
@given(worlds, st.data(), trailing, dtypes, st.sampled_from(["equal", "given", "learned"]), st.booleans(),
       st.booleans(), seeds)
def test_all_to_all_sends_chunk_j_to_rank_j_in_rank_order(n, data, tail, dtype, counts_mode, give_out, async_op,
                                                         seed):
    counts = data.draw(count_matrices(n, equal=counts_mode == "equal"), label="counts")
    inputs = rank_inputs(counts, tail, dtype, seed)
    want = reference(inputs, counts)

    def fn(g):
        x = inputs[g.rank].copy()
        send = None if counts_mode == "equal" else counts[g.rank].tolist()
        recv = counts[:, g.rank].tolist() if counts_mode == "given" else None
        out = np.empty_like(want[g.rank]) if give_out else None
        got = g.all_to_all(x, send, recv, out=out, async_op=async_op)
        if async_op:
            got = got.wait()
        assert out is None or got is out
        np.testing.assert_array_equal(x, inputs[g.rank])  # x is not modified
        return got

    assert_each_equal(run_local(fn, n), want)


@SETTINGS
@given(worlds, st.data(), dtypes, seeds)
def test_both_algorithms_give_the_same_answer_and_may_be_mixed(n, data, dtype, seed):
    """Pairwise, scattered, or each rank its own: one message each way per pair, on one tag."""
    counts = data.draw(count_matrices(n), label="counts")
    choice = data.draw(st.lists(st.sampled_from(alltoall.ALGORITHMS), min_size=n, max_size=n), label="algorithms")
    inputs = rank_inputs(counts, (2,), dtype, seed)

    def fn(g):
        out = np.empty((counts[:, g.rank].sum(), 2), dtype)
        alltoall.all_to_all(g.transport, inputs[g.rank].reshape(-1), list(2 * counts[g.rank]), out.reshape(-1),
                            list(2 * counts[:, g.rank]), algorithm=choice[g.rank])
        return out

    assert_each_equal(run_local(fn, n), reference(inputs, counts))


def test_auto_picks_scattered_for_small_chunks_and_pairwise_for_large_and_traces_it():
    big = alltoall.SCATTERED_BELOW_BYTES // 8  # float64 elements in one chunk at the threshold

    def fn(g):
        g.all_to_all(np.zeros(4))
        g.all_to_all(np.zeros(2 * big))
        g.all_to_all(np.zeros(2 * big - 2))
        return [(e.op, e.algorithm, e.nbytes, e.seq) for e in g.trace.events]
    for events in run_local(fn, 2):
        assert events == [("all_to_all", "scattered", 32, 1), ("all_to_all", "pairwise", 16 * big, 2),
                          ("all_to_all", "scattered", 16 * big - 16, 3)]
    assert bus_factor("all_to_all", 4) == 3 / 4  # nccl-tests' alltoall: (n-1)/n of the input crosses

    def forced(g):  # the group's setting, inherited by its sub-groups
        g.split(0).all_to_all(np.zeros(4))
        return [e.algorithm for e in g.trace.events]
    assert run_local(forced, 2, scattered_below_bytes=0) == [["allgather", "pairwise"]] * 2


def test_equal_chunks_keep_the_input_shape_and_learned_counts_size_the_output():
    inputs = [np.arange(6 * 2 * 3, dtype=np.float32).reshape(6, 2, 3) + 100 * r for r in range(3)]

    def fn(g):
        x = inputs[g.rank]
        return g.all_to_all(x), g.all_to_all(x, send_counts=[g.rank, 6 - g.rank, 0])
    results = run_local(fn, 3)
    assert_each_equal([equal for equal, _ in results], reference(inputs, np.full((3, 3), 2)))
    ragged = reference(inputs, np.array([[r, 6 - r, 0] for r in range(3)]))
    assert [r.shape[0] for r in ragged] == [0 + 1 + 2, 6 + 5 + 4, 0]
    assert_each_equal([learned for _, learned in results], ragged)


# ---- bad arguments: a ValueError on the calling rank, before anything is sent ------------------------------

BAD = {  # what the rank passes -> what the error says
    "rows not divisible": (dict(x=np.ones(5)), "x has 5 rows, not a multiple of 2"),
    "counts too short": (dict(send_counts=[4]), "send_counts must be 2 non-negative ints"),
    "negative count": (dict(send_counts=[5, -1]), "send_counts must be 2 non-negative ints"),
    "float count": (dict(send_counts=[2.0, 2]), "send_counts must be 2 non-negative ints"),
    "bool count": (dict(send_counts=[True, 3]), "send_counts must be 2 non-negative ints"),
    "not a sequence": (dict(send_counts=4), "send_counts must be 2 non-negative ints"),
    "wrong sum": (dict(send_counts=[1, 2]), "send_counts [1, 2] sum to 3, but x has 4 rows"),
    "recv negative": (dict(recv_counts=[2, -2]), "recv_counts must be 2 non-negative ints"),
    "self disagrees": (dict(send_counts=[2, 2], recv_counts=[1, 1]), "sends itself 2 rows"),
    "out too small": (dict(out=np.empty(3)), "out must hold 4 x float64"),
    "out dtype": (dict(out=np.empty(4, np.float32)), "out must hold 4 x float64"),
    "out is x": ("x", "out overlaps x"),
    "no axis 0": (dict(x=np.array(1.0)), "needs an axis 0"),
    "learned, out not an array": (dict(send_counts=[1, 3], out=[0.0] * 4), "out must be a numpy or cupy array"),
}


@pytest.mark.parametrize("case", BAD, ids=BAD.keys())
def test_bad_arguments_raise_on_the_calling_rank_before_sending(case):
    change, text = BAD[case]

    def fn(g):
        x = np.zeros(4)
        kwargs = dict(x=x, out=x) if change == "x" else dict(dict(x=x), **change)
        with pytest.raises(ValueError, match=re.escape(text)):
            g.all_to_all(**kwargs)
        return g.seq, len(g.trace.events)
    assert run_local(fn, 2) == [(0, 0)] * 2  # nothing numbered, nothing traced: nothing was sent


def test_a_learned_size_that_out_cannot_hold_fails_once_the_counts_are_known():
    """With recv_counts=None the size is known only after the count exchange: out is checked then,
    before any chunk moves; the peer, waiting for that rank's chunk, learns it has gone."""
    def fn(g):
        out = np.empty(3)  # rank 0 will receive 1 + 3 = 4 rows
        if g.rank == 0:
            with pytest.raises(ValueError, match="out must hold 4 x float64"):
                g.all_to_all(np.zeros(4), send_counts=[1, 3], out=out)
        else:
            with pytest.raises(CommTimeoutError, match="all_to_all #1"):
                g.all_to_all(np.zeros(4), send_counts=[3, 1])
    run_local(fn, 2, timeout=5.0)


# ---- ranks that disagree ------------------------------------------------------------------------------------

CALLS = {  # (what every rank calls, what the odd rank calls instead, the text of the odd call)
    "all_gather": (lambda g: g.all_to_all(np.ones(8)), lambda g: g.all_gather(np.ones(8)), "all_gather"),
    "dtype of equal bytes": (lambda g: g.all_to_all(np.ones(8, np.float32)), lambda g: g.all_to_all(np.ones(4)),
                             "dtype float64"),
    "row size": (lambda g: g.all_to_all(np.ones((4, 2))), lambda g: g.all_to_all(np.ones((4, 3))), "count 3"),
}


@pytest.mark.parametrize("case", CALLS, ids=CALLS.keys())
def test_a_rank_calling_something_else_is_caught_before_data_moves(case):
    same, different, text = CALLS[case]
    n, odd = 4, 2
    results = outcomes(n, odd, lambda g, how: same(g), lambda g, how: different(g), "ring")
    assert "returned" not in results
    for r in (odd - 1, odd, odd + 1):
        assert isinstance(results[r], CollectiveMismatchError), (r, results[r])
        assert "#2 on group 'world': " in str(results[r]) and f"rank {odd} called " in str(results[r])
        assert text in str(results[r]), results[r]


def test_no_false_alarm_for_legal_differences_between_ranks():
    """Ranks may send and receive different numbers of rows, and give only recv_counts or both."""
    def fn(g):
        g.all_to_all(np.ones((2 * g.rank, 3)), send_counts=[g.rank] * 2)  # rank 0: 0 rows, rank 1: 2
        g.all_to_all(np.ones(4), send_counts=[2, 2] if g.rank else None, recv_counts=[2, 2])
        g.all_to_all(np.ones((2 + g.rank, 2)), send_counts=[1, 1 + g.rank], recv_counts=[1, 1 + g.rank])
        return g.seq
    assert run_local(fn, 2, timeout=5.0, debug=True) == [3, 3]
    assert run_local(fn, 2, timeout=5.0) == [3, 3]


HOW = {  # (what rank 1 calls, what rank 0 calls, how each shows in the message)
    "learned, equal": (lambda g: g.all_to_all(np.ones(4), send_counts=[2, 2]), lambda g: g.all_to_all(np.ones(4)),
                       "recv counts learned", "recv counts equal (x has 4 rows)"),
    "given, equal": (lambda g: g.all_to_all(np.ones(4), recv_counts=[2, 2]), lambda g: g.all_to_all(np.ones(4)),
                     "recv counts given", "recv counts equal (x has 4 rows)"),
    "learned, given": (lambda g: g.all_to_all(np.ones(4), send_counts=[2, 2]),
                       lambda g: g.all_to_all(np.ones(4), send_counts=[2, 2], recv_counts=[2, 2]),
                       "recv counts learned", "recv counts given"),
    "equal, other rows": (lambda g: g.all_to_all(np.ones(6)), lambda g: g.all_to_all(np.ones(4)),
                          "recv counts equal (x has 6 rows)", "recv counts equal (x has 4 rows)"),
}


@pytest.mark.parametrize("case", HOW, ids=HOW.keys())
def test_ranks_must_pass_their_counts_the_same_way(case):
    """Learning the counts is one more exchange (a rank that skipped it would leave its peers
    waiting), and equal chunks are equal only if every rank has as many rows."""
    odd, usual, odd_text, usual_text = HOW[case]

    def fn(g):
        with pytest.raises(CollectiveMismatchError, match="all_to_all #1 on group 'world'") as error:
            (odd if g.rank == 1 else usual)(g)
        return str(error.value)
    for message in run_local(fn, 2, timeout=5.0):
        assert f"rank 1 called all_to_all with {odd_text}" in message, message
        assert f"rank 0 called all_to_all with {usual_text}" in message, message


def wrong_expectation(g, **kwargs):
    """Every rank sends 2 rows to each; rank 1 expects 3 from rank 0."""
    recv = [3, 2, 2] if g.rank == 1 else [2, 2, 2]
    return g.all_to_all(np.ones(6), send_counts=[2, 2, 2], recv_counts=recv, **kwargs)


def test_a_peer_sending_other_than_expected_fails_loudly_on_the_ring():
    """No exchange on backend "ring": the transport refuses a message of the wrong size."""
    def fn(g):
        try:
            return wrong_expectation(g)
        except (ValueError, CommTimeoutError) as e:
            return e
    results = run_local(fn, 3, timeout=5.0)
    assert isinstance(results[1], ValueError) and "rank 0 sent 2 x float64 to rank 1" in str(results[1])
    assert isinstance(results[0], ValueError)  # in-process the sender hears it too
    np.testing.assert_array_equal(results[2], np.ones(6))  # rank 2's exchange was all right


def test_debug_mode_checks_the_counts_and_names_the_pair_on_both_ranks():
    def fn(g):
        try:
            return wrong_expectation(g)
        except (CollectiveMismatchError, CommTimeoutError) as e:
            return e
    results = run_local(fn, 3, timeout=5.0, debug=True)
    for r in (0, 1):
        assert isinstance(results[r], CollectiveMismatchError), results[r]
        assert str(results[r]) == "all_to_all #1 on group 'world': rank 0 sends 2 rows to rank 1, which expects 3"
    assert isinstance(results[2], CommTimeoutError)  # waited for rank 0's chunk, which never came


# ---- device arrays (fake CuPy) and backend "nccl" (fake NCCL) --------------------------------------------------

def on_device_run(cp, runner, n, counts, tail, dtype, seed, counts_mode, give_out, **kwargs):
    inputs = rank_inputs(counts, tail, dtype, seed)

    def fn(g):
        x = cp.asarray(inputs[g.rank])
        send = None if counts_mode == "equal" else counts[g.rank].tolist()
        recv = counts[:, g.rank].tolist() if counts_mode == "given" else None
        out = cp.empty((counts[:, g.rank].sum(),) + tail, dtype) if give_out else None
        got = g.all_to_all(x, send, recv, out=out)
        assert type(got) is cp.ndarray, f"the result left the device: {type(got)}"
        assert out is None or got is out
        return got.get(), [e.algorithm for e in g.trace.events]
    results = runner(fn, n, **kwargs)
    assert_each_equal([got for got, _ in results], reference(inputs, counts))
    return [events for _, events in results]


modes = st.sampled_from(["equal", "given", "learned"])


@SETTINGS
@given(st.integers(1, 5), st.data(), trailing, dtypes, modes, st.booleans(), seeds)
def test_device_arrays_stay_on_the_device_over_the_transport(cp, n, data, tail, dtype, counts_mode, give_out, seed):
    counts = data.draw(count_matrices(n, equal=counts_mode == "equal"))
    on_device_run(cp, run_local, n, counts, tail, dtype, seed, counts_mode, give_out)


@SETTINGS
@given(st.integers(1, 5), st.data(), trailing, dtypes, modes, st.booleans(), seeds)
def test_backend_nccl_moves_the_same_chunks_on_the_device(cp, n, data, tail, dtype, counts_mode, give_out, seed):
    counts = data.draw(count_matrices(n, equal=counts_mode == "equal"))
    for events in on_device_run(cp, run_nccl, n, counts, tail, dtype, seed, counts_mode, give_out):
        assert events == ["nccl"]


def test_backend_nccl_checks_the_counts_first_and_mixing_memories_is_refused(cp):
    """NCCL would not notice a short message: the counts are compared before it is handed them."""

    def fn(g):
        with pytest.raises(ValueError, match="out is in host \\(numpy\\) memory but the input is in GPU"):
            g.all_to_all(cp.ones(3), out=np.empty(3))
        recv = [2, 2, 2]
        recv[(g.rank - 1) % 3] = 3  # every rank expects a row too many from its left neighbour
        left, right = (g.rank - 1) % 3, (g.rank + 1) % 3
        with pytest.raises(CollectiveMismatchError, match="all_to_all #1 on group 'world': ") as error:
            g.all_to_all(cp.ones(6), send_counts=[2, 2, 2], recv_counts=recv, async_op=True).wait()
        assert f"rank {left} sends 2 rows to rank {g.rank}, which expects 3" in str(error.value)
        assert f"rank {g.rank} sends 2 rows to rank {right}, which expects 3" in str(error.value)
        return g.seq
    assert run_nccl(fn, 3, timeout=5.0) == [1, 1, 1]

    def trusted(g):  # check_calls=False: the counts go to NCCL unchecked
        return g.all_to_all(cp.arange(6.0) + 10 * g.rank, send_counts=[2, 2, 2], recv_counts=[2, 2, 2]).get()
    for r, got in enumerate(run_nccl(trusted, 3, check_calls=False)):
        want = np.concatenate([np.arange(2.0 * r, 2.0 * r + 2) + 10 * i for i in range(3)])  # chunk r of each
        np.testing.assert_array_equal(got, want)
