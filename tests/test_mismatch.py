"""Ranks that disagree about a collective are caught by default, before any data is mixed.

Before each collective every rank swaps a fingerprint (collective, reduce op, dtype, count, root,
number) with its ring neighbours (minidist/comm/fingerprint.py). Where one rank differs, it and its
neighbours raise CollectiveMismatchError naming the call, its number, the group, the ranks and the
fields, and the odd rank's buffer is untouched. The ranks further away stop at their next wait on
one of those (CommTimeoutError, at once in-process), or, when the call needs nothing from them (a
leaf of a reduce tree), at a later call; under MPI the first error aborts the job with status 4.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidist import run_local
from minidist.comm import CollectiveMismatchError, CommTimeoutError
from minidist.comm.census import summary

ALGORITHMS = ["ring", "doubling", "async"]


def all_reduce(g, x, op="sum", how="ring"):
    if how == "async":
        return g.all_reduce(x, op=op, async_op=True).wait()
    return g.all_reduce(x, op=op, algorithm=how)


CALLS = {  # (what every rank calls, what the odd rank calls instead, the text of the odd call)
    "reduce op": (lambda g, how: all_reduce(g, np.ones(8), "sum", how),
                  lambda g, how: all_reduce(g, np.ones(8), "max", how), "reduce op max"),
    "dtype of equal bytes": (lambda g, how: all_reduce(g, np.ones(8, np.float32), how=how),
                             lambda g, how: all_reduce(g, np.ones(4, np.float64), how=how),
                             "dtype float64, count 4"),
    "count": (lambda g, how: all_reduce(g, np.ones(8), how=how),
              lambda g, how: all_reduce(g, np.ones(9), how=how), "count 9"),
    "collective": (lambda g, how: all_reduce(g, np.ones(8), how=how),
                   lambda g, how: g.reduce_scatter(np.ones(8)), "reduce_scatter"),
    "broadcast root": (lambda g, how: g.broadcast(np.ones(8), src=0),
                       lambda g, how: g.broadcast(np.ones(8), src=g.size - 1), "root"),
    "reduce root": (lambda g, how: g.reduce(np.ones(8), dst=0),
                    lambda g, how: g.reduce(np.ones(8), dst=1), "root 1"),
    "barrier vs gather_bytes": (lambda g, how: g.barrier(), lambda g, how: g.gather_bytes(b"x"), "gather_bytes"),
    "all_gather shard length": (lambda g, how: g.all_gather(np.ones(2), async_op=how == "async").wait()
                                if how == "async" else g.all_gather(np.ones(2)),
                                lambda g, how: g.all_gather(np.ones(3)), "count"),
}


def outcomes(n, odd, same, different, how, **kwargs):
    """Run one collective on ``n`` ranks where rank ``odd`` calls ``different``; each rank's error
    (or its result, if it wrongly returned) and whether the odd rank's input was left alone."""
    def fn(g):
        g.barrier()  # collective #1 agrees: the mismatch is #2
        x = np.ones(8)
        try:
            (different if g.rank == odd else same)(g, how)
            return "returned"
        except (CollectiveMismatchError, CommTimeoutError) as e:
            return e
        finally:
            assert (x == 1).all()
    return run_local(fn, n, timeout=5.0, **kwargs)


@pytest.mark.parametrize("how", ALGORITHMS)
@pytest.mark.parametrize("case", CALLS, ids=CALLS.keys())
def test_a_rank_that_calls_something_else_is_named_by_itself_and_its_neighbours(case, how):
    same, different, text = CALLS[case]
    n, odd = 4, 2
    results = outcomes(n, odd, same, different, how)
    assert "returned" not in results  # never a silent, wrong result
    for r in (odd - 1, odd, odd + 1):
        error = results[r]
        assert isinstance(error, CollectiveMismatchError), (r, error)
        assert "#2 on group 'world': " in str(error) and f"rank {odd} called " in str(error), error
        assert text in str(error), error
    assert isinstance(results[0], (CollectiveMismatchError, CommTimeoutError))


def test_the_message_names_the_call_its_number_the_ranks_and_the_fields():
    results = outcomes(3, 1, *CALLS["dtype of equal bytes"][:2], "ring")
    assert str(results[0]) == ("all_reduce #2 on group 'world': rank 1 called all_reduce with dtype float64, "
                               "count 4 while rank 0 called all_reduce with dtype float32, count 8")
    assert str(results[1]) == ("all_reduce #2 on group 'world': rank 0 called all_reduce with dtype float32, "
                               "count 8 while rank 1 called all_reduce with dtype float64, count 4; rank 2 called "
                               "all_reduce with dtype float32, count 8 while rank 1 called all_reduce with dtype "
                               "float64, count 4")


