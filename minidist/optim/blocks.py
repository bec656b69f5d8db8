"""Cache blocking for the element-wise updates: walk the arrays in chunks small enough that every
operation of an AdamW or SGD update finds the chunk still in cache, with one preallocated scratch
buffer per temporary instead of a fresh whole-array temporary per operation.

Per element a blocked update does exactly the operations of the whole-array code, in the same order
and in the same dtypes (each scratch buffer has the dtype the whole-array temporary would have had),
so its results are bitwise the same; only the memory traffic changes. Arrays of at most one block,
CuPy arrays (on the GPU blocking is pointless) and strided arrays are one chunk, and each operation
allocates its result, as before.
"""
from __future__ import annotations

import numpy as np

BLOCK = 1 << 17
"""Elements per chunk (128 Ki: 512 KiB per float32 array). Measured on the 2-core EPYC (1 MiB L2 per
core, 32 MiB L3), AdamW over 162M float32 elements: 0.48 s in chunks of 8 Ki, 0.39 s at 16 Ki, 0.34 s
at 32 Ki, 0.30-0.31 s from 64 Ki to 512 Ki (each NumPy call costs ~0.6 us, which small chunks pay more
often), against 0.52-0.58 s per tensor unblocked: benchmarks/RESULTS.md, *Training step*."""


def rates_array(weight_decay):
    """``weight_decay`` when it is an array of per-element rates (it is then cut into chunks with the
    other arrays), None when it is a number."""
    return weight_decay if getattr(weight_decay, "ndim", 0) else None


def block_length(param, *others):
    """:data:`BLOCK` when these arrays are cut into blocks: ``param`` is a NumPy array longer than a
    block and every array is a C-contiguous NumPy array of its shape (``others`` may hold None). Else
    None: the update runs on the whole arrays as one chunk."""
    if param.size > BLOCK and all(type(a) is np.ndarray and a.flags.c_contiguous and a.shape == param.shape
                                  for a in (param,) + others if a is not None):
        return BLOCK
    return None


def chunks(param, *others):
    """``param`` and ``others`` (arrays of its shape, or None) cut into chunks: a list of views per
    chunk, the elements ``[lo, lo + BLOCK)`` of their flat order; or one chunk of the whole arrays
    when :func:`block_length` is None."""
    arrays = (param,) + others
    block = block_length(param, *others)
    if block is None:
        if param.size:
            yield list(arrays)
        return
    flat = [None if a is None else a.reshape(-1) for a in arrays]
    for lo in range(0, param.size, block):
        yield [None if a is None else a[lo:lo + block] for a in flat]


class Scratch:
    """The temporaries of one blocked update: ``out(key, n, like)`` is an ``n``-element view of one
    buffer of ``size`` elements (a :func:`block_length`) kept per ``key``, made on first use with the
    dtype of ``like()``, the operation applied to empty slices: the dtype the whole-array temporary
    would have had. Off the blocked path (``size`` None: one chunk) ``out`` is None and ``like`` is not
    called: each operation allocates its result."""

    def __init__(self, size):
        self.size = size
        self.buffers = {}

    def out(self, key, n, like):
        if self.size is None:
            return None
        if key not in self.buffers:
            self.buffers[key] = np.empty(self.size, like().dtype)
        return self.buffers[key][:n]


def none_of(x):
    """``x`` with no elements (its empty slice), or ``x`` itself when it is a number: an operand for
    the dtype probes of :meth:`Scratch.out`."""
    return x[:0] if getattr(x, "ndim", 0) else x
