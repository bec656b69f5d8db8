"""The in-process transport keeps MPI's point-to-point rules: FIFO per (communicator, source, tag),
rendezvous sends, exact sizes, a deadline on every wait, and split communicators that never cross."""
import threading

import numpy as np
import pytest

from minidist import run_local
from minidist.comm import LocalTransport, PeerExited, PeerTimeout


def on_transports(fn, n, timeout=5.0):
    """Run fn(transport) on n threads (through run_local, which starts them and collects errors)."""
    return run_local(lambda g: fn(g.transport), n, timeout=timeout)


def test_messages_with_one_tag_arrive_in_order_and_tags_match_independently():
    def fn(t):
        if t.rank == 0:
            requests = [t.isend(np.array([i]), 1, tag=5) for i in range(3)] + [t.isend(np.array([99]), 1, tag=6)]
            for r in requests:
                r.wait()
            return None
        got = [np.empty(1, np.int64) for _ in range(4)]
        t.recv(got[3], 0, tag=6)  # the tag-6 message is found although three tag-5 ones came first
        for g in got[:3]:
            t.recv(g, 0, tag=5)
        return [int(g[0]) for g in got]

    assert on_transports(fn, 2)[1] == [0, 1, 2, 99]


def test_a_send_completes_only_once_the_receiver_has_copied_it():
    def fn(t):
        go = np.zeros(1)
        if t.rank == 0:
            req = t.isend(np.arange(4.0), 1, tag=0)
            pending = not req.test()  # rank 1 cannot have posted its receive yet: it waits for "go"
            t.send(go, 1, tag=1)
            req.wait()
            return pending
        t.recv(go, 0, tag=1)
        buf = np.empty(4)
        t.recv(buf, 0, tag=0)
        return buf

    pending, received = on_transports(fn, 2)
    assert pending
    np.testing.assert_array_equal(received, np.arange(4.0))


@pytest.mark.parametrize("recv_buf", [np.empty(3, np.float32), np.empty(4, np.float64)], ids=["dtype", "size"])
def test_a_receive_that_does_not_fit_the_message_fails_on_both_sides(recv_buf):
    def fn(t):
        try:
            if t.rank == 0:
                t.send(np.zeros(3), 1)
            else:
                t.recv(recv_buf.copy(), 0)
        except ValueError as e:
            return str(e)

    for message in on_transports(fn, 2):
        assert message == f"rank 0 sent 3 x float64 to rank 1 (tag 0), but rank 1 posted a receive for " \
                          f"{recv_buf.size} x {recv_buf.dtype}"


def test_a_copy_that_fails_fails_both_sides_at_once(monkeypatch):
    """Whatever the copy of a matched message raises (buffers in memories it cannot join, say)
    reaches both ranks' waits at once: neither waits for a message that will never come."""
    def refuse(src, dst):
        raise TypeError("cannot copy between these buffers")
    monkeypatch.setattr("minidist.comm.local_transport.copy_array", refuse)

    def fn(t):  # the copy's TypeError, not the PeerTimeout of the transport's 5 s deadline, ends both waits
        with pytest.raises(TypeError, match="cannot copy between these buffers"):
            if t.rank == 0:
                t.send(np.zeros(3), 1)
            else:
                t.recv(np.empty(3), 0)
        return "raised"

    ended = []  # in a thread of its own, so that a regression fails here instead of hanging the suite
    worker = threading.Thread(target=lambda: ended.extend(on_transports(fn, 2)), daemon=True)
    worker.start()
    worker.join(60)  # a safety net only: a wait that hangs would end in PeerTimeout after 5 s anyway
    assert not worker.is_alive(), "a rank still waits for the message whose copy failed"
    assert ended == ["raised", "raised"]


def test_a_wait_past_the_deadline_raises_peer_timeout_and_withdraws_the_receive():
    timed_out = threading.Event()

    def fn(t):
        if t.rank == 1:
            assert timed_out.wait(timeout=60)  # alive, but sends only after rank 0's first receive gave up
            t.send(np.array([7.0]), 0)
            return None
        early, late = np.zeros(1), np.zeros(1)
        try:
            with pytest.raises(PeerTimeout) as info:
                t.recv(early, 1)
        finally:
            timed_out.set()
        t.timeout = 5.0
        t.recv(late, 1)  # the late message goes to the new receive, not the abandoned buffer
        return info.value, early[0], late[0]

    error, early, late = on_transports(fn, 2, timeout=0.2)[0]
    assert (error.rank, error.peer, error.kind) == (0, 1, "recv") and error.waited >= 0.2  # the deadline
    assert not isinstance(error, PeerExited)
    assert (early, late) == (0.0, 7.0)


def test_waiting_on_a_rank_that_has_exited_fails_at_once():
    def fn(t):
        if t.rank == 0:  # PeerExited: ended by rank 1's exit, not by the 30 s deadline (a plain PeerTimeout)
            with pytest.raises(PeerExited, match="rank 1 returned") as info:
                t.recv(np.zeros(1), 1)
            return info.value.peer

    assert on_transports(fn, 2, timeout=30.0)[0] == 1


def test_sendrecv_around_a_ring_does_not_deadlock():
    def fn(t):
        got = np.empty(1, np.int64)
        t.sendrecv(np.array([t.rank]), (t.rank + 1) % t.size, got, (t.rank - 1) % t.size)
        return int(got[0])

    assert on_transports(fn, 5) == [4, 0, 1, 2, 3]


def test_split_orders_by_key_then_old_rank_and_skips_negative_colors():
    def fn(t):
        colors, keys = [0, 1, 0, 0, -1, 1], [5, 0, 2, 2, 0, 0]
        sub = t.split(colors[t.rank], keys[t.rank])
        return None if sub is None else (sub.rank, sub.size, sub.world_ranks)

    assert on_transports(fn, 6) == [(2, 3, [2, 3, 0]), (0, 2, [1, 5]), (0, 3, [2, 3, 0]), (1, 3, [2, 3, 0]),
                                    None, (1, 2, [1, 5])]


def test_a_split_communicator_has_its_own_message_space():
    def fn(t):
        sub = t.split(0, t.rank)  # same members, same ranks, different communicator
        if t.rank == 0:
            a, b = sub.isend(np.array([1.0]), 1), t.isend(np.array([2.0]), 1)
            a.wait()
            b.wait()
            return None
        world, split = np.zeros(1), np.zeros(1)
        t.recv(world, 0)  # posted first, yet it must get the message sent on the world communicator
        sub.recv(split, 0)
        return world[0], split[0]

    assert on_transports(fn, 2)[1] == (2.0, 1.0)


def test_buffers_must_be_contiguous():
    t = LocalTransport.world(1)[0]
    with pytest.raises(ValueError, match="C-contiguous"):
        t.isend(np.zeros((4, 4))[:, 0], 0)
