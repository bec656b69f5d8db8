"""backend="nccl": NVIDIA's collective library (through ``cupy.cuda.nccl``) on GPU (CuPy) buffers.

One NCCL communicator per :class:`~minidist.comm.group.ProcessGroup`. It is made the way NCCL asks:
rank 0 draws a unique id (128 bytes), the group's host transport broadcasts it (a binomial tree of
MPI messages), and every rank joins with ``NcclCommunicator(size, id, rank)``. A group from
``split`` makes its own the same way, over the split transport. NCCL allows one rank per GPU:
:func:`select_device` picks it (``launch.init`` calls it before the world group is made).

NCCL runs on the GPU, asynchronously: a call only queues a kernel on the current CuPy stream. To keep
the rule that a lost peer ends in a timeout, never a silent hang, every call here records a CUDA
event after its kernels and polls it until the group's timeout; then it aborts the communicator (the
kernels stop; the group can't be used afterwards) and raises PeerTimeout. NCCL cannot say which peer
is missing, so the peer is -1 ("a peer") for collectives.

NCCL's reduce-scatter and all-gather move equal parts. Our parts follow ``numpy.array_split``
(uneven, maybe empty), so those two pad every part to the largest one in a device scratch buffer,
run NCCL on the equal parts and compact the result; equal parts skip the copies.

Point-to-point (``NCCLCollectives.p2p``, an :class:`NCCLTransport`): NCCL has no tags (messages
between two ranks match in the order they were posted), and a stream runs its work in order, so a
lone ``ncclSend`` holds everything launched after it on the rank's stream until the peer receives.
A rank that sends and receives at once must post both in one ``groupStart()``/``groupEnd()``, which
NCCL runs together and completes together. Hence the rule: ``isend``/``irecv`` only queue, and one
NCCL group launches everything this rank has queued, at ``ProcessGroup.batch_isend_irecv`` (the
batch it queued, at once: :meth:`NCCLTransport.flush`), at the first ``wait`` or ``test`` of a
queued request, or before a collective. ``wait`` returns once the request's whole group is done.
The limit: a group completes only with all of its messages, so two ranks deadlock, then time out,
when each waits in a group for a message the other posts only in a later group. ``sendrecv`` puts
both of its requests in one group, so two ranks may exchange with it at once; two ranks that both
``send`` before they ``recv`` deadlock, as with MPI's synchronous sends. The pipeline posts each
round of its schedule as one batch, placed so that this cannot happen (parallel/pipeline/rounds.py).
"""
from __future__ import annotations

import threading
import time

import numpy as np

from minidist.comm import rooted
from minidist.comm.ops import Workspace, offsets
from minidist.comm.transport import Deadline, PeerTimeout, Request, Transport
from minidist.device import data_pointer, gpu_count, require_cupy, use_gpu

_DTYPES = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
           "int32": "NCCL_INT32", "int64": "NCCL_INT64"}
_OPS = {"sum": "NCCL_SUM", "prod": "NCCL_PROD", "max": "NCCL_MAX", "min": "NCCL_MIN"}
UNIQUE_ID_BYTES = 128


def select_device(local_rank: int, local_size: int) -> int:
    """Make GPU ``local_rank`` this process's current device and return it; a clear RuntimeError
    (on every rank of the node) when the node has fewer GPUs than ranks, which NCCL refuses."""
    require_cupy("backend 'nccl'")
    gpus = gpu_count()
    if gpus < local_size:
        raise RuntimeError(
            f"{local_size} ranks on this node but only {gpus} GPUs: NCCL does not allow two ranks of a "
            f"communicator on one GPU (NCCL >= 2.30 has an experimental switch for it); run at most {gpus} "
            f"ranks per node, or use backend 'ring', which stages GPU buffers through MPI")
    return use_gpu(local_rank)


def _nccl_module():
    """``cupy.cuda.nccl``, or an ImportError saying how to get it."""
    try:
        from cupy.cuda import nccl
    except ImportError:
        nccl = None
    if nccl is None or not getattr(nccl, "available", True):
        raise ImportError("backend 'nccl' needs CuPy with NCCL: python -m cupyx.tools.install_library "
                          "--library nccl --cuda 12.x (or pip install nvidia-nccl-cu12)")
    return nccl


