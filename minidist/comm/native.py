"""backend="mpi": MPI's own collectives, with the meaning of the hand-written algorithms.

``ring.py``, ``doubling.py``, ``rooted.py`` and ``alltoall.py`` build every collective from
point-to-point messages. This file hands the same calls to the MPI library instead (``MPI_Allreduce``,
``MPI_Reduce_scatter``, ``MPI_Allgatherv``, ``MPI_Alltoallv``, ...), which picks its own algorithm.
It is the reference the hand-written ring is tested against and the peer the benchmark measures it
against.

:class:`MPICollectives` is bound to one :class:`~minidist.comm.mpi_transport.MPITransport` (it uses
its ``comm``); its methods take flat, contiguous 1-D arrays and have the names and meaning of
``nccl.NCCLCollectives``' (a group holds either as its ``_native``). Reductions are typed: float16,
float32, float64, int32 and int64. float16 uses MPI's ``MPI_FLOAT16_T`` (MPICH: ``MPIX_C_FLOAT16``,
with every reduction op); an MPI library without it gets a clear error rather than a silent fallback.

MPI's collectives block inside the library, with no deadline: a rank that skips one leaves the
others waiting until the job is killed. The timeout that names op, rank and peer is backend "ring"'s.
"""
from __future__ import annotations

import numpy as np

from minidist.comm.ops import offsets, same_memory

_OPS = {"sum": "SUM", "prod": "PROD", "max": "MAX", "min": "MIN"}
_DTYPES = {np.dtype(np.float16): "FLOAT16_T", np.dtype(np.float32): "FLOAT",
           np.dtype(np.float64): "DOUBLE", np.dtype(np.int32): "INT32_T", np.dtype(np.int64): "INT64_T"}


class MPICollectives:
    """MPI's own collectives on the communicator of ``transport`` (an MPITransport)."""

    def __init__(self, transport):
        self.MPI, self.comm, self.rank = transport.MPI, transport.comm, transport.rank

    def all_reduce(self, buf, op: str = "sum") -> None:
        """Every rank's ``buf`` becomes the elementwise ``op`` of all ranks' ``buf`` (``MPI_Allreduce``,
        in place)."""
        self.comm.Allreduce(self.MPI.IN_PLACE, [buf, self._type(buf.dtype)], op=self._op(op))

    def reduce_scatter(self, buf, counts, op, out) -> None:
        """Reduce ``buf`` (``sum(counts)`` elements on every rank) over all ranks and leave rank r's
        part, the ``counts[r]`` elements at ``sum(counts[:r])``, in ``out`` (``MPI_Reduce_scatter``)."""
        mpi_type = self._type(buf.dtype)
        self.comm.Reduce_scatter([buf, mpi_type], [out, mpi_type], recvcounts=list(counts), op=self._op(op))

    def all_gather(self, shard, counts, out) -> None:
        """Concatenate every rank's ``shard`` (rank r sends ``counts[r]`` elements) into ``out`` on
        every rank, in rank order (``MPI_Allgatherv``). A ``shard`` that already is this rank's part of
        ``out`` (ZeRO's updated shard inside its flat parameters) is gathered in place
        (``MPI_IN_PLACE``): MPI refuses aliased send and receive buffers."""
        mpi_type = self._type(shard.dtype)
        starts = offsets(counts)
        recv = [out, (list(counts), starts), mpi_type]
        if same_memory(shard, out[starts[self.rank]:starts[self.rank] + counts[self.rank]]):
            self.comm.Allgatherv(self.MPI.IN_PLACE, recv)
        else:
            self.comm.Allgatherv([shard, mpi_type], recv)

    def all_to_all(self, send, send_counts, recv, recv_counts, equal: bool = False) -> None:
        """Send ``send``'s chunk j (``send_counts[j]`` elements, at ``sum(send_counts[:j])``) to rank j
        and receive rank j's chunk for this rank into ``recv`` at ``sum(recv_counts[:j])``
        (``MPI_Alltoallv``). With ``equal``, which every rank must pass alike (the group's
        fingerprint checks it), the chunks are all one size and ``MPI_Alltoall`` moves them: MPICH
        runs it pairwise for large chunks, where its ``MPI_Alltoallv`` posts everything at once, and
        measured up to 2x faster (benchmarks/RESULTS.md). Ranks must call the same MPI collective,
        and one rank's counts being equal says nothing about another's, hence the flag."""
        mpi_type = self._type(send.dtype)
        if equal:
            self.comm.Alltoall([send, mpi_type], [recv, mpi_type])
        else:
            self.comm.Alltoallv([send, (list(send_counts), offsets(send_counts)), mpi_type],
                                [recv, (list(recv_counts), offsets(recv_counts)), mpi_type])

    def broadcast(self, buf, root: int) -> None:
        """Copy ``root``'s ``buf`` into every rank's ``buf`` (``MPI_Bcast``)."""
        self.comm.Bcast([buf, self._type(buf.dtype)], root=root)

    def reduce(self, buf, root: int, op: str = "sum") -> None:
        """``root``'s ``buf`` becomes the elementwise ``op`` of all ranks' ``buf`` (``MPI_Reduce``, in
        place at the root); other ranks' ``buf`` is unchanged."""
        mpi_type, mpi_op = self._type(buf.dtype), self._op(op)
        if self.rank == root:
            self.comm.Reduce(self.MPI.IN_PLACE, [buf, mpi_type], op=mpi_op, root=root)
        else:
            self.comm.Reduce([buf, mpi_type], None, op=mpi_op, root=root)

    def barrier(self) -> None:
        """Return only once every rank has entered the barrier (``MPI_Barrier``)."""
        self.comm.Barrier()

    def _type(self, dtype):
        """The MPI datatype for a NumPy dtype, or a clear error."""
        name = _DTYPES.get(np.dtype(dtype))
        mpi_type = getattr(self.MPI, name, self.MPI.DATATYPE_NULL) if name else self.MPI.DATATYPE_NULL
        if mpi_type == self.MPI.DATATYPE_NULL:
            raise TypeError(f"backend 'mpi': this MPI library has no datatype for {np.dtype(dtype)}; "
                            f"backend 'ring' has none to need (it sends bytes)")
        return mpi_type

    def _op(self, op: str):
        if op not in _OPS:
            raise ValueError(f"op must be one of {list(_OPS)}, got {op!r}")
        return getattr(self.MPI, _OPS[op])