def test_each_rank_broadcasting_from_its_own_root_is_caught_on_every_rank():
    def fn(g):
        x = np.full(4, float(g.rank))
        with pytest.raises(CollectiveMismatchError, match=r"broadcast #1 on group 'world': rank \d called "
                                                          r"broadcast with root \d while rank \d called"):
            g.broadcast(x, src=g.rank)
        return x
    for r, x in enumerate(run_local(fn, 3, timeout=5.0)):
        np.testing.assert_array_equal(x, np.full(4, float(r)))  # nothing was received


def test_a_mismatch_in_a_split_group_names_that_group():
    def fn(g):
        sub = g.split(g.rank % 2, name="pair")
        with pytest.raises(CollectiveMismatchError, match=r"all_reduce #1 on group 'pair': rank \d called "
                                                          r"all_reduce with reduce op (min|sum) while rank \d"):
            sub.all_reduce(np.ones(3), op="min" if sub.rank == 1 else "sum")
    run_local(fn, 4, timeout=5.0)


@settings(max_examples=10, deadline=None)  # every case on 4 ranks is the test above; --slow: 100
@given(n=st.integers(2, 6), data=st.data())
def test_any_odd_rank_in_any_field_is_caught(n, data):
    odd_rank_is_caught(n, data)


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(n=st.integers(2, 6), data=st.data())
def test_any_odd_rank_in_any_field_is_caught_many_times(n, data):
    odd_rank_is_caught(n, data)


def odd_rank_is_caught(n, data):
    """One world of ``n`` thread ranks where a drawn rank calls a drawn other collective (a drawn
    algorithm): that rank and both its ring neighbours raise CollectiveMismatchError naming it."""
    odd = data.draw(st.integers(0, n - 1))
    case = data.draw(st.sampled_from(sorted(CALLS)))
    how = data.draw(st.sampled_from(ALGORITHMS))
    same, different, text = CALLS[case]
    if case == "reduce root" and odd == 1 or case == "broadcast root" and odd == 0:
        odd = (odd + 1) % n or 2 % n  # the odd rank must call something else
    if n == 2 and case == "reduce root" and odd in (0, 1):
        odd = 0  # rank 0 with dst 1 against rank 1 with dst 0
    results = outcomes(n, odd, same, different, how)
    for r in {(odd - 1) % n, odd, (odd + 1) % n}:
        assert isinstance(results[r], CollectiveMismatchError) and f"rank {odd} called" in str(results[r])


@pytest.mark.parametrize("how", ["ring", "doubling", "async"])
def test_no_false_alarm_when_every_rank_agrees(how):
    def fn(g):
        for op in ("sum", "max", "avg"):
            all_reduce(g, np.arange(6.0), op, how)
        g.broadcast(np.zeros(3), src=g.size - 1)
        g.reduce(np.ones(3), dst=1)
        g.gather_bytes(b"r" * g.rank)  # lengths may differ: only the root must agree
        g.all_gather(np.ones(2 if g.rank < 2 else 1), count=6)  # numpy.array_split of 6 over 4
        return g.seq
    assert run_local(fn, 4, timeout=5.0) == [7] * 4


def test_the_check_can_be_turned_off_and_debug_mode_tells_every_rank():
    results = outcomes(4, 2, *CALLS["reduce op"][:2], "ring", debug=True)
    assert all(isinstance(e, CollectiveMismatchError) for e in results)  # even rank 0, no neighbour of 2
    assert str(results[0]) == ("all_reduce #2 on group 'world': rank 2 called all_reduce with reduce op max "
                               "while rank 0 called all_reduce with reduce op sum")
    assert outcomes(4, 2, *CALLS["reduce op"][:2], "ring", check_calls=False) == ["returned"] * 4  # mixed!


def test_the_census_sentence_for_ranks_behind_ahead_gone_and_silent():
    heard = {1: (17, "all_reduce"), 2: (16, "broadcast"), 3: "returned (it never made this call)", 5: (18, "barrier")}
    text, missing = summary(0, 6, 17, "all_reduce", heard, 1.0)
    assert missing == [2, 3, 4]
    assert text == ("rank 2 never arrived at all_reduce #17 (it is stuck in broadcast #16); rank 3 never arrived "
                    "at all_reduce #17: it returned (it never made this call); rank 4 never arrived at all_reduce "
                    "#17 (no answer in 1.0s: stopped, hung or busy elsewhere); rank 5 is already at barrier #18; "
                    "ranks 0,1 waited in it")


def test_backend_nccl_checks_over_the_host_transport():
    from tests.doubles import fake_cupy, fake_nccl
    from tests.test_nccl_backend import run_nccl
    cp = fake_cupy.install(nccl=fake_nccl)
    try:
        def body(g):
            with pytest.raises(CollectiveMismatchError, match=r"all_reduce #1 on group 'world': .*rank 1 called "
                                                              r"all_reduce with reduce op max"):
                g.all_reduce(cp.ones(4), op="max" if g.rank == 1 else "sum")
        run_nccl(body, 3, timeout=5.0)
    finally:
        fake_cupy.uninstall()