class NCCLCollectives:
    """The collectives of one group on its own NCCL communicator, same names and meaning as
    ``native.MPICollectives``; ``p2p`` is the group's point-to-point over the same communicator.

    Making it is collective over ``transport`` (the host transport of the group): rank 0's unique id
    (128 int8) is broadcast to every rank. Every later call takes flat, contiguous CuPy arrays,
    launches on the current stream of this rank's GPU and returns once the GPU has finished."""

    def __init__(self, transport):
        cupy = require_cupy("backend 'nccl'")
        self.nccl = _nccl_module()
        self.rank, self.size, self.timeout = transport.rank, transport.size, transport.timeout
        self.device = cupy.cuda.runtime.getDevice()  # this rank's GPU: async collectives run on another thread
        unique_id = np.zeros(UNIQUE_ID_BYTES, np.int8)  # host memory: it travels over the host transport
        if self.rank == 0:
            unique_id[:] = self.nccl.get_unique_id()
        rooted.broadcast(transport, unique_id, 0)
        self.comm = self.nccl.NcclCommunicator(self.size, tuple(int(b) for b in unique_id), self.rank)
        self._cupy = cupy
        self._workspace = Workspace()
        self._token = cupy.zeros(1, np.int32)  # what the barrier all-reduces
        self._launching = threading.Lock()  # one host thread at a time talks to the communicator
        self._aborted: str | None = None
        self.p2p = NCCLTransport(self)

    # ---- collectives ---------------------------------------------------------------------------------

    def all_reduce(self, buf, op: str = "sum") -> None:
        """Every rank's ``buf`` becomes the elementwise ``op`` of all ranks' ``buf`` (``ncclAllReduce``,
        in place)."""
        if buf.size:
            dtype, nccl_op, p = self._dtype(buf), self._op(op), data_pointer(buf)
            self._run("all_reduce", lambda s: self.comm.allReduce(p, p, buf.size, dtype, nccl_op, s))

    def reduce_scatter(self, buf, counts, op, out) -> None:
        """Reduce ``buf`` (``sum(counts)`` elements on every rank; it may be clobbered) over all ranks
        and leave rank r's part, the ``counts[r]`` elements at ``sum(counts[:r])``, in ``out``
        (``ncclReduceScatter`` on parts padded to ``max(counts)``)."""
        n, m = self.size, max(counts)
        if m == 0:
            return
        dtype, nccl_op = self._dtype(buf), self._op(op)
        if all(c == m for c in counts):
            send, recv = data_pointer(buf), data_pointer(out)
            self._run("reduce_scatter", lambda s: self.comm.reduceScatter(send, recv, m, dtype, nccl_op, s))
            return
        padded = self._workspace.get("reduce_scatter_padded", buf.dtype, n * m, like=buf)  # (n * m,)
        padded[...] = 0  # the padding takes part in the reduction: keep it tame
        for r, (start, c) in enumerate(zip(offsets(counts), counts)):
            padded[r * m:r * m + c] = buf[start:start + c]
        part = self._workspace.get("reduce_scatter_part", buf.dtype, m, like=buf)  # (m,)
        send, recv = data_pointer(padded), data_pointer(part)
        self._run("reduce_scatter", lambda s: self.comm.reduceScatter(send, recv, m, dtype, nccl_op, s))
        out[...] = part[:counts[self.rank]]

    def all_gather(self, shard, counts, out) -> None:
        """Concatenate every rank's ``shard`` (rank r sends ``counts[r]`` elements) into ``out`` on
        every rank, in rank order (``ncclAllGather`` of parts padded to ``max(counts)``)."""
        n, m = self.size, max(counts)
        if m == 0:
            return
        dtype = self._dtype(shard)
        if all(c == m for c in counts):
            send, recv = data_pointer(shard), data_pointer(out)
            self._run("all_gather", lambda s: self.comm.allGather(send, recv, m, dtype, s))
            return
        part = self._workspace.get("all_gather_part", shard.dtype, m, like=shard)  # (m,)
        part[:counts[self.rank]] = shard
        gathered = self._workspace.get("all_gather_padded", shard.dtype, n * m, like=shard)  # (n * m,)
        send, recv = data_pointer(part), data_pointer(gathered)
        self._run("all_gather", lambda s: self.comm.allGather(send, recv, m, dtype, s))
        for r, (start, c) in enumerate(zip(offsets(counts), counts)):
            out[start:start + c] = gathered[r * m:r * m + c]

    def all_to_all(self, send, send_counts, recv, recv_counts, equal: bool = False) -> None:
        """Send ``send``'s chunk j (``send_counts[j]`` elements, at ``sum(send_counts[:j])``) to rank j
        and receive rank j's chunk for this rank into ``recv`` at ``sum(recv_counts[:j])``
        (``equal``, equal chunks on every rank, changes nothing here).

        NCCL has no all-to-all of its own: as torch's ``all_to_all_single`` does, it is one NCCL
        group (``groupStart()``/``groupEnd()``) of an ``ncclSend`` and an ``ncclRecv`` per peer, which
        NCCL schedules together, so no send waits for a receive posted after it. Empty chunks post
        nothing (both sides know the size); this rank's own chunk is a copy on the GPU. NCCL cannot
        tell a short message from a right one: ``ProcessGroup.all_to_all`` checks the counts first."""
        r, itemsize = self.rank, send.itemsize
        s_at, r_at = offsets(send_counts), offsets(recv_counts)
        dtype, nccl = self._dtype(send), self.nccl
        send_p, recv_p = data_pointer(send), data_pointer(recv)

        def issue(stream):
            recv[r_at[r]:r_at[r] + recv_counts[r]] = send[s_at[r]:s_at[r] + send_counts[r]]  # on this stream
            nccl.groupStart()
            try:
                for j in range(self.size):
                    if j != r and send_counts[j]:
                        self.comm.send(send_p + s_at[j] * itemsize, send_counts[j], dtype, j, stream)
                    if j != r and recv_counts[j]:
                        self.comm.recv(recv_p + r_at[j] * itemsize, recv_counts[j], dtype, j, stream)
            finally:
                nccl.groupEnd()
        self._run("all_to_all", issue)

    def broadcast(self, buf, root: int) -> None:
        """Copy ``root``'s ``buf`` into every rank's ``buf`` (``ncclBroadcast``, in place)."""
        if buf.size:
            dtype, p = self._dtype(buf), data_pointer(buf)
            self._run("broadcast", lambda s: self.comm.broadcast(p, p, buf.size, dtype, root, s))

    def reduce(self, buf, root: int, op: str = "sum") -> None:
        """``root``'s ``buf`` becomes the elementwise ``op`` of all ranks' ``buf`` (``ncclReduce``, in
        place at the root); other ranks' ``buf`` is unchanged (NCCL writes the result only there)."""
        if buf.size:
            dtype, nccl_op, p = self._dtype(buf), self._op(op), data_pointer(buf)
            self._run("reduce", lambda s: self.comm.reduce(p, p, buf.size, dtype, nccl_op, root, s))

    def barrier(self) -> None:
        """Return only once every rank has called ``barrier``: an all-reduce of one int32 on the GPU."""
        p, nccl = data_pointer(self._token), self.nccl
        self._run("barrier", lambda s: self.comm.allReduce(p, p, 1, nccl.NCCL_INT32, nccl.NCCL_SUM, s))

    # ---- launching and waiting -----------------------------------------------------------------------

    def launch(self, issue):
        """Call ``issue(stream_ptr)`` (NCCL calls) on this rank's GPU and its current stream; returns a
        CUDA event recorded behind the kernels it queued."""
        if self._aborted:
            raise RuntimeError(f"rank {self.rank}: this group's NCCL communicator was aborted after "
                               f"{self._aborted} timed out; make a new group")
        cupy = self._cupy
        with self._launching, cupy.cuda.Device(self.device):
            stream = cupy.cuda.get_current_stream()
            issue(stream.ptr)
            event = cupy.cuda.Event(disable_timing=True)
            event.record(stream)
        return event

    def wait(self, event, what: str, peer: int = -1) -> None:
        """Poll ``event`` until done. At the group's timeout, abort the communicator and raise
        PeerTimeout (``peer`` -1: NCCL can't say which peer is missing)."""
        deadline, pause = Deadline(self.timeout), 0.0
        while not event.done:
            if deadline.expired():
                self._aborted = what
                self.comm.abort()
                raise PeerTimeout(self.rank, peer, f"NCCL {what}", deadline.waited())
            time.sleep(pause)  # 0 first (a GPU collective may take microseconds), at most 1 ms
            pause = min(2 * pause + 1e-6, 1e-3)

    def _run(self, what: str, issue) -> None:
        self.p2p.flush()
        self.wait(self.launch(issue), what)

    def _dtype(self, buf):
        return getattr(self.nccl, _DTYPES[buf.dtype.name])

    def _op(self, op: str):
        return getattr(self.nccl, _OPS[op])


