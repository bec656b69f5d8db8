"""N ranks as threads in one process: the transport behind ``run_local`` and the property tests.

Matching follows MPI. A send from ``src`` to ``dst`` with ``tag`` meets the oldest unmatched receive
that ``dst`` posted for (``src``, ``tag``) on the same communicator, and vice versa: one FIFO queue per
(communicator, src, dst, tag), so messages between two ranks with one tag never overtake each other.

It is a rendezvous: whichever side is posted second copies the bytes straight from the send buffer
into the receive buffer (one memcpy, nothing in between), and both requests complete. So a send
completes only once its data has arrived, like ``MPI_Ssend``: stricter than MPI's small-message
buffering, so code that works here does not depend on it.

All ranks of one world share a :class:`LocalHub` (the mailboxes). A wait that cannot complete ends in
:class:`PeerTimeout` at the deadline, or at once with :class:`PeerExited` when ``run_local`` has
reported that the peer's thread is gone.
"""
from __future__ import annotations

import threading
from collections import deque

import numpy as np

from minidist.comm import ring
from minidist.comm.transport import Deadline, PeerTimeout, Request, Transport, check_timeout
from minidist.device import copy_array

POLL_SECONDS = 0.05  # how often a waiting rank checks whether its peer has exited


class PeerExited(PeerTimeout):
    """A request can never complete: its peer's thread has already finished (returned or raised)."""

    def __init__(self, rank: int, peer: int, kind: str, waited: float, why: str):
        super().__init__(rank, peer, kind, waited)
        self.why = why
        self.args = (f"rank {rank}: {kind} with peer {peer} can never complete: rank {peer} {why}",)


class LocalHub:
    """The mailboxes shared by the ranks of one in-process world, and who has exited."""

    def __init__(self, size: int):
        self.size = size
        self.exited: dict[int, str] = {}  # world rank -> how its thread ended
        self._lock = threading.Lock()
        self._unmatched: dict[tuple, deque] = {}  # (comm, src, dst, tag, kind) -> requests, oldest first

    def post(self, request: "LocalRequest") -> None:
        """Match ``request`` with the oldest unmatched one of the other kind, or queue it."""
        other_kind = "recv" if request.kind == "send" else "send"
        with self._lock:
            queue = self._unmatched.get(request.key + (other_kind,))
            if not queue:
                self._unmatched.setdefault(request.key + (request.kind,), deque()).append(request)
                return
            other = queue.popleft()
            if not queue:
                del self._unmatched[request.key + (other_kind,)]
        if request.kind == "send":
            _deliver(request, other)
        else:
            _deliver(other, request)

    def cancel(self, request: "LocalRequest") -> bool:
        """Withdraw an unmatched request; False if it was matched already (its copy is under way)."""
        with self._lock:
            queue = self._unmatched.get(request.key + (request.kind,))
            if queue is None or request not in queue:
                return False
            queue.remove(request)
            if not queue:
                del self._unmatched[request.key + (request.kind,)]
            return True

    def mark_exited(self, world_rank: int, why: str) -> None:
        """Record that a rank's thread has ended, so waits on it fail at once instead of at the
        deadline."""
        self.exited[world_rank] = why


def _deliver(send: "LocalRequest", recv: "LocalRequest") -> None:
    """Copy a matched message from the sender's buffer into the receiver's and complete both. A copy
    that fails (sizes that disagree, buffers the copy cannot join) fails both requests, so neither
    rank waits for a message that will never come."""
    s, r = send.buf, recv.buf
    try:
        if s.dtype != r.dtype or s.size != r.size:
            raise ValueError(f"rank {send.rank} sent {s.size} x {s.dtype} to rank {recv.rank} (tag {send.tag}), "
                             f"but rank {recv.rank} posted a receive for {r.size} x {r.dtype}")
        copy_array(s, r)
    except Exception as e:  # noqa: BLE001 -- handed to both ranks' waits
        send.error = recv.error = e
    finally:
        send.done.set()
        recv.done.set()


