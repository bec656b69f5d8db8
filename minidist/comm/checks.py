"""Argument checks: a clear ``ValueError`` on the spot, before a call sends anything.

Each function takes the :class:`~minidist.comm.group.ProcessGroup` being called (its rank starts
every message; some checks need its size, name, backend or transport) and the arguments to check.
Every rank checks its own arguments, so a bad call fails on the rank that made it without waiting
for the others.
"""
from __future__ import annotations

import math

import numpy as np

from minidist.comm.ops import DTYPES, GROUP_OPS, split_counts
from minidist.comm.tags import COLLECTIVE_TAG_BASE
from minidist.device import data_pointer, get_array_module, is_cupy

ALGORITHMS = ("auto", "ring", "doubling", "halving")
"""What ``all_reduce(algorithm=...)`` accepts."""


def check_array(group, x, what, *, writeable=True, min_ndim=0, any_dtype=False, like=None) -> None:
    """``x`` is a NumPy or CuPy array the collectives can take (``like``: in the same memory as
    ``like``, host or GPU)."""
    rank = group.rank
    if not isinstance(x, np.ndarray) and not is_cupy(x):
        raise ValueError(f"rank {rank}: {what} must be a numpy or cupy array, got {type(x).__name__}")
    if group.backend == "mpi" and is_cupy(x) and not getattr(group.transport, "cuda_aware", False):
        raise ValueError(f"rank {rank}: backend 'mpi' hands {what} to MPI as it is, and this MPI is "
                         f"not CUDA-aware: use backend 'ring' (it stages GPU buffers through pinned host "
                         f"memory) or 'nccl'")
    if like is not None and is_cupy(x) != is_cupy(like):
        where = {True: "GPU (cupy)", False: "host (numpy)"}
        raise ValueError(f"rank {rank}: {what} is in {where[is_cupy(x)]} memory but the input is in "
                         f"{where[is_cupy(like)]} memory; keep both on one side")
    if not any_dtype and x.dtype not in DTYPES:
        raise ValueError(f"rank {rank}: {what} has dtype {x.dtype}; collectives take "
                         f"{', '.join(map(str, DTYPES))}")
    if not x.flags.c_contiguous:
        raise ValueError(f"rank {rank}: {what} must be C-contiguous (see numpy.ascontiguousarray)")
    if writeable and not is_cupy(x) and not x.flags.writeable:
        raise ValueError(f"rank {rank}: {what} must be writeable")
    if x.ndim < min_ndim:
        raise ValueError(f"rank {rank}: {what} needs an axis 0 to split along, got shape {x.shape}")


def check_op(group, op) -> None:
    """``op`` is one of ``GROUP_OPS``."""
    if op not in GROUP_OPS:
        raise ValueError(f"rank {group.rank}: op must be one of {', '.join(GROUP_OPS)}, got {op!r}")