class NCCLTransport(Transport):
    """Point-to-point over a group's NCCL communicator, in batches (see the module docstring).

    ``isend``/``irecv`` queue a request; :meth:`flush` launches every queued one in a single
    ``groupStart()``/``groupEnd()``, called by ``ProcessGroup.batch_isend_irecv`` and by the first
    ``wait`` or ``test`` of a queued request; ``wait`` returns when that group is done. Tags are not
    sent: between two ranks, messages match in posting order.
    """

    def __init__(self, collectives: NCCLCollectives):
        self.collectives = collectives
        self.rank, self.size, self.timeout = collectives.rank, collectives.size, collectives.timeout
        self.name = "nccl"
        self._queued: list[NCCLRequest] = []

    def isend(self, buf, peer: int, tag: int = 0) -> "NCCLRequest":
        """Queue sending ``buf`` to ``peer`` (``tag`` is not sent); don't touch ``buf`` until done."""
        return self._queue("send", buf, peer)

    def irecv(self, buf, peer: int, tag: int = 0) -> "NCCLRequest":
        """Queue receiving ``peer``'s next message into ``buf`` (same number of bytes)."""
        return self._queue("recv", buf, peer)

    def flush(self) -> None:
        """Launch every queued request in one NCCL group (nothing when none is queued)."""
        batch, self._queued = self._queued, []
        if not batch:
            return
        comm, uint8 = self.collectives.comm, self.collectives.nccl.NCCL_UINT8

        def issue(stream):
            nccl = self.collectives.nccl
            nccl.groupStart()
            try:
                for r in batch:
                    call = comm.send if r.kind == "send" else comm.recv
                    call(data_pointer(r.buf), r.buf.nbytes, uint8, r.peer, stream)
            finally:
                nccl.groupEnd()
        event = self.collectives.launch(issue)
        peers = {r.peer for r in batch}
        for r in batch:
            r.event, r.batch_peer = event, peers.pop() if len(peers) == 1 else -1

    def _queue(self, kind: str, buf, peer: int) -> "NCCLRequest":
        if not 0 <= peer < self.size:
            raise ValueError(f"rank {self.rank}: peer {peer!r} is not a rank of this {self.size}-rank group")
        request = NCCLRequest(self, kind, buf.reshape(-1), int(peer))
        if buf.nbytes:  # an empty message moves nothing: both sides know its size
            self._queued.append(request)
        return request


class NCCLRequest(Request):
    """A queued send or receive; ``event`` is set once its batch is launched."""

    def __init__(self, transport: NCCLTransport, kind: str, buf, peer: int):
        self.transport, self.kind, self.buf, self.peer = transport, kind, buf, peer
        self.event = None if buf.nbytes else _DONE
        self.batch_peer = peer

    def test(self) -> bool:
        if self.event is None:
            self.transport.flush()
        return self.event.done

    def wait(self) -> None:
        if self.event is None:
            self.transport.flush()
        if self.event is not _DONE:
            self.transport.collectives.wait(self.event, self.kind, self.batch_peer)
            self.event = _DONE


class _Done:
    done = True


_DONE = _Done()  # the event of a request with nothing left to wait for
