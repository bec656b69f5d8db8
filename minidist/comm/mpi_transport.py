"""The transport over MPI: point-to-point messages between processes started by ``mpiexec``.

Every message is the raw bytes of one contiguous array, sent with mpi4py's upper-case buffer API
(``comm.Isend([buf, MPI.BYTE], dest, tag)``): no pickling, no copies. The collectives written over
:class:`~minidist.comm.transport.Transport` decide what the bytes mean.

A wait never blocks inside MPI. It polls ``Request.Test()`` and calls ``sched_yield`` between polls:
on an idle core that costs a microsecond (so it is as fast as a busy spin), and when more ranks than
cores share a machine it hands the core to the rank we are waiting for. A busy spin measured 10-100x
slower with 4 ranks on 2 cores; sleeping from the start cost ~60 us a message (the timer's slack).
After a few milliseconds the peer is evidently busy, so polls are spaced by growing sleeps. Past the
deadline the wait raises :class:`~minidist.comm.transport.PeerTimeout` naming the peer.

GPU (CuPy) buffers: a CUDA-aware MPI reads and writes device memory itself, so the buffer is handed
over as it is, once the current stream is synchronised (the kernels that produce or read it are
done). The pip ``mpich`` wheel is not CUDA-aware: then each message is staged through a page-locked
host buffer, copied off the GPU before the send and onto it when the receive completes. Which one
applies is asked of the MPI library at start-up (:func:`query_cuda_aware`) and can be overridden.

``import minidist`` must not start MPI, so mpi4py is imported only inside :meth:`MPITransport.world`.
"""
from __future__ import annotations

import ctypes
import os
import re
import sys
import time
import traceback

from minidist.comm.transport import PeerFailed, PeerTimeout, Request, Transport, check_timeout, exit_code_for
from minidist.device import copy_to_device, copy_to_host, is_cupy, pinned_empty, synchronize

YIELD_SECONDS = 5e-3   # poll, offering the core to others (sched_yield) between polls, this long;
FIRST_SLEEP = 50e-6    # then sleep between polls, doubling each time ...
MAX_SLEEP = 1e-3       # ... up to this.


class MPIRequest(Request):
    """A pending ``Isend``/``Irecv``; ``wait`` polls ``Test`` until done or the deadline passes.

    For a receive, the message length is checked against the buffer, so a sender and receiver that
    disagree about a size fail loudly instead of leaving stale bytes in the buffer.

    A staged message keeps its host buffer ``staging`` alive until done; a staged receive then copies
    it onto the GPU, into ``device``.
    """

    def __init__(self, transport: "MPITransport", request, peer: int, kind: str, nbytes: int,
                 staging=None, device=None):
        self.transport, self.request, self.peer, self.kind, self.nbytes = transport, request, peer, kind, nbytes
        self.staging, self.device = staging, device
        self.status = transport.MPI.Status() if kind == "recv" else None
        self.done = False

    def test(self) -> bool:
        try:
            finished = self.done or self.request.Test(self.status)
        except self.transport.MPI.Exception as e:
            raise self.transport.failure(e, self.peer, self.kind) from e
        if finished and not self.done:
            self.done = True
            if self.status is not None:
                got = self.status.Get_count(self.transport.MPI.BYTE)
                if got != self.nbytes:
                    raise ValueError(f"rank {self.transport.rank}: received {got} bytes from rank "
                                     f"{self.peer} into a buffer of {self.nbytes} bytes")
            if self.device is not None:
                copy_to_device(self.staging, self.device)
            self.staging = self.device = None
        return self.done

    def wait(self) -> None:
        waited = poll(self.test, self.transport.timeout)
        if waited is not None:
            if self.kind == "recv":
                withdraw(self.transport.MPI, self.request, wait=False)  # the buffer may be reused: never fill it late
            raise PeerTimeout(self.transport.rank, self.peer, self.kind, waited)

    def cancel(self) -> None:
        """Cancel a receive that has not completed (``MPI_Cancel``), so it never fills its buffer late."""
        if self.kind == "recv" and not self.done:
            withdraw(self.transport.MPI, self.request)
            self.done = True


def withdraw(MPI, request, wait: bool = True) -> None:
    """Cancel a receive (``MPI_Cancel``) and, with ``wait``, let it complete (at once: cancelled, or
    its message had just arrived). One that a dead peer or a revoked communicator ended (ULFM) has
    nothing left to withdraw."""
    try:
        request.Cancel()
        if wait:
            request.Wait()
    except MPI.Exception:
        pass


