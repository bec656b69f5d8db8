"""The point-to-point layer every collective is written over.

A transport moves the bytes of one contiguous array to one peer. It knows nothing about collectives:
the algorithms in ``ring.py``, ``doubling.py`` and ``rooted.py`` are written once over this interface
and run unchanged on MPI (``mpi_transport.py``) and on threads inside one process
(``local_transport.py``).

Semantics follow MPI's: messages between a pair of ranks with the same tag arrive in the order they
were sent; a send buffer must not be touched until its request completes; a receive buffer holds the
data once its request completes. Every wait has a deadline and ends in :class:`PeerTimeout` naming
the peer, never in a silent hang.
"""
from __future__ import annotations

import time


class PeerTimeout(Exception):
    """A request to or from ``peer`` did not complete within the transport's deadline.

    The group catches it and re-raises :class:`CommTimeoutError`, which adds the collective's name
    and sequence number.
    """

    def __init__(self, rank: int, peer: int, kind: str, waited: float):
        self.rank, self.peer, self.kind, self.waited = rank, peer, kind, waited
        super().__init__(f"rank {rank}: {kind} with peer {peer} did not complete in {waited:.1f}s")


class CommTimeoutError(TimeoutError):
    """A collective or point-to-point call timed out waiting for a peer.

    ``peer`` is the rank this rank's wait was on (-1: the library can't say which, NCCL); for a
    collective, ``census`` says what the group's census found (``census.py``) and ``missing`` lists
    the ranks that never arrived, which may be other than ``peer`` when ``peer`` was waiting too."""

    def __init__(self, op: str, seq: int, rank: int, peer: int, waited: float, group: str = "world",
                 census: str = "", missing: list[int] | None = None):
        self.op, self.seq, self.rank, self.peer, self.waited, self.group = op, seq, rank, peer, waited, group
        self.census, self.missing = census, list(missing or [])
        who = "a peer" if peer < 0 else f"rank {peer}"
        super().__init__(
            f"{op} #{seq} on group '{group}': rank {rank} waited {waited:.1f}s for {who}, "
            f"which never answered (did it skip this call, crash, or hang?)" + (f". Census: {census}" if census else ""))


class PeerFailed(Exception):
    """The MPI's fault-tolerance interface (ULFM) ended a request: a peer died (MPI_ERR_PROC_FAILED), or
    a survivor revoked the communicator after one did (MPI_ERR_REVOKED). ``failed``: the ranks this
    rank knows to be dead, which may be none when it saw only the revoke."""

    def __init__(self, rank: int, peer: int, kind: str, failed: list[int], revoked: bool):
        self.rank, self.peer, self.kind, self.failed, self.revoked = rank, peer, kind, list(failed), revoked
        why = "the communicator was revoked" if revoked else "the peer failed"
        super().__init__(f"rank {rank}: {kind} with peer {peer} ended: {why}; dead ranks known here: {self.failed}")


class ProcessFailedError(CommTimeoutError):
    """A call ended because a rank of its group died (``missing``: the dead ranks this rank knows of), or
    a survivor revoked the group after one did. A lost peer, as a timeout is: the same exit status, 3;
    a fault-tolerant job catches it and shrinks its world (``fault_tolerance.py``)."""

    def __init__(self, op: str, seq: int, error: PeerFailed, group: str = "world"):
        CommTimeoutError.__init__(self, op, seq, error.rank, error.peer, 0.0, group, missing=error.failed)
        self.revoked = error.revoked
        how = ("a survivor revoked the group (MPI_ERR_REVOKED)" if error.revoked
               else f"rank {error.peer} failed (MPI_ERR_PROC_FAILED)")
        dead = ",".join(map(str, error.failed)) or "none known here yet"
        self.args = (f"{op} #{seq} on group '{group}': rank {error.rank}'s {error.kind} with rank {error.peer} "
                     f"ended because {how}; dead ranks: {dead}",)


class CollectiveMismatchError(RuntimeError):
    """The ranks of a group did not all call the same collective the same way (``fingerprint.py``)."""


