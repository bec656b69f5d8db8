"""ProcessGroup: the collectives a training script calls, on any transport.

Each collective checks its arguments on the spot (``checks.py``: a clear ``ValueError`` before
anything is sent), picks its algorithm, and takes the one path of every call (``dispatch.py``):
numbered, its fingerprint compared with the ring neighbours (a CollectiveMismatchError instead of a
hang), recorded in the trace with its call site's label, run now or, with ``async_op=True``, queued
on the group's communication thread (``work.py``). Point-to-point calls are ``point_to_point.py``'s.

``backend="ring"`` runs the hand-written algorithms (``ring``, ``doubling``, ``halving``, ``rooted``,
``alltoall``) over the transport, chosen by size and group size; ``backend="mpi"`` hands the
collectives to MPI's own (``native``); ``backend="nccl"`` hands those on GPU (CuPy) arrays to NCCL
(``nccl``), while host arrays still go over the transport. ``algorithm="ring"``, ``"doubling"`` or
``"halving"`` (Rabenseifner's) forces a hand-written all-reduce on any.
"""
from __future__ import annotations

import math
from functools import partial

from minidist.comm import alltoall, checks, doubling, halving, ring, rooted
from minidist.comm.dispatch import DEFAULT_RING_FROM_BYTES, DEFAULT_THRESHOLD_BYTES, Dispatch
from minidist.comm.ops import Workspace, averages_first, divide_by_size, split_counts
from minidist.comm.point_to_point import PointToPoint
from minidist.comm.trace import Trace
from minidist.comm.transport import CollectiveMismatchError
from minidist.comm.work import CommStream


class ProcessGroup(Dispatch, PointToPoint):
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
        ``MPI_Alltoall(v)`` on backend "mpi"; one NCCL group on "nccl"); its own chunk is a local copy:
        (n-1)/n of ``x`` crosses the links. Before the chunks, when the counts are learned (and, given,
        on "mpi" and "nccl" with ``check_calls``, or in ``debug`` mode), a small all-to-all of the counts
        (``alltoall.exchange_counts``, whose docstring says when and why: MPI and NCCL do not notice
        a message shorter than its receive)."""
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

        What it sends: :func:`~minidist.comm.rooted.gather_bytes` (each length, then the bytes, to ``dst``)."""
        checks.check_bytes(self, data)
        checks.check_rank(self, dst, "dst")
        return self._dispatch("gather_bytes", partial(rooted.gather_bytes, self.transport, data, dst), "direct",
                              len(data), root=dst, label=label)

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


def _summed(op: str) -> str:
    """The reduction the algorithms run: "avg" is a "sum" the group divides, afterwards (float16:
    before, :func:`~minidist.comm.ops.averages_first`)."""
    return "sum" if op == "avg" else op
