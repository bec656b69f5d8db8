"""Asynchronous collectives: ``async_op=True`` returns a Work at once; queued collectives of a group
run in issue order on its communication thread; a blocking collective waits its turn; errors come
back from ``wait()``."""
import threading

import numpy as np
import pytest

from minidist import run_local
from minidist.comm import CommTimeoutError


def test_async_all_reduce_returns_before_the_peers_arrive_and_wait_gives_the_sum():
    issued = threading.Event()  # set by rank 0 once its call has returned; only then does rank 1 make its own

    def fn(group):
        if group.rank == 1 and not issued.wait(timeout=30):  # a safety net: a blocking call never sets it
            raise AssertionError("rank 0's async all_reduce did not return before rank 1 arrived")
        x = np.full(5, group.rank + 1.0)
        work = group.all_reduce(x, async_op=True)
        done_at_once = work.is_completed()
        issued.set()
        result = work.wait()
        return done_at_once, result is x, x.copy(), work.is_completed()

    (done_at_once, same, x, completed), *others = run_local(fn, world_size=2)
    assert not done_at_once  # rank 0's call returned, and was not complete, before rank 1 had even called
    assert same and completed
    np.testing.assert_array_equal(x, np.full(5, 3.0))
    np.testing.assert_array_equal(others[0][2], np.full(5, 3.0))


@pytest.mark.parametrize("world_size", [2, 3])
def test_queued_collectives_run_in_issue_order_and_a_blocking_one_waits_its_turn(world_size):
    def fn(group):
        a, b = np.full(4, group.rank + 1.0), np.arange(6.0) * (group.rank + 1)
        shard = np.full(2, float(group.rank))
        works = [group.all_reduce(a, async_op=True),
                 group.reduce_scatter(b.reshape(3, 2), async_op=True),
                 group.all_gather(shard, async_op=True)]
        c = group.all_reduce(np.ones(3))  # blocking: runs after the three above
        results = [w.wait() for w in works]
        events = [(e.op, e.seq, e.start, e.end) for e in group.trace.events]
        return results, c, events

    n = world_size
    total = n * (n + 1) / 2
    for rank, (results, c, events) in enumerate(run_local(fn, world_size=n)):
        np.testing.assert_array_equal(results[0], np.full(4, total))
        rows = np.array_split(np.arange(6.0).reshape(3, 2) * total, n)[rank]
        np.testing.assert_array_equal(results[1], rows)
        np.testing.assert_array_equal(results[2], np.repeat(np.arange(n, dtype=float), 2))
        np.testing.assert_array_equal(c, np.full(3, float(n)))
        assert [(op, seq) for op, seq, _, _ in events] == [
            ("all_reduce", 1), ("reduce_scatter", 2), ("all_gather", 3), ("all_reduce", 4)]
        assert all(events[i][3] <= events[i + 1][2] for i in range(3))  # one after another


def test_bad_arguments_fail_at_the_call_not_at_wait():
    def fn(group):
        with pytest.raises(ValueError, match="op must be one of"):
            group.all_reduce(np.ones(2), op="mean", async_op=True)
        with pytest.raises(ValueError, match="C-contiguous"):
            group.all_gather(np.ones((4, 4))[:, 0], async_op=True)
        return group.seq

    assert run_local(fn, world_size=2) == [0, 0]  # nothing was queued


def test_a_peer_that_never_joins_surfaces_from_wait_as_comm_timeout_error():
    def fn(group):
        if group.rank == 1:
            return None  # skips the all-reduce
        work = group.all_reduce(np.ones(4), async_op=True)
        with pytest.raises(CommTimeoutError, match=r"all_reduce #1 .* rank 0 .* rank 1"):
            work.wait()
        return work.is_completed()

    assert run_local(fn, world_size=2, timeout=5.0) == [True, None]
