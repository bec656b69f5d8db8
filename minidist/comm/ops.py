"""What every collective algorithm shares: reduction operators, accepted dtypes, uneven counts and a
scratch workspace (their message tags are in ``tags.py``).

The algorithms in ``ring.py``, ``doubling.py``, ``halving.py`` and ``rooted.py`` reduce with ufuncs
written ``ufunc(a, b, out=a)``: in place, no temporary array, and on the buffer's own device (NumPy's
ufunc for host arrays, CuPy's kernel for GPU arrays). Whatever scratch memory they need (a segment being
received, an accumulator) comes from a :class:`Workspace` that the group keeps across calls, so the
hot loops allocate nothing.
"""
from __future__ import annotations

import numpy as np

from minidist.device import data_pointer, get_array_module, is_cupy

REDUCE_OPS = {"sum": "add", "prod": "multiply", "max": "maximum", "min": "minimum"}
"""The reductions the algorithms perform, by ufunc name. ``"avg"`` is the group's: a sum, then a
division."""

GROUP_OPS = (*REDUCE_OPS, "avg")

DTYPES = tuple(np.dtype(d) for d in ("float16", "float32", "float64", "int32", "int64"))


def reduce_ufunc(op: str, like):
    """The ufunc that performs ``op`` on arrays like ``like``: ``numpy.add`` for a NumPy array,
    ``cupy.add`` (a GPU kernel) for a CuPy one."""
    return getattr(get_array_module(like), REDUCE_OPS[op])


def split_counts(total: int, n: int) -> list[int]:
    """How ``numpy.array_split`` cuts ``total`` items into ``n`` parts: the first ``total % n`` parts
    hold one item more. ``split_counts(10, 4) == [3, 3, 2, 2]``, ``split_counts(2, 4) == [1, 1, 0, 0]``."""
    base, extra = divmod(total, n)
    return [base + (i < extra) for i in range(n)]


def offsets(counts: list[int]) -> list[int]:
    """Where each part starts when the parts are laid end to end: ``offsets([3, 3, 2]) == [0, 3, 6]``."""
    starts = [0]
    for c in counts[:-1]:
        starts.append(starts[-1] + c)
    return starts


def same_memory(a, b) -> bool:
    """True when ``a`` and ``b`` are the same contiguous block (then copying one into the other is a
    no-op worth skipping)."""
    return a.size == b.size and (a.size == 0 or (is_cupy(a) == is_cupy(b) and data_pointer(a) == data_pointer(b)))


def averages_first(dtype) -> bool:
    """Whether op "avg" divides each rank's contribution by n BEFORE the sum (float16) rather than
    the sum after it: n float16 values near the largest, 65504, would overflow their sum where their
    average does not (mixed precision's scaled gradients live up there). PyTorch DDP's gradient
    pre-division does the same."""
    return dtype == np.float16


def divide_by_size(x, n: int) -> None:
    """Turn a sum into an average, in place. Floats divide; integers truncate toward zero, as NCCL's
    ``ncclAvg`` does (``-7 // 2`` would give -4; truncation gives -3)."""
    xp = get_array_module(x)
    if x.dtype.kind == "f":
        xp.divide(x, n, out=x)
    else:
        x -= xp.fmod(x, n)  # now an exact multiple of n, so floor division truncates too
        xp.floor_divide(x, n, out=x)


class Workspace:
    """Scratch buffers that grow but are never freed, one per (purpose, dtype, array module).

    ``get`` hands out a view of the first ``count`` elements; two different purposes never share
    memory, and a purpose must not be used by two calls at once (each rank's group owns one).
    """

    def __init__(self):
        self._buffers: dict[tuple[str, np.dtype, str], object] = {}

    def get(self, purpose: str, dtype, count: int, like=None):
        """A 1-D array of ``count`` elements of ``dtype`` for ``purpose``, reused across calls, in
        the memory of ``like`` (host when None, the GPU when ``like`` is a CuPy array)."""
        xp = get_array_module(like)
        key = (purpose, np.dtype(dtype), xp.__name__)
        buf = self._buffers.get(key)
        if buf is None or buf.size < count:
            buf = self._buffers[key] = xp.empty(count, dtype)
        return buf[:count]


def bus_factor(op: str, n: int) -> float | None:
    """nccl-tests' bus-bandwidth factor of ``op`` on ``n`` ranks: the bytes each rank's link carries
    per byte of buffer. All-reduce 2(n-1)/n; reduce-scatter (of its input), all-gather (of its
    output) and all-to-all (of its input) (n-1)/n; broadcast, reduce and point-to-point 1. ``None`` for
    anything else."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", "send", "recv", "isend", "irecv", "sendrecv"):
        return 1.0
    return None