EXIT_CONFIG = 2
"""Exit status of a job that refused its configuration (bad flags, bad data): retrying cannot help."""
EXIT_COMM_TIMEOUT = 3
"""Exit status of a job whose collective or point-to-point call timed out (:class:`CommTimeoutError`)."""
EXIT_MISMATCH = 4
"""Exit status of a job whose ranks called different collectives (:class:`CollectiveMismatchError`)."""
EXIT_DIVERGED = 5
"""Exit status of a training run that diverged (a NaN or inf loss or gradient norm; minidist/train/divergence.py):
retrying from its last checkpoint would diverge the same way."""


def exit_code_for(error: BaseException) -> int:
    """The job's exit status for an uncaught ``error``: :data:`EXIT_COMM_TIMEOUT`, :data:`EXIT_MISMATCH`,
    else 1. The launcher (``python -m minidist.run``) reads it to say why a job ended."""
    if isinstance(error, CommTimeoutError):
        return EXIT_COMM_TIMEOUT
    if isinstance(error, CollectiveMismatchError):
        return EXIT_MISMATCH
    return 1


def check_timeout(timeout) -> None:
    """A ValueError unless ``timeout`` is a positive, finite number of seconds (a transport's deadline)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")


class Request:
    """A pending send or receive. ``wait`` blocks until done (or the deadline); ``test`` polls."""

    def test(self) -> bool:
        raise NotImplementedError

    def wait(self) -> None:
        raise NotImplementedError

    def cancel(self) -> None:
        """Withdraw a receive that has not matched (it will never fill its buffer); else nothing."""


def wait_all(requests) -> None:
    """Wait for every request in order (each has its own deadline)."""
    for r in requests:
        r.wait()


class Transport:
    """Point-to-point messages between ``size`` ranks, numbered 0..size-1 within this communicator.

    Subclasses implement ``isend``, ``irecv`` and ``split``; the blocking calls are built on them.
    ``timeout`` (seconds) is the deadline of every wait.
    """

    rank: int
    size: int
    timeout: float
    name: str = "world"

    def isend(self, buf, peer: int, tag: int = 0) -> Request:
        """Start sending the contiguous array ``buf`` to ``peer``. Do not modify ``buf`` until done."""
        raise NotImplementedError

    def irecv(self, buf, peer: int, tag: int = 0) -> Request:
        """Start receiving into the contiguous array ``buf`` (same size and dtype as the message)."""
        raise NotImplementedError

    def split(self, color: int, key: int) -> "Transport | None":
        """Collective over this transport: ranks with equal ``color`` form a new transport, ordered
        by (key, old rank). A negative color takes no part and gets ``None``."""
        raise NotImplementedError

    def abort(self, code: int = 1) -> None:
        """End the whole job (MPI) or nothing (in-process, where exceptions propagate anyway)."""

    def peer_gone(self, peer: int) -> str | None:
        """Why ``peer`` can never send again (e.g. "returned"), when the transport knows; else None."""
        return None

    # Blocking forms, shared by every transport.
    def send(self, buf, peer: int, tag: int = 0) -> None:
        """Send ``buf`` to ``peer`` and wait until the buffer may be reused."""
        self.isend(buf, peer, tag).wait()

    def recv(self, buf, peer: int, tag: int = 0) -> None:
        """Receive from ``peer`` into ``buf``."""
        self.irecv(buf, peer, tag).wait()

    def sendrecv(self, sendbuf, dst: int, recvbuf, src: int, tag: int = 0) -> None:
        """Send ``sendbuf`` to ``dst`` while receiving ``recvbuf`` from ``src``. The receive is posted
        first, so two ranks exchanging with each other never deadlock."""
        r = self.irecv(recvbuf, src, tag)
        s = self.isend(sendbuf, dst, tag)
        r.wait()
        s.wait()


class Deadline:
    """A point in time after which a wait gives up; ``expired()`` says whether it has come."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = time.monotonic()
        self.end = self.start + seconds

    def expired(self) -> bool:
        return time.monotonic() >= self.end

    def remaining(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def waited(self) -> float:
        return time.monotonic() - self.start