class LocalRequest(Request):
    """A posted send or receive; complete once matched and copied."""

    def __init__(self, transport: "LocalTransport", buf, peer: int, tag: int, kind: str):
        self.transport, self.peer, self.tag, self.kind = transport, peer, tag, kind
        self.rank = transport.rank
        self.buf = buf.reshape(-1)  # a view: buf is contiguous
        src, dst = (self.rank, peer) if kind == "send" else (peer, self.rank)
        self.key = (transport.comm_id, src, dst, tag)
        self.done = threading.Event()
        self.error: Exception | None = None

    def test(self) -> bool:
        if self.done.is_set() and self.error is not None:
            raise self.error
        return self.done.is_set()

    def wait(self) -> None:
        t = self.transport
        deadline = Deadline(t.timeout)
        while not self.done.wait(min(POLL_SECONDS, deadline.remaining())):
            why = t.hub.exited.get(t.world_ranks[self.peer])
            if why is None and not deadline.expired():
                continue
            if not t.hub.cancel(self):  # matched at the last moment: the copy finishes shortly
                self.done.wait()
                break
            if why is not None:
                raise PeerExited(self.rank, self.peer, self.kind, deadline.waited(), why)
            raise PeerTimeout(self.rank, self.peer, self.kind, deadline.waited())
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        self.transport.hub.cancel(self)


class LocalTransport(Transport):
    """Rank ``rank`` of ``size`` threads that share ``hub``. Make a whole world with :meth:`world`.

    ``comm_id`` names the communicator (messages only match within one), ``world_ranks[i]`` is the
    world rank of this communicator's rank i (to check whether that thread has exited).
    """

    def __init__(self, rank: int, size: int, timeout: float = 60.0, *, hub: LocalHub,
                 comm_id: tuple = (), world_ranks: list[int] | None = None, name: str = "world"):
        self.rank, self.size, self.timeout, self.hub = rank, size, timeout, hub
        self.comm_id = comm_id
        self.world_ranks = list(range(size)) if world_ranks is None else world_ranks
        self.name = name
        self._splits = 0

    @classmethod
    def world(cls, size: int, timeout: float = 60.0) -> list["LocalTransport"]:
        """The transports of a fresh world of ``size`` ranks, one per thread, in rank order."""
        check_timeout(timeout)
        hub = LocalHub(size)
        return [cls(rank, size, timeout, hub=hub) for rank in range(size)]

    def isend(self, buf, peer: int, tag: int = 0) -> LocalRequest:
        """Post ``buf`` for ``peer``; it completes when ``peer``'s matching receive has copied it."""
        return self._post(buf, peer, tag, "send")

    def irecv(self, buf, peer: int, tag: int = 0) -> LocalRequest:
        """Post ``buf`` to receive ``peer``'s next message with ``tag`` (same dtype and size)."""
        return self._post(buf, peer, tag, "recv")

    def _post(self, buf, peer, tag, kind) -> LocalRequest:
        if not 0 <= peer < self.size:
            raise ValueError(f"rank {self.rank}: peer {peer} is not a rank of this {self.size}-rank communicator")
        if not buf.flags.c_contiguous or (kind == "recv" and not buf.flags.writeable):
            raise ValueError(f"rank {self.rank}: a {kind} buffer must be C-contiguous"
                             + (" and writeable" if kind == "recv" else ""))
        request = LocalRequest(self, buf, peer, tag, kind)
        self.hub.post(request)
        return request

    def peer_gone(self, peer: int) -> str | None:
        """How ``peer``'s thread ended, once ``run_local`` has reported it; else None."""
        return self.hub.exited.get(self.world_ranks[peer])

    def split(self, color: int, key: int) -> "LocalTransport | None":
        """Collective: all-gather everyone's (color, key) with the ring, then keep the ranks of my color
        ordered by (key, old rank). The new communicator's id extends this one's by (split number,
        color), the same on every member, so its messages match only among its members."""
        mine = np.array([color, key], dtype=np.int64)
        everyone = np.empty(2 * self.size, dtype=np.int64)  # (color, key) of rank 0, rank 1, ...
        ring.all_gather(self, mine, [2] * self.size, everyone)
        self._splits += 1
        if color < 0:
            return None
        members = sorted((int(everyone[2 * r + 1]), r) for r in range(self.size) if everyone[2 * r] == color)
        old_ranks = [r for _, r in members]
        return LocalTransport(old_ranks.index(self.rank), len(old_ranks), self.timeout, hub=self.hub,
                              comm_id=self.comm_id + ((self._splits, color),),
                              world_ranks=[self.world_ranks[r] for r in old_ranks],
                              name=f"{self.name}/{color}")
