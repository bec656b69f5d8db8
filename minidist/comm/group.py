"""ProcessGroup: the collectives a training script calls, on any transport.

A group checks its arguments on the spot (a clear ``ValueError`` before anything is sent), numbers
each collective (``seq``, the same on every rank), records it in the trace, picks the algorithm and
runs it. A peer that never answers surfaces as :class:`CommTimeoutError` naming the operation, its
number, this rank and the peer, and, from a census of the group (``census.py``), the rank that never
arrived. Before each collective every rank compares what it was asked to do (collective, reduce op,
dtype, count, root, number) with its ring neighbours and raises :class:`CollectiveMismatchError` where
they disagree, instead of hanging or mixing up data (``fingerprint.py``; ``check_calls=False`` skips
it, ``debug=True`` compares with every rank instead, so that every rank raises).

``async_op=True`` (all_reduce, reduce_scatter, all_gather) queues the collective on the group's
communication thread and returns a :class:`~minidist.comm.work.Work` at once (see ``work.py``):
queued collectives run in issue order, and a blocking collective waits for them first.

``backend="ring"`` runs the hand-written algorithms (``ring``, ``doubling``, ``rooted``) over the
transport; ``backend="mpi"`` hands the collectives to MPI's own (``native``), which needs an
``MPITransport``; ``backend="nccl"`` hands collectives and point-to-point calls on GPU (CuPy) arrays
to NCCL (``nccl``), one communicator per group, while host (NumPy) arrays, such as a flag or a
gathered log line, still go over the transport with the hand-written algorithms. ``algorithm="ring"``
or ``"doubling"`` forces a hand-written all-reduce on any.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import numpy as np

from minidist.comm import census, doubling, ring, rooted
from minidist.comm.fingerprint import check_everyone, check_neighbours, fingerprint
from minidist.comm.ops import (COLLECTIVE_TAG_BASE, DTYPES, GROUP_OPS, TAG_GATHER_BYTES, Workspace, divide_by_size,
                               split_counts)
from minidist.comm.trace import Trace
from minidist.comm.transport import CommTimeoutError, PeerTimeout, Request
from minidist.comm.work import CommStream
from minidist.device import device_of, get_array_module, is_cupy

DEFAULT_THRESHOLD_BYTES = 256 * 1024
"""All-reduces smaller than this use recursive doubling, larger ones the ring. In the usual cost
model (a message costs a latency a plus its bytes times b), doubling costs log2(n) (a + N b) and the
ring 2(n-1) a + 2(n-1)/n N b: doubling sends fewer messages, the ring fewer bytes. With MPI's few
microseconds of latency and several GB/s, the two meet at some hundreds of KiB for n = 4..8 (measured
by benchmarks/collectives.py on 2 cores: doubling won up to about 1 MiB at 4 ranks, e.g. 64 KiB in
1.2 ms against the ring's 3.5 ms). Every rank sees the same size, so all pick the same algorithm."""


class ProcessGroup:
    """The ranks of one transport, and the collectives among them.

    ``rank``/``size`` are this rank's number and the group's size; ``trace`` records every call
    (pass one to share it, e.g. between a group and its sub-groups); ``threshold_bytes`` is where
    ``all_reduce(algorithm="auto")`` switches from recursive doubling to the ring; ``segment_bytes``
    is the ring's segment size; ``check_calls`` compares every collective's fingerprint with the ring
    neighbours first, ``debug`` with every rank.
    """

    def __init__(self, transport, *, backend: str = "ring", trace: Trace | None = None, debug: bool = False,
                 threshold_bytes: int = DEFAULT_THRESHOLD_BYTES, name: str = "world",
                 segment_bytes: int = ring.SEGMENT_BYTES, flight_recorder=None, check_calls: bool = True):
        if backend not in ("ring", "mpi", "nccl"):
            raise ValueError(f"backend must be 'ring', 'mpi' or 'nccl', got {backend!r}")
        self.transport = transport
        self.rank, self.size = transport.rank, transport.size
        self.backend, self.debug, self.name, self.check_calls = backend, debug, name, check_calls
        self.trace = trace if trace is not None else Trace(transport.rank)
        self.threshold_bytes, self.segment_bytes = threshold_bytes, segment_bytes
        self.flight_recorder = flight_recorder  # dumps the trace's last calls when one times out
        self.seq = 0  # collectives called so far: the same on every rank
        self.p2p_seq = 0  # point-to-point calls so far: differs between ranks
        self._splits = 0
        self._workspace = Workspace()
        self._census_sends = []  # a census's unanswered sends: their buffers must outlive them
        self._native = None  # MPI's or NCCL's own collectives (backends "mpi", "nccl")
        self._stream = CommStream(name)  # where async_op collectives queue, in issue order
        if backend == "mpi":
            from minidist.comm.native import MPICollectives  # only here: `import minidist` never imports mpi4py
            self._native = MPICollectives(transport)
        elif backend == "nccl":  # collective: rank 0's NCCL id is broadcast over the transport
            from minidist.comm.nccl import NCCLCollectives
            self._native = NCCLCollectives(transport)

    def __repr__(self) -> str:
        return f"ProcessGroup(name={self.name!r}, rank={self.rank}, size={self.size}, backend={self.backend!r})"

    # ---- collectives -------------------------------------------------------------------------------

    def all_reduce(self, x, op: str = "sum", algorithm: str = "auto", async_op: bool = False):
        """Every rank's ``x`` becomes the elementwise ``op`` over all ranks, in place; returns ``x``
        (with ``async_op``: a Work whose ``wait()`` returns ``x``; leave ``x`` alone until then).

        ``algorithm``: "auto" (doubling below ``threshold_bytes``, else the ring; MPI's or NCCL's own
        on backend "mpi" or "nccl"), "ring" or "doubling"."""
        self._check_array(x, "x")
        self._check_op(op)
        if algorithm not in ("auto", "ring", "doubling"):
            raise ValueError(f"rank {self.rank}: algorithm must be 'auto', 'ring' or 'doubling', got {algorithm!r}")
        if algorithm == "auto":
            algorithm = self._algorithm("doubling" if x.nbytes < self.threshold_bytes else "ring", x)
        flat = x.reshape(-1)  # (N,) view

        def run():
            with self._collective("all_reduce", algorithm, x.nbytes, op=op, dtype=x.dtype, count=x.size):
                if algorithm == "ring":
                    ring.all_reduce(self.transport, flat, _summed(op), segment_bytes=self.segment_bytes,
                                    workspace=self._workspace)
                elif algorithm == "doubling":
                    doubling.all_reduce(self.transport, flat, _summed(op), workspace=self._workspace)
                else:  # the backend's own
                    self._native_for(x).all_reduce(flat, _summed(op))
                if op == "avg":
                    divide_by_size(flat, self.size)
            return x
        return self._launch(run, "all_reduce", async_op, x)

    def reduce_scatter(self, x, op: str = "sum", out=None, async_op: bool = False):
        """Reduce ``x`` over all ranks and return this rank's part along axis 0, cut by
        ``numpy.array_split``: shape ``(counts[rank],) + x.shape[1:]``. ``x`` is not modified.
        With ``async_op``: a Work whose ``wait()`` returns that part; ``x`` is read when the
        collective runs, so leave it alone until then."""
        self._check_array(x, "x", writeable=False, min_ndim=1)
        self._check_op(op)
        rows = split_counts(x.shape[0], self.size)  # rows of x per rank
        row = math.prod(x.shape[1:])  # elements per row
        out = self._out(out, (rows[self.rank],) + x.shape[1:], x.dtype, like=x)

        def run():
            native = self._native_for(x)
            with self._collective("reduce_scatter", self._algorithm("ring", x), x.nbytes, op=op, dtype=x.dtype,
                                  count=x.size):
                scratch = self._workspace.get("reduce_scatter_input", x.dtype, x.size, like=x)  # the algorithm clobbers it
                scratch[...] = x.reshape(-1)
                counts = [c * row for c in rows]
                if native:
                    native.reduce_scatter(scratch, counts, _summed(op), out.reshape(-1))
                else:
                    ring.reduce_scatter(self.transport, scratch, counts, _summed(op), out.reshape(-1),
                                        segment_bytes=self.segment_bytes, workspace=self._workspace)
                if op == "avg":
                    divide_by_size(out, self.size)
            return out
        return self._launch(run, "reduce_scatter", async_op, x)

    def all_gather(self, shard, count: int | None = None, out=None, async_op: bool = False):
        """Every rank's ``shard`` concatenated along axis 0, in rank order, on every rank.

        With ``count`` (the total length along axis 0), rank r's shard must have the r-th length of
        ``numpy.array_split`` of ``count``; without it, all shards have this rank's length. ``shard``
        may be a view of ``out`` at its own place (in-place all-gather). With ``async_op``: a Work
        whose ``wait()`` returns the gathered array."""
        self._check_array(shard, "shard", writeable=False, min_ndim=1)
        if count is None:
            rows = [shard.shape[0]] * self.size
        else:
            if not isinstance(count, (int, np.integer)) or count < 0:
                raise ValueError(f"rank {self.rank}: count must be a non-negative int, got {count!r}")
            rows = split_counts(int(count), self.size)
            if shard.shape[0] != rows[self.rank]:
                raise ValueError(f"rank {self.rank}: with count={count} over {self.size} ranks the shard must "
                                 f"have {rows[self.rank]} rows (numpy.array_split), got {shard.shape[0]}")
        row = math.prod(shard.shape[1:])
        out = self._out(out, (sum(rows),) + shard.shape[1:], shard.dtype, like=shard)

        def run():
            native = self._native_for(shard)
            with self._collective("all_gather", self._algorithm("ring", shard), out.nbytes, dtype=shard.dtype,
                                  count=out.size):
                counts = [c * row for c in rows]
                if native:
                    native.all_gather(shard.reshape(-1), counts, out.reshape(-1))
                else:
                    ring.all_gather(self.transport, shard.reshape(-1), counts, out.reshape(-1))
            return out
        return self._launch(run, "all_gather", async_op, shard)

    def broadcast(self, x, src: int = 0):
        """Every rank's ``x`` becomes ``src``'s ``x``, in place; returns ``x``."""
        self._check_array(x, "x")
        self._check_rank(src, "src")
        self._stream.synchronize()
        native = self._native_for(x)
        with self._collective("broadcast", self._algorithm("binomial", x), x.nbytes, dtype=x.dtype, count=x.size,
                              root=src):
            if native:
                native.broadcast(x.reshape(-1), src)
            else:
                rooted.broadcast(self.transport, x.reshape(-1), src)
        return x

    def reduce(self, x, dst: int = 0, op: str = "sum"):
        """``dst``'s ``x`` becomes the elementwise ``op`` over all ranks; other ranks' ``x`` is
        unchanged. Returns ``x``."""
        self._check_array(x, "x")
        self._check_op(op)
        self._check_rank(dst, "dst")
        self._stream.synchronize()
        flat = x.reshape(-1)
        native = self._native_for(x)
        with self._collective("reduce", self._algorithm("binomial", x), x.nbytes, op=op, dtype=x.dtype,
                              count=x.size, root=dst):
            if native:
                native.reduce(flat, dst, _summed(op))
            else:
                rooted.reduce(self.transport, flat, dst, _summed(op), workspace=self._workspace)
            if op == "avg" and self.rank == dst:
                divide_by_size(flat, self.size)
        return x

    def barrier(self) -> None:
        """Return only once every rank of the group has called ``barrier``."""
        self._stream.synchronize()
        with self._collective("barrier", self.backend if self._native else "binomial", 0):
            if self._native:
                self._native.barrier()
            else:
                rooted.barrier(self.transport)

    def gather_bytes(self, data: bytes, dst: int = 0) -> list[bytes] | None:
        """Every rank's ``data`` (any length, 0 included) on rank ``dst``, as a list in rank order;
        None on the other ranks. For results whose size differs between ranks (JSON, text, raw array
        bytes) without pickling.

        What it sends: each rank other than ``dst`` sends ``dst`` its length (one int64), then, when
        not empty, the bytes as one uint8 buffer, point-to-point with the reserved collective tag
        ``TAG_GATHER_BYTES``; ``dst`` receives them in rank order."""
        if not isinstance(data, (bytes, bytearray)):
            raise ValueError(f"rank {self.rank}: data must be bytes, got {type(data).__name__}")
        self._check_rank(dst, "dst")
        self._stream.synchronize()
        with self._collective("gather_bytes", "direct", len(data), root=dst):
            if self.rank != dst:
                self.transport.send(np.array([len(data)], dtype=np.int64), dst, TAG_GATHER_BYTES)
                if data:
                    self.transport.send(np.frombuffer(data, dtype=np.uint8), dst, TAG_GATHER_BYTES)
                return None
            gathered = []
            for src in range(self.size):
                if src == dst:
                    gathered.append(bytes(data))
                    continue
                size = np.empty(1, dtype=np.int64)
                self.transport.recv(size, src, TAG_GATHER_BYTES)
                buf = np.empty(int(size[0]), dtype=np.uint8)  # (length,)
                if buf.size:
                    self.transport.recv(buf, src, TAG_GATHER_BYTES)
                gathered.append(buf.tobytes())
            return gathered

    def split(self, color: int, key: int | None = None, name: str | None = None) -> "ProcessGroup | None":
        """Collective: ranks passing the same ``color`` form a new group, ranked by (``key``, rank);
        ``key`` defaults to the rank. A negative color joins none and gets ``None``. The new group
        shares this group's backend, settings and trace."""
        key = self.rank if key is None else key
        for what, v in (("color", color), ("key", key)):
            if not isinstance(v, (int, np.integer)):
                raise ValueError(f"rank {self.rank}: {what} must be an int, got {v!r}")
        self._splits += 1
        self._stream.synchronize()
        with self._collective("split", "allgather", 0):
            sub = self.transport.split(int(color), int(key))
        if sub is None:
            return None
        return ProcessGroup(sub, backend=self.backend, trace=self.trace, debug=self.debug,
                            threshold_bytes=self.threshold_bytes, segment_bytes=self.segment_bytes,
                            check_calls=self.check_calls,
                            flight_recorder=self.flight_recorder, name=name if name is not None else f"{self.name}/split{self._splits}.{color}")

    # ---- point to point -----------------------------------------------------------------------------

    def send(self, x, dst: int, tag: int = 0) -> None:
        """Send ``x`` to rank ``dst``; returns once ``x`` may be reused."""
        self._check_p2p(x, dst, tag, writeable=False)
        with self._p2p("send", dst, x.nbytes):
            self._links_for(x).send(x, dst, tag)

    def recv(self, x, src: int, tag: int = 0):
        """Receive ``src``'s message (same dtype and size as ``x``) into ``x``; returns ``x``."""
        self._check_p2p(x, src, tag)
        with self._p2p("recv", src, x.nbytes):
            self._links_for(x).recv(x, src, tag)
        return x

    def isend(self, x, dst: int, tag: int = 0) -> Request:
        """Start sending ``x`` to ``dst``; don't touch ``x`` until the request's ``wait()`` returns.
        (The trace times the posting; the transfer overlaps whatever runs until ``wait``.)"""
        self._check_p2p(x, dst, tag, writeable=False)
        with self._p2p("isend", dst, x.nbytes) as seq:
            return _GroupRequest(self._links_for(x).isend(x, dst, tag), self, "isend", seq)

    def irecv(self, x, src: int, tag: int = 0) -> Request:
        """Start receiving ``src``'s message into ``x``; it is there once ``wait()`` returns."""
        self._check_p2p(x, src, tag)
        with self._p2p("irecv", src, x.nbytes) as seq:
            return _GroupRequest(self._links_for(x).irecv(x, src, tag), self, "irecv", seq)

    def sendrecv(self, sendbuf, dst: int, recvbuf, src: int, tag: int = 0):
        """Send ``sendbuf`` to ``dst`` while receiving ``recvbuf`` from ``src`` (deadlock-free even
        when two ranks exchange with each other). Returns ``recvbuf``."""
        self._check_p2p(sendbuf, dst, tag, writeable=False)
        self._check_p2p(recvbuf, src, tag, like=sendbuf)
        with self._p2p("sendrecv", dst, sendbuf.nbytes + recvbuf.nbytes):
            self._links_for(sendbuf).sendrecv(sendbuf, dst, recvbuf, src, tag)
        return recvbuf

    # ---- bookkeeping ------------------------------------------------------------------------------

    def _launch(self, run, name: str, async_op: bool, x):
        """Run a checked collective now, after any queued ones, or (``async_op``) queue it on the
        group's communication thread and return its Work. A GPU array's kernels must run on its own
        GPU, so the communication thread makes that GPU current for the call."""
        if async_op:
            def on_its_gpu():
                with device_of(x):
                    return run()
            return self._stream.submit(on_its_gpu, f"{name} on group '{self.name}'")
        self._stream.synchronize()
        return run()

    def _native_for(self, x):
        """The backend's own collectives for ``x``, or None for the hand-written ones: backend "nccl"
        takes GPU arrays only, so host arrays on an NCCL group go over the transport."""
        if self.backend == "nccl" and not is_cupy(x):
            return None
        return self._native

    def _links_for(self, x):
        """Where a point-to-point message with buffer ``x`` goes: NCCL for a GPU buffer on backend
        "nccl", else the transport."""
        return self._native.p2p if self.backend == "nccl" and is_cupy(x) else self.transport

    def _algorithm(self, hand_written: str, x) -> str:
        """The name the trace records: the backend's ("mpi", "nccl") when it runs the call."""
        return self.backend if self._native_for(x) else hand_written

    @contextmanager
    def _collective(self, name, algorithm, nbytes, *, op=None, dtype=None, count=0, root=-1):
        """Number a collective, record it in the trace, check that the ranks called the same one
        (``fingerprint.py``: with the ring neighbours, or in debug mode with everyone), and report a
        peer that never answers as CommTimeoutError naming the ranks that never arrived."""
        self.seq += 1
        with self._timeouts(name, self.seq, collective=True), self.trace.record(
                name, group=self.name, algorithm=algorithm, nbytes=nbytes, seq=self.seq):
            if self.debug or self.check_calls:
                check = check_everyone if self.debug else check_neighbours
                check(self.transport, fingerprint(name, op, dtype, count, root, self.seq), self.name)
            yield

    @contextmanager
    def _p2p(self, name, peer, nbytes):
        """Number and record a point-to-point call; yields its number."""
        self.p2p_seq += 1
        with self._timeouts(name, self.p2p_seq), self.trace.record(
                name, group=self.name, nbytes=nbytes, seq=self.p2p_seq, peer=peer, kind="p2p"):
            yield self.p2p_seq

    @contextmanager
    def _timeouts(self, name, seq, collective=False):
        """Turn a transport's PeerTimeout into CommTimeoutError; for a collective, first take a census
        of the group (``census.py``, at most ``census.GRACE_SECONDS``) to name the ranks that never
        arrived. The flight recorder dumps the error, census included."""
        try:
            yield
        except PeerTimeout as e:
            found, missing = "", []
            if collective and self.size > 1:
                grace = min(census.GRACE_SECONDS, self.transport.timeout)
                heard, pending = census.take(self.transport, seq, name, grace)
                self._census_sends += pending
                found, missing = census.summary(self.rank, self.size, seq, name, heard, grace)
            error = CommTimeoutError(name, seq, self.rank, e.peer, e.waited, self.name, found, missing)
            if self.flight_recorder is not None:
                self.flight_recorder.dump(self.trace, error)
            raise error from e

    def _check_array(self, x, what, *, writeable=True, min_ndim=0, any_dtype=False, like=None) -> None:
        """``x`` is a NumPy or CuPy array the collectives can take (``like``: in the same memory as
        ``like``, host or GPU)."""
        if not isinstance(x, np.ndarray) and not is_cupy(x):
            raise ValueError(f"rank {self.rank}: {what} must be a numpy or cupy array, got {type(x).__name__}")
        if self.backend == "mpi" and is_cupy(x) and not getattr(self.transport, "cuda_aware", False):
            raise ValueError(f"rank {self.rank}: backend 'mpi' hands {what} to MPI as it is, and this MPI is "
                             f"not CUDA-aware: use backend 'ring' (it stages GPU buffers through pinned host "
                             f"memory) or 'nccl'")
        if like is not None and is_cupy(x) != is_cupy(like):
            where = {True: "GPU (cupy)", False: "host (numpy)"}
            raise ValueError(f"rank {self.rank}: {what} is in {where[is_cupy(x)]} memory but the input is in "
                             f"{where[is_cupy(like)]} memory; keep both on one side")
        if not any_dtype and x.dtype not in DTYPES:
            raise ValueError(f"rank {self.rank}: {what} has dtype {x.dtype}; collectives take "
                             f"{', '.join(map(str, DTYPES))}")
        if not x.flags.c_contiguous:
            raise ValueError(f"rank {self.rank}: {what} must be C-contiguous (see numpy.ascontiguousarray)")
        if writeable and not is_cupy(x) and not x.flags.writeable:
            raise ValueError(f"rank {self.rank}: {what} must be writeable")
        if x.ndim < min_ndim:
            raise ValueError(f"rank {self.rank}: {what} needs an axis 0 to split along, got shape {x.shape}")

    def _check_op(self, op) -> None:
        if op not in GROUP_OPS:
            raise ValueError(f"rank {self.rank}: op must be one of {', '.join(GROUP_OPS)}, got {op!r}")

    def _check_rank(self, r, what) -> None:
        if not isinstance(r, (int, np.integer)) or not 0 <= r < self.size:
            raise ValueError(f"rank {self.rank}: {what} must be a rank of group '{self.name}' "
                             f"(0..{self.size - 1}), got {r!r}")

    def _check_p2p(self, x, peer, tag, *, writeable=True, like=None) -> None:
        self._check_array(x, "buffer", writeable=writeable, any_dtype=True, like=like)
        self._check_rank(peer, "peer")
        if not isinstance(tag, (int, np.integer)) or not 0 <= tag < COLLECTIVE_TAG_BASE:
            raise ValueError(f"rank {self.rank}: tag must be an int in 0..{COLLECTIVE_TAG_BASE - 1} "
                             f"(higher tags belong to collectives), got {tag!r}")

    def _out(self, out, shape, dtype, like):
        """``out`` checked to hold ``shape`` of ``dtype`` in the memory of ``like`` (host or GPU), or
        a new such array if it is None."""
        if out is None:
            return get_array_module(like).empty(shape, dtype)
        self._check_array(out, "out", like=like)
        if out.dtype != dtype or out.size != math.prod(shape):
            raise ValueError(f"rank {self.rank}: out must hold {math.prod(shape)} x {np.dtype(dtype)} "
                             f"(shape {shape}), got {out.size} x {out.dtype}")
        return out


class _GroupRequest(Request):
    """A transport request whose ``wait`` reports a lost peer as CommTimeoutError, like the group."""

    def __init__(self, request: Request, group: ProcessGroup, op: str, seq: int):
        self.request, self.group, self.op, self.seq = request, group, op, seq

    def test(self) -> bool:
        return self.request.test()

    def wait(self) -> None:
        with self.group._timeouts(self.op, self.seq):
            self.request.wait()


def _summed(op: str) -> str:
    """The reduction the algorithms run: "avg" is a "sum" the group divides afterwards."""
    return "sum" if op == "avg" else op