def check_algorithm(group, algorithm) -> None:
    """``algorithm`` is one ``all_reduce`` knows."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"rank {group.rank}: algorithm must be 'auto', 'ring', 'doubling' or 'halving', "
                         f"got {algorithm!r}")


def check_rank(group, r, what) -> None:
    """``r`` is a rank of ``group``."""
    if not isinstance(r, (int, np.integer)) or not 0 <= r < group.size:
        raise ValueError(f"rank {group.rank}: {what} must be a rank of group '{group.name}' "
                         f"(0..{group.size - 1}), got {r!r}")


def check_int(group, v, what) -> None:
    """``v`` is an int (``split``'s color and key)."""
    if not isinstance(v, (int, np.integer)):
        raise ValueError(f"rank {group.rank}: {what} must be an int, got {v!r}")


def check_bytes(group, data) -> None:
    """``data`` is bytes (``gather_bytes``)."""
    if not isinstance(data, (bytes, bytearray)):
        raise ValueError(f"rank {group.rank}: data must be bytes, got {type(data).__name__}")


def check_p2p(group, x, peer, tag, *, writeable=True, like=None) -> None:
    """A point-to-point buffer of any dtype, a peer in ``group``, and a user tag below
    ``COLLECTIVE_TAG_BASE`` (the tags above belong to collectives, see ``tags.py``)."""
    check_array(group, x, "buffer", writeable=writeable, any_dtype=True, like=like)
    check_rank(group, peer, "peer")
    if not isinstance(tag, (int, np.integer)) or not 0 <= tag < COLLECTIVE_TAG_BASE:
        raise ValueError(f"rank {group.rank}: tag must be an int in 0..{COLLECTIVE_TAG_BASE - 1} "
                         f"(higher tags belong to collectives), got {tag!r}")


def gathered_rows(group, shard, count) -> list[int]:
    """The rows each rank contributes to ``all_gather``: ``count`` split by ``numpy.array_split``
    (``shard`` must hold this rank's part), or, without ``count``, this rank's rows on every rank."""
    if count is None:
        return [shard.shape[0]] * group.size
    if not isinstance(count, (int, np.integer)) or count < 0:
        raise ValueError(f"rank {group.rank}: count must be a non-negative int, got {count!r}")
    rows = split_counts(int(count), group.size)
    if shard.shape[0] != rows[group.rank]:
        raise ValueError(f"rank {group.rank}: with count={count} over {group.size} ranks the shard must "
                         f"have {rows[group.rank]} rows (numpy.array_split), got {shard.shape[0]}")
    return rows


def out_array(group, out, shape, dtype, like):
    """``out`` checked to hold ``shape`` of ``dtype`` in the memory of ``like`` (host or GPU), or
    a new such array if it is None."""
    if out is None:
        return get_array_module(like).empty(shape, dtype)
    check_array(group, out, "out", like=like)
    if out.dtype != dtype or out.size != math.prod(shape):
        raise ValueError(f"rank {group.rank}: out must hold {math.prod(shape)} x {np.dtype(dtype)} "
                         f"(shape {shape}), got {out.size} x {out.dtype}")
    return out


def all_to_all_rows(group, x, send_counts, recv_counts) -> tuple[list[int], list[int] | None]:
    """The rows of ``x`` (along axis 0) this rank sends to each rank, and the rows it receives from
    each: both equal splits when the counts are None (``x.shape[0]`` must be divisible by the group
    size), else ``group.size`` non-negative ints each, ``send_counts`` summing to ``x.shape[0]``. The
    received rows are None when ``send_counts`` is given without ``recv_counts``: the peers tell."""
    n, rank, rows = group.size, group.rank, x.shape[0]
    if send_counts is None:
        if rows % n:
            raise ValueError(f"rank {rank}: all_to_all without send_counts cuts x into {n} equal chunks along "
                             f"axis 0, but x has {rows} rows, not a multiple of {n}; pass send_counts for "
                             f"uneven chunks")
        send = [rows // n] * n
    else:
        send = _rank_counts(group, send_counts, "send_counts")
        if sum(send) != rows:
            raise ValueError(f"rank {rank}: send_counts {send} sum to {sum(send)}, but x has {rows} rows "
                             f"along axis 0")
    if recv_counts is None:
        return send, (list(send) if send_counts is None else None)
    recv = _rank_counts(group, recv_counts, "recv_counts")
    if recv[rank] != send[rank]:
        raise ValueError(f"rank {rank}: sends itself {send[rank]} rows (send_counts[{rank}]) but expects "
                         f"{recv[rank]} (recv_counts[{rank}])")
    return send, recv


def _rank_counts(group, counts, what) -> list[int]:
    """``counts`` as a list of ``group.size`` non-negative ints (rows per rank), or a ValueError."""
    try:
        values = list(counts)
    except TypeError:
        values = None
    if (values is None or len(values) != group.size
            or not all(isinstance(c, (int, np.integer)) and not isinstance(c, bool) and c >= 0 for c in values)):
        raise ValueError(f"rank {group.rank}: {what} must be {group.size} non-negative ints (rows per rank, "
                         f"one per rank of group '{group.name}'), got {counts!r}")
    return [int(c) for c in values]


def apart(group, out, x) -> None:
    """``out`` does not overlap ``x`` (an all-to-all cannot work in place: it would overwrite chunks
    it has yet to send)."""
    if out.nbytes and x.nbytes and is_cupy(out) == is_cupy(x):
        lo_out, lo_x = data_pointer(out), data_pointer(x)
        if lo_out < lo_x + x.nbytes and lo_x < lo_out + out.nbytes:
            raise ValueError(f"rank {group.rank}: out overlaps x; all_to_all needs a separate output")