def poll(test, timeout: float) -> float | None:
    """Call ``test()`` until it returns True, as the module docstring says: ``sched_yield`` between
    polls for the first YIELD_SECONDS, then growing sleeps. Returns None once ``test()`` is True, or
    the seconds waited when ``timeout`` passed first."""
    if test():
        return None
    start = time.monotonic()
    pause = FIRST_SLEEP
    while not test():
        now = time.monotonic()
        if now - start < YIELD_SECONDS:
            os.sched_yield()
            continue
        if now - start >= timeout:
            return now - start
        time.sleep(pause)
        pause = min(2 * pause, MAX_SLEEP)
    return None


class MPITransport(Transport):
    """Point-to-point over an mpi4py communicator ``comm`` (its ranks are this transport's ranks).

    ``comm`` is also exposed for ``native.py``, which calls MPI's own collectives on it.
    ``cuda_aware``: hand GPU buffers to MPI as they are (True) or stage them through pinned host
    memory (False).
    """

    def __init__(self, comm, timeout: float = 300.0, name: str = "world", cuda_aware: bool = False):
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = timeout
        self.name = name
        self.cuda_aware = cuda_aware

    @classmethod
    def world(cls, timeout: float = 300.0, cuda_aware: bool | None = None) -> "MPITransport":
        """Start MPI (if needed) and wrap a duplicate of ``COMM_WORLD``; in a process that a running job
        started (``comm/fault_tolerance.py``'s ``grow``: MPI_Comm_spawn), the job's world with this
        process's (MPI_Intercomm_merge with its parents, theirs first).

        The duplicate has its own message space, so a user's MPI messages never match ours. Also
        installs an exception hook: an uncaught exception on any rank prints its traceback tagged
        with the rank, then aborts the whole job, instead of leaving the other ranks waiting forever.
        ``cuda_aware=None`` asks the MPI library (:func:`query_cuda_aware`).
        """
        check_timeout(timeout)  # before MPI starts
        from mpi4py import MPI
        if cuda_aware is None:
            cuda_aware = query_cuda_aware()
        parent = MPI.Comm.Get_parent()
        comm = MPI.COMM_WORLD.Dup() if parent == MPI.COMM_NULL else parent.Merge(high=True)
        comm.Set_errhandler(MPI.ERRORS_RETURN)  # (mpi4py's on COMM_WORLD; a merged world's is set here)
        transport = cls(comm, timeout, cuda_aware=cuda_aware)
        sys.excepthook = _abort_on_uncaught_exception(transport)
        return transport

    def isend(self, buf, peer: int, tag: int = 0) -> MPIRequest:
        """Start sending the bytes of ``buf`` to ``peer``. A GPU buffer goes as it is to a CUDA-aware
        MPI (after its stream is synchronised), else it is first copied into a pinned host buffer."""
        staging = None
        if is_cupy(buf):
            if self.cuda_aware:
                synchronize(buf)
            else:
                staging = pinned_empty(buf.shape, buf.dtype)
                copy_to_host(buf, staging)  # waits for the kernels queued before it
        request = self.comm.Isend([buf if staging is None else staging, self.MPI.BYTE], dest=peer, tag=tag)
        return MPIRequest(self, request, peer, "send", buf.nbytes, staging=staging)

    def irecv(self, buf, peer: int, tag: int = 0) -> MPIRequest:
        """Start receiving ``buf.nbytes`` bytes from ``peer`` into ``buf``. A GPU buffer is written by a
        CUDA-aware MPI directly (once the kernels still using it are done), else the bytes land in a
        pinned host buffer and are copied onto the GPU when the receive completes."""
        staging = None
        if is_cupy(buf):
            synchronize(buf)  # no queued kernel may still read the buffer MPI is about to fill
            if not self.cuda_aware:
                staging = pinned_empty(buf.shape, buf.dtype)
        request = self.comm.Irecv([buf if staging is None else staging, self.MPI.BYTE], source=peer, tag=tag)
        return MPIRequest(self, request, peer, "recv", buf.nbytes, staging=staging,
                          device=buf if staging is not None else None)

    def sendrecv(self, sendbuf, dst: int, recvbuf, src: int, tag: int = 0) -> None:
        """Send ``sendbuf`` to ``dst`` while receiving ``recvbuf`` from ``src``, the receive posted
        first. Host buffers: the two requests are polled together (one ``Request.Testall`` per poll,
        no request objects of ours): the collectives' inner step, so its fixed cost counts (about
        8 us less than two waits on a 128 KiB exchange). GPU buffers go through :meth:`isend` /
        :meth:`irecv`, which stage them."""
        if is_cupy(sendbuf) or is_cupy(recvbuf):
            return super().sendrecv(sendbuf, dst, recvbuf, src, tag)
        MPI = self.MPI
        requests = [self.comm.Irecv([recvbuf, MPI.BYTE], source=src, tag=tag),
                    self.comm.Isend([sendbuf, MPI.BYTE], dest=dst, tag=tag)]
        statuses = [MPI.Status(), MPI.Status()]
        try:
            waited = poll(lambda: MPI.Request.Testall(requests, statuses), self.timeout)
        except MPI.Exception as e:  # ULFM's: which of the two peers is one of the dead ranks, if known
            failed = self.failure(e, src, "sendrecv")
            if isinstance(failed, PeerFailed) and dst in failed.failed:
                failed.peer = dst
            raise failed from e
        if waited is not None:  # a Testall that says False leaves both requests as they were
            try:
                received = requests[0].Test()
            except MPI.Exception as e:  # ULFM's, in the moment since the last poll
                raise self.failure(e, src, "recv") from e
            if not received:
                withdraw(MPI, requests[0], wait=False)  # the buffer may be reused: never fill it late
                raise PeerTimeout(self.rank, src, "recv", waited)
            raise PeerTimeout(self.rank, dst, "send", waited)
        got = statuses[0].Get_count(MPI.BYTE)
        if got != recvbuf.nbytes:
            raise ValueError(f"rank {self.rank}: received {got} bytes from rank {src} into a buffer of "
                             f"{recvbuf.nbytes} bytes")

    def split(self, color: int, key: int) -> "MPITransport | None":
        """``MPI_Comm_split``: a collective over this communicator. Negative ``color`` -> ``None``."""
        comm = self.comm.Split(color if color >= 0 else self.MPI.UNDEFINED, key)
        if comm == self.MPI.COMM_NULL:
            return None
        return MPITransport(comm, self.timeout, f"{self.name}/{color}", cuda_aware=self.cuda_aware)

    def abort(self, code: int = 1) -> None:
        """End every process of the job (``MPI_Abort``)."""
        self.comm.Abort(code)

    def failure(self, error, peer: int, kind: str) -> Exception:
        """``error`` (an ``MPI.Exception`` from a request with ``peer``) as :class:`PeerFailed` when it is
        the fault-tolerance interface's (a dead peer, a revoked communicator), else as it is. An MPI
        without the interface (mpi4py then gives its classes MPI_ERR_UNKNOWN's number) never says so."""
        MPI = self.MPI
        code = error.Get_error_class()
        if MPI.ERR_PROC_FAILED == MPI.ERR_UNKNOWN or code not in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED):
            return error
        return PeerFailed(self.rank, peer, kind, self.failed_ranks(), code == MPI.ERR_REVOKED)

    def failed_ranks(self) -> list[int]:
        """The ranks of this communicator that MPI has told this rank are dead (``MPI_Comm_get_failed``)."""
        try:
            dead = self.comm.Get_failed()
        except (NotImplementedError, self.MPI.Exception):  # an MPI without the interface
            return []
        ranks = self.MPI.Group.Translate_ranks(dead, list(range(dead.Get_size())), self.comm.Get_group())
        dead.Free()
        return sorted(ranks)


