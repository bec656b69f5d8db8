"""ProcessGroup: the collectives a training script calls, on any transport.

Every collective takes one path: it checks its arguments on the spot (``checks.py``: a clear
``ValueError`` before anything is sent) and picks its algorithm, then ``_dispatch`` numbers it
(``seq``, the same on every rank), checks its fingerprint, records it in the trace and runs it, now
or queued. Before each collective every rank compares what it was asked to do (collective, reduce
op, dtype, count, root, number) with its ring neighbours and raises :class:`CollectiveMismatchError`
where they disagree, instead of hanging or mixing up data (``fingerprint.py``; ``check_calls=False``
skips it, ``debug=True`` compares with every rank instead, so that every rank raises). A peer that
never answers surfaces as :class:`CommTimeoutError` naming the operation, its number, this rank and
the peer, and, from a census of the group (``census.py``), the rank that never arrived. Message tags:
``tags.py``.

``async_op=True`` (all_reduce, reduce_scatter, all_gather, all_to_all) queues the collective on the
group's communication thread and returns a :class:`~minidist.comm.work.Work` at once (see
``work.py``): queued collectives run in issue order, and a blocking collective waits for them first.

``backend="ring"`` runs the hand-written algorithms (``ring``, ``doubling``, ``halving``, ``rooted``,
``alltoall``) over the transport, chosen by size and group size (``_all_reduce_algorithm``,
``_halving``); ``backend="mpi"`` hands the collectives to MPI's own (``native``),
which needs an ``MPITransport``; ``backend="nccl"`` hands collectives and point-to-point calls on GPU
(CuPy) arrays to NCCL (``nccl``), one communicator per group, while host (NumPy) arrays, such as a
flag or a gathered log line, still go over the transport with the hand-written algorithms.
``algorithm="ring"``, ``"doubling"`` or ``"halving"`` (Rabenseifner's) forces a hand-written
all-reduce on any.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import numpy as np

from minidist.comm import alltoall, census, checks, doubling, halving, ring, rooted
from minidist.comm.fingerprint import check_call
from minidist.comm.ops import Workspace, averages_first, divide_by_size, split_counts
from minidist.comm.tags import TAG_GATHER_BYTES
from minidist.comm.trace import Trace
from minidist.comm.transport import CollectiveMismatchError, CommTimeoutError, PeerTimeout, Request
from minidist.comm.work import CommStream
from minidist.device import device_of, is_cupy

DEFAULT_THRESHOLD_BYTES = 256 * 1024
"""All-reduces smaller than this use recursive doubling. In the usual cost model (a message costs a
latency a plus its bytes times b), doubling costs log2(n) (a + N b), Rabenseifner's about
2 log2(n) a + 2(n-1)/n N b and the ring 2(n-1) a + 2(n-1)/n N b: doubling sends fewest messages,
the other two fewest bytes. Measured by ``benchmarks/collectives.py --algorithms`` on 2 cores (2 and
4 ranks): doubling is fastest up to 128 KiB, level with Rabenseifner's at 256 KiB, and slower from
512 KiB (4 ranks, 1 MiB: 522 us against 432 us). Every rank sees the same size, so all pick the same
algorithm."""

DEFAULT_RING_FROM_BYTES = 8 * 1024 * 1024
"""On a power-of-two group, all-reduces from ``threshold_bytes`` up to this use Rabenseifner's
algorithm (``halving.py``), and reduce-scatters and all-gathers below it recursive halving and
doubling (log2(n) rounds); the ring from here on, and on other groups at every size. Measured on 2
cores (``--algorithms``): Rabenseifner's all-reduce beat the ring by 18-35% from 256 KiB to 2 MiB at
4 ranks (3-4 rounds against 6), was level at 4 MiB and lost by 5-30% from 8 MiB, at 2 and 4 ranks
(probably because its unsegmented halves, up to half the buffer, no longer fit in the cache, where
the ring streams 1 MiB segments)."""


class ProcessGroup:
    """The ranks of one transport, and the collectives among them.

    ``rank``/``size`` are this rank's number and the group's size; ``trace`` records every call
    (pass one to share it, e.g. between a group and its sub-groups); ``threshold_bytes`` is where
    ``all_reduce(algorithm="auto")`` switches from recursive doubling to the next algorithm and
    ``ring_from_bytes`` where the ring takes over (see ``_all_reduce_algorithm``); ``segment_bytes``
    is the ring's segment size; ``scattered_below_bytes`` is the mean chunk size below which
    ``all_to_all`` posts all its messages at once rather than in pairwise steps; ``check_calls``
    compares every collective's fingerprint with the ring neighbours first, ``debug`` with every rank.
    """

    def __init__(self, transport, *, backend: str = "ring", trace: Trace | None = None, debug: bool = False,
                 threshold_bytes: int = DEFAULT_THRESHOLD_BYTES, name: str = "world",
                 segment_bytes: int = ring.SEGMENT_BYTES, flight_recorder=None, check_calls: bool = True,
                 scattered_below_bytes: int = alltoall.SCATTERED_BELOW_BYTES,
                 ring_from_bytes: int = DEFAULT_RING_FROM_BYTES):
        if backend not in ("ring", "mpi", "nccl"):
            raise ValueError(f"backend must be 'ring', 'mpi' or 'nccl', got {backend!r}")
        self.transport = transport
        self.rank, self.size = transport.rank, transport.size
        self.backend, self.debug, self.name, self.check_calls = backend, debug, name, check_calls
        self.trace = trace if trace is not None else Trace(transport.rank)
        self.threshold_bytes, self.segment_bytes = threshold_bytes, segment_bytes
        self.ring_from_bytes = ring_from_bytes
        self.scattered_below_bytes = scattered_below_bytes
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

    def all_reduce(self, x, op: str = "sum", algorithm: str = "auto", async_op: bool = False, *, label: str = ""):
        """Every rank's ``x`` becomes the elementwise ``op`` over all ranks, in place; returns ``x``
        (with ``async_op``: a Work whose ``wait()`` returns ``x``; leave ``x`` alone until then).

        ``algorithm``: "auto" (by size and group size, ``_all_reduce_algorithm``; MPI's or NCCL's own
        on backend "mpi" or "nccl"), "ring", "doubling" or "halving"."""
        checks.check_array(self, x, "x")
        checks.check_op(self, op)
        checks.check_algorithm(self, algorithm)
        if algorithm == "auto":
            algorithm = self._algorithm(self._all_reduce_algorithm(x.nbytes), x)
        flat = x.reshape(-1)  # (N,) view

        first = op == "avg" and averages_first(x.dtype)  # float16: divide, then sum

        def run():
            if first:
                divide_by_size(flat, self.size)
            if algorithm == "ring":
                ring.all_reduce(self.transport, flat, _summed(op), segment_bytes=self.segment_bytes,
                                workspace=self._workspace)
            elif algorithm == "doubling":
                doubling.all_reduce(self.transport, flat, _summed(op), workspace=self._workspace)
            elif algorithm == "halving":
                halving.all_reduce(self.transport, flat, _summed(op), workspace=self._workspace)
            else:  # the backend's own
                self._native_for(x).all_reduce(flat, _summed(op))
            if op == "avg" and not first:
                divide_by_size(flat, self.size)
            return x
        return self._dispatch("all_reduce", run, algorithm, x.nbytes, async_op=async_op, like=x, op=op,
                              dtype=x.dtype, count=x.size, label=label)

    def reduce_scatter(self, x, op: str = "sum", out=None, async_op: bool = False, *, label: str = ""):
        """Reduce ``x`` over all ranks and return this rank's part along axis 0, cut by
        ``numpy.array_split``: shape ``(counts[rank],) + x.shape[1:]``. ``x`` is not modified.
        With ``async_op``: a Work whose ``wait()`` returns that part; ``x`` is read when the
        collective runs, so leave it alone until then."""
        checks.check_array(self, x, "x", writeable=False, min_ndim=1)
        checks.check_op(self, op)
        rows = split_counts(x.shape[0], self.size)  # rows of x per rank
        counts = [c * math.prod(x.shape[1:]) for c in rows]  # elements per rank
        out = checks.out_array(self, out, (rows[self.rank],) + x.shape[1:], x.dtype, like=x)
        native = self._native_for(x)
        algorithm = self._algorithm("halving" if self._halving(x.nbytes) else "ring", x)

        first = op == "avg" and averages_first(x.dtype)  # float16: divide, then sum

        def run():
            scratch = self._workspace.get("reduce_scatter_input", x.dtype, x.size, like=x)  # the algorithm clobbers it
            scratch[...] = x.reshape(-1)
            if first:
                divide_by_size(scratch, self.size)
            if native:
                native.reduce_scatter(scratch, counts, _summed(op), out.reshape(-1))
            elif algorithm == "halving":
                halving.reduce_scatter(self.transport, scratch, counts, _summed(op), out.reshape(-1),
                                       workspace=self._workspace)
            else:
                ring.reduce_scatter(self.transport, scratch, counts, _summed(op), out.reshape(-1),
                                    segment_bytes=self.segment_bytes, workspace=self._workspace)
            if op == "avg" and not first:
                divide_by_size(out, self.size)
            return out
        return self._dispatch("reduce_scatter", run, algorithm, x.nbytes, async_op=async_op,
                              like=x, op=op, dtype=x.dtype, count=x.size, label=label)

    def all_gather(self, shard, count: int | None = None, out=None, async_op: bool = False, *, label: str = ""):
        """Every rank's ``shard`` concatenated along axis 0, in rank order, on every rank.

        With ``count`` (the total length along axis 0), rank r's shard must have the r-th length of
        ``numpy.array_split`` of ``count``; without it, all shards have this rank's length. ``shard``
        may be a view of ``out`` at its own place (in-place all-gather). With ``async_op``: a Work
        whose ``wait()`` returns the gathered array."""
        checks.check_array(self, shard, "shard", writeable=False, min_ndim=1)
        rows = checks.gathered_rows(self, shard, count)
        counts = [c * math.prod(shard.shape[1:]) for c in rows]  # elements per rank
        out = checks.out_array(self, out, (sum(rows),) + shard.shape[1:], shard.dtype, like=shard)
        native = self._native_for(shard)
        algorithm = self._algorithm("doubling" if self._halving(out.nbytes) else "ring", shard)

        def run():
            if native:
                native.all_gather(shard.reshape(-1), counts, out.reshape(-1))
            elif algorithm == "doubling":
                doubling.all_gather(self.transport, shard.reshape(-1), counts, out.reshape(-1))
            else:
                ring.all_gather(self.transport, shard.reshape(-1), counts, out.reshape(-1))
            return out
        return self._dispatch("all_gather", run, algorithm, out.nbytes, async_op=async_op,
                              like=shard, dtype=shard.dtype, count=out.size, label=label)

    def all_to_all(self, x, send_counts=None, recv_counts=None, out=None, async_op: bool = False, *,
                   label: str = ""):
        """Rank r sends chunk j of ``x`` (along axis 0) to rank j and returns the chunks it receives
        from ranks 0..n-1, concatenated along axis 0 in rank order (torch.distributed's
        ``all_to_all_single``, with counts in rows). The trailing axes and the dtype must be the same
        on every rank; ``x`` is not modified.

        ``send_counts``: the rows of ``x`` for each rank, n non-negative ints summing to
        ``x.shape[0]`` (zeros allowed); None cuts ``x`` into n equal chunks (``x.shape[0]`` must be
        divisible by n). ``recv_counts``: the rows this rank receives from each rank. The ranks pass
        their counts the same way (the fingerprint checks it), one of

        - neither: equal chunks, and every rank's ``x`` has as many rows (checked too);
        - ``recv_counts`` (and ``send_counts`` or not): given;
        - ``send_counts`` alone: learned, the peers say what they send (below).

        ``out``: where the result goes (the right dtype and size, not overlapping ``x``). With
        ``async_op``: a Work whose ``wait()`` returns the result.

        What it sends: this rank's chunk j to rank j, one message per peer (``alltoall.py``: n-1
        sendrecv steps, or all at once when its mean chunk is under ``scattered_below_bytes``;
        ``MPI_Alltoall(v)`` on backend "mpi"; one NCCL group of sends and receives on "nccl"); its own
        chunk is a local copy. (n-1)/n of ``x`` crosses the links. Before the chunks, a small
        all-to-all of the counts (``alltoall.exchange_counts``: 2 int64 per pair of ranks, over the
        host transport) when the counts are

        - learned: it is how each rank learns what it will receive (``out`` is sized, and checked,
          only then);
        - given, on backends "mpi" and "nccl" with ``check_calls`` (the default): what each rank
          expects is compared with what its peers send before the library gets the counts, since
          MPI and NCCL do not notice a message shorter than its receive. Both ranks of a pair that
          disagree raise CollectiveMismatchError. ``check_calls=False`` trusts the counts, as MPI
          and NCCL do;
        - given, in ``debug`` mode, on every backend (the same check).

        On backend "ring" each message's size is checked against its receive buffer by the
        transport, so a peer that sends other than given ``recv_counts`` say fails there (a
        ValueError naming it) with no exchange needed. As for every collective, the fingerprint
        checked first covers the dtype and the elements per row (as its ``count``)."""
        checks.check_array(self, x, "x", writeable=False, min_ndim=1)
        send_rows, recv_rows = checks.all_to_all_rows(self, x, send_counts, recv_counts)
        row = math.prod(x.shape[1:])  # elements per row
        if out is not None:
            checks.check_array(self, out, "out", like=x)
            checks.apart(self, out, x)
        if recv_rows is not None:  # sized now; else once the peers have said (below)
            out = checks.out_array(self, out, (sum(recv_rows),) + x.shape[1:], x.dtype, like=x)
        native = self._native_for(x)
        if send_counts is None and recv_counts is None:
            how = x.shape[0]  # equal chunks: every rank must have as many rows (the fingerprint checks)
        else:
            how = "learned" if recv_rows is None else "given"
        exchange = how == "learned" or how == "given" and (self.debug or self.check_calls and native is not None)
        algorithm = alltoall.pick(x.nbytes, self.size, self.scattered_below_bytes)  # by this rank's chunk size

        def run():
            result, rows = out, recv_rows
            if exchange:
                learned, problems = alltoall.exchange_counts(self.transport, send_rows, recv_rows)
                if problems:
                    raise CollectiveMismatchError(f"all_to_all #{self.seq} on group '{self.name}': "
                                                  + "; ".join(problems))
                if rows is None:
                    rows = learned
                    result = checks.out_array(self, out, (sum(rows),) + x.shape[1:], x.dtype, like=x)
            sent, received = [c * row for c in send_rows], [c * row for c in rows]  # elements per rank
            if native:
                native.all_to_all(x.reshape(-1), sent, result.reshape(-1), received, equal=isinstance(how, int))
            else:
                alltoall.all_to_all(self.transport, x.reshape(-1), sent, result.reshape(-1), received,
                                    algorithm=algorithm)
            return result
        return self._dispatch("all_to_all", run, self._algorithm(algorithm, x), x.nbytes, async_op=async_op,
                              like=x, dtype=x.dtype, count=row, recv_counts=how, label=label)

    def broadcast(self, x, src: int = 0, *, label: str = ""):
        """Every rank's ``x`` becomes ``src``'s ``x``, in place; returns ``x``."""
        checks.check_array(self, x, "x")
        checks.check_rank(self, src, "src")
        native = self._native_for(x)

        def run():
            if native:
                native.broadcast(x.reshape(-1), src)
            else:
                rooted.broadcast(self.transport, x.reshape(-1), src)
            return x
        return self._dispatch("broadcast", run, self._algorithm("binomial", x), x.nbytes, dtype=x.dtype,
                              count=x.size, root=src, label=label)

    def reduce(self, x, dst: int = 0, op: str = "sum", *, label: str = ""):
        """``dst``'s ``x`` becomes the elementwise ``op`` over all ranks; other ranks' ``x`` is
        unchanged. Returns ``x``."""
        checks.check_array(self, x, "x")
        checks.check_op(self, op)
        checks.check_rank(self, dst, "dst")
        flat = x.reshape(-1)
        native = self._native_for(x)

        def run():
            if native:
                native.reduce(flat, dst, _summed(op))
            else:
                rooted.reduce(self.transport, flat, dst, _summed(op), workspace=self._workspace)
            if op == "avg" and self.rank == dst:
                divide_by_size(flat, self.size)
            return x
        return self._dispatch("reduce", run, self._algorithm("binomial", x), x.nbytes, op=op, dtype=x.dtype,
                              count=x.size, root=dst, label=label)

    def barrier(self, *, label: str = "") -> None:
        """Return only once every rank of the group has called ``barrier``."""
        run = self._native.barrier if self._native else partial(rooted.barrier, self.transport)
        self._dispatch("barrier", run, self.backend if self._native else "binomial", 0, label=label)

    def gather_bytes(self, data: bytes, dst: int = 0, *, label: str = "") -> list[bytes] | None:
        """Every rank's ``data`` (any length, 0 included) on rank ``dst``, as a list in rank order;
        None on the other ranks. For results whose size differs between ranks (JSON, text, raw array
        bytes) without pickling.

        What it sends: each rank other than ``dst`` sends ``dst`` its length (one int64), then, when
        not empty, the bytes as one uint8 buffer, point-to-point with the reserved collective tag
        ``TAG_GATHER_BYTES``; ``dst`` receives them in rank order."""
        checks.check_bytes(self, data)
        checks.check_rank(self, dst, "dst")

        def run():
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
        return self._dispatch("gather_bytes", run, "direct", len(data), root=dst, label=label)

    def split(self, color: int, key: int | None = None, name: str | None = None) -> "ProcessGroup | None":
        """Collective: ranks passing the same ``color`` form a new group, ranked by (``key``, rank);
        ``key`` defaults to the rank. A negative color joins none and gets ``None``. The new group
        shares this group's backend, settings and trace."""
        key = self.rank if key is None else key
        checks.check_int(self, color, "color")
        checks.check_int(self, key, "key")
        self._splits += 1
        sub = self._dispatch("split", partial(self.transport.split, int(color), int(key)), "allgather", 0,
                             label="setup: split the group")
        if sub is None:
            return None
        return ProcessGroup(sub, backend=self.backend, trace=self.trace, debug=self.debug,
                            threshold_bytes=self.threshold_bytes, segment_bytes=self.segment_bytes,
                            ring_from_bytes=self.ring_from_bytes,
                            check_calls=self.check_calls, scattered_below_bytes=self.scattered_below_bytes,
                            flight_recorder=self.flight_recorder, name=name if name is not None else f"{self.name}/split{self._splits}.{color}")

    # ---- point to point -----------------------------------------------------------------------------

    def send(self, x, dst: int, tag: int = 0, *, label: str = "") -> None:
        """Send ``x`` to rank ``dst``; returns once ``x`` may be reused."""
        checks.check_p2p(self, x, dst, tag, writeable=False)
        with self._p2p("send", dst, x.nbytes, label):
            self._links_for(x).send(x, dst, tag)

    def recv(self, x, src: int, tag: int = 0, *, label: str = ""):
        """Receive ``src``'s message (same dtype and size as ``x``) into ``x``; returns ``x``."""
        checks.check_p2p(self, x, src, tag)
        with self._p2p("recv", src, x.nbytes, label):
            self._links_for(x).recv(x, src, tag)
        return x

    def isend(self, x, dst: int, tag: int = 0, *, label: str = "") -> Request:
        """Start sending ``x`` to ``dst``; don't touch ``x`` until the request's ``wait()`` returns.
        (The trace times the posting; the transfer overlaps whatever runs until ``wait``.)"""
        checks.check_p2p(self, x, dst, tag, writeable=False)
        with self._p2p("isend", dst, x.nbytes, label) as seq:
            return _GroupRequest(self._links_for(x).isend(x, dst, tag), self, "isend", seq)

    def irecv(self, x, src: int, tag: int = 0, *, label: str = "") -> Request:
        """Start receiving ``src``'s message into ``x``; it is there once ``wait()`` returns."""
        checks.check_p2p(self, x, src, tag)
        with self._p2p("irecv", src, x.nbytes, label) as seq:
            return _GroupRequest(self._links_for(x).irecv(x, src, tag), self, "irecv", seq)

    def sendrecv(self, sendbuf, dst: int, recvbuf, src: int, tag: int = 0, *, label: str = ""):
        """Send ``sendbuf`` to ``dst`` while receiving ``recvbuf`` from ``src`` (deadlock-free even
        when two ranks exchange with each other). Returns ``recvbuf``."""
        checks.check_p2p(self, sendbuf, dst, tag, writeable=False)
        checks.check_p2p(self, recvbuf, src, tag, like=sendbuf)
        with self._p2p("sendrecv", dst, sendbuf.nbytes + recvbuf.nbytes, label):
            self._links_for(sendbuf).sendrecv(sendbuf, dst, recvbuf, src, tag)
        return recvbuf

    def batch_isend_irecv(self, ops: list["P2POp"]) -> list[Request]:
        """Post the point-to-point ops ``ops`` (:class:`P2POp`) together and return their requests,
        in order (torch.distributed's ``batch_isend_irecv``); touch no buffer before its request's
        ``wait()``. What it sends: each "isend" op's buffer to its peer. On backend "nccl" the ops on GPU
        buffers are one NCCL group (``ncclGroupStart``/``ncclGroupEnd``), launched now, whose sends
        and receives progress together and complete together; elsewhere each op is posted as
        ``isend`` / ``irecv`` posts it. Every op is checked before any is posted."""
        for op in ops:
            if op.op not in ("isend", "irecv"):
                raise ValueError(f"rank {self.rank}: a P2POp is 'isend' or 'irecv', got {op.op!r}")
            checks.check_p2p(self, op.buffer, op.peer, op.tag, writeable=op.op == "irecv")
        requests = [getattr(self, op.op)(op.buffer, op.peer, op.tag, label=op.label) for op in ops]
        if self.backend == "nccl":
            self._native.p2p.flush()  # what the GPU ops queued: one NCCL group
        return requests

    # ---- bookkeeping ------------------------------------------------------------------------------

    def _dispatch(self, name, run, algorithm, nbytes, *, async_op=False, like=None, op=None, dtype=None, count=0,
                  root=-1, recv_counts=None, label=""):
        """The one path of every collective, once its arguments are checked: after the collectives
        queued before it, number it, check its fingerprint, record it in the trace and ``run()`` it,
        now or (``async_op``) on the group's communication thread, returning its Work. ``op``,
        ``dtype``, ``count``, ``root`` and ``recv_counts`` describe the call for the fingerprint. A GPU
        array's kernels must run on its own GPU, so the communication thread makes ``like``'s GPU
        current for the call. ``label`` is the call site's purpose, recorded in the trace."""
        def collective():
            with self._collective(name, algorithm, nbytes, op=op, dtype=dtype, count=count, root=root,
                                  recv_counts=recv_counts, label=label):
                return run()
        if async_op:
            def on_its_gpu():
                with device_of(like):
                    return collective()
            return self._stream.submit(on_its_gpu, f"{name} on group '{self.name}'")
        self._stream.synchronize()
        return collective()

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

    def _all_reduce_algorithm(self, nbytes: int) -> str:
        """``all_reduce(algorithm="auto")``'s choice for a buffer of ``nbytes``: recursive doubling
        below ``threshold_bytes``; from there, on a power-of-two group, Rabenseifner's ("halving")
        below ``ring_from_bytes``; else the ring. It depends only on the size and the group's size,
        which every rank shares, so every rank picks the same."""
        if nbytes < self.threshold_bytes:
            return "doubling"
        if nbytes < self.ring_from_bytes and _power_of_two(self.size):
            return "halving"
        return "ring"

    def _halving(self, nbytes: int) -> bool:
        """Whether reduce_scatter (recursive halving) and all_gather (recursive doubling) of a full
        buffer of ``nbytes`` take log2(n) rounds rather than the ring's n - 1: on a power-of-two group,
        below ``ring_from_bytes``. The same on every rank."""
        return self.size > 1 and _power_of_two(self.size) and nbytes < self.ring_from_bytes

    def _algorithm(self, hand_written: str, x) -> str:
        """The name the trace records: the backend's ("mpi", "nccl") when it runs the call."""
        return self.backend if self._native_for(x) else hand_written

    @contextmanager
    def _collective(self, name, algorithm, nbytes, *, op=None, dtype=None, count=0, root=-1, recv_counts=None,
                    label=""):
        """Number a collective, record it in the trace, check that the ranks called the same one
        (``fingerprint.py``: with the ring neighbours, or in debug mode with everyone), and report a
        peer that never answers as CommTimeoutError naming the ranks that never arrived."""
        self.seq += 1
        with self._timeouts(name, self.seq, collective=True), self.trace.record(
                name, group=self.name, algorithm=algorithm, nbytes=nbytes, seq=self.seq, label=label):
            if self.debug or self.check_calls:
                check_call(self.transport, self.name, name, op, dtype, count, root, self.seq, everyone=self.debug,
                           recv_counts=recv_counts)
            yield

    @contextmanager
    def _p2p(self, name, peer, nbytes, label=""):
        """Number and record a point-to-point call (with the call site's ``label``); yields its number."""
        self.p2p_seq += 1
        with self._timeouts(name, self.p2p_seq), self.trace.record(
                name, group=self.name, nbytes=nbytes, seq=self.p2p_seq, peer=peer, kind="p2p", label=label):
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
                found, missing, pending = census.explain(self.transport, seq, name)
                self._census_sends += pending
            error = CommTimeoutError(name, seq, self.rank, e.peer, e.waited, self.name, found, missing)
            if self.flight_recorder is not None:
                self.flight_recorder.dump(self.trace, error)
            raise error from e


class _GroupRequest(Request):
    """A transport request whose ``wait`` reports a lost peer as CommTimeoutError, like the group."""

    def __init__(self, request: Request, group: ProcessGroup, op: str, seq: int):
        self.request, self.group, self.op, self.seq = request, group, op, seq

    def test(self) -> bool:
        return self.request.test()

    def wait(self) -> None:
        with self.group._timeouts(self.op, self.seq):
            self.request.wait()


def _power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def _summed(op: str) -> str:
    """The reduction the algorithms run: "avg" is a "sum" the group divides, afterwards (float16:
    before, :func:`~minidist.comm.ops.averages_first`)."""
    return "sum" if op == "avg" else op


@dataclass(frozen=True)
class P2POp:
    """One op of :meth:`ProcessGroup.batch_isend_irecv` (torch.distributed's ``P2POp``): "isend"
    ``buffer`` to rank ``peer``, or "irecv" into ``buffer`` from it, with ``tag`` and the call site's
    ``label`` ("<purpose>: <what>", recorded in the trace)."""
    op: str
    buffer: object
    peer: int
    tag: int = 0
    label: str = ""