def query_cuda_aware() -> bool:
    """Whether the MPI library in this process reads and writes GPU memory itself.

    Asks ``MPIX_Query_cuda_support()``, an extension that both Open MPI and MPICH export, of the
    ``libmpi`` this process has loaded (call after MPI started). A library without it, or one that
    cannot be found, counts as not CUDA-aware: staging is always correct, only slower. The pip
    ``mpich`` wheel answers 0.
    """
    try:
        for path in loaded_libmpi():
            query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
            if query is not None:
                return bool(query())
    except OSError:
        pass
    return False


def loaded_libmpi() -> list[str]:
    """The paths of the ``libmpi`` shared libraries this process has loaded (read from /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        return sorted(set(re.findall(r"(/\S*libmpi\S*\.so[.\d]*)", maps.read())))


def _abort_on_uncaught_exception(transport: MPITransport):
    """An excepthook that prints the traceback prefixed with the rank, then aborts the MPI job with
    the exit status of the error (:func:`~minidist.comm.transport.exit_code_for`)."""

    def hook(exc_type, exc, tb):
        lines = traceback.format_exception(exc_type, exc, tb)
        text = "".join(f"[rank {transport.rank}] {line}" for chunk in lines for line in chunk.splitlines(True))
        sys.stderr.write(text)
        sys.stderr.flush()
        transport.abort(exit_code_for(exc))

    return hook
