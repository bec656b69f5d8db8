"""Cache blocking for the element-wise updates: walk flat arrays in chunks small enough that every
operation of an AdamW or SGD update finds the chunk still in cache, with one preallocated scratch
buffer per temporary instead of a fresh whole-array temporary per operation.

Per element a blocked update does exactly the operations of the whole-array code, in the same order
and in the same dtypes (each scratch buffer has the dtype the whole-array temporary would have had),
so its results are bitwise the same; only the memory traffic changes. On the GPU (CuPy) blocking is
pointless: the whole array is one chunk and each operation allocates its result, as before.

Weight decay comes in three forms, cut per chunk by :func:`decay_pieces`:
- a number: the rate of every element (the per-tensor update);
- an array of per-element rates (a 0/1 mask times the rate), applied with array arithmetic;
- spans, ``[(start, stop, rate), ...]`` sorted and disjoint: elements ``start <= i < stop`` decay at
  ``rate`` exactly as if that slice were updated alone with the number ``rate`` (bitwise the
  per-tensor update of each parameter packed in a flat buffer), the others do not decay.
  :func:`decay_spans` builds them with nanoGPT's rule.
"""
from __future__ import annotations

import math
from bisect import bisect_right

import numpy as np

from minidist.device import get_array_module

BLOCK = 1 << 17
"""Elements per chunk (128 Ki: 512 KiB per float32 array). Measured on the 2-core EPYC with 1 MiB L2
per core: AdamW over 162M float32 elements took 0.48 s in chunks of 8 Ki, 0.34 s at 32 Ki, 0.315 s at
64 Ki, 0.30 s at 128 Ki and 0.31 s at 256 and 512 Ki (each NumPy call costs ~0.6 us, which small chunks
pay more often; the chunk's five arrays still stay in L2/L3): benchmarks/RESULTS.md, *Training step*."""


def decay_spans(shapes, rate):
    """The spans of a flat buffer packing tensors of ``shapes`` in order: ``rate`` on each tensor that
    nanoGPT decays (ndim >= 2), nothing on biases and gains. Adjacent decayed tensors share one span."""
    spans, start = [], 0
    for shape in shapes:
        stop = start + math.prod(shape)
        if len(shape) >= 2 and rate and stop > start:
            if spans and spans[-1][1] == start:
                spans[-1] = (spans[-1][0], stop, rate)
            else:
                spans.append((start, stop, rate))
        start = stop
    return spans


def block_length(param, *others):
    """:data:`BLOCK` when these arrays are cut into blocks: ``param`` is longer than a block and every
    array is a C-contiguous NumPy array of its shape (``others`` may hold None). Else None: the update
    runs on the whole arrays as one chunk (a short array, CuPy, strided or broadcast arrays)."""
    if param.size > BLOCK and all(type(a) is np.ndarray and a.flags.c_contiguous and a.shape == param.shape
                                  for a in (param,) + others if a is not None):
        return BLOCK
    return None


def chunks(param, *others):
    """``(views, lo, hi)`` per chunk: ``views`` are ``param`` and ``others`` (arrays of its shape, or
    None) cut to elements ``[lo, hi)`` of their flat order, in blocks of :func:`block_length`;
    otherwise one chunk of the whole arrays (flat when all are C-contiguous)."""
    arrays = (param,) + others
    block = block_length(param, *others)
    if block is None:
        contiguous = all(a.flags.c_contiguous and a.shape == param.shape for a in arrays if a is not None)
        if param.size:
            yield [None if a is None else a.reshape(-1) if contiguous else a for a in arrays], 0, param.size
        return
    flat = [None if a is None else a.reshape(-1) for a in arrays]
    for lo in range(0, param.size, block):
        hi = min(lo + block, param.size)
        yield [None if a is None else a[lo:hi] for a in flat], lo, hi


class Decay:
    """Weight decay of one update, in one of the three forms (a number, an array of rates, spans), cut
    per chunk by :meth:`pieces`. Spans must be sorted, disjoint and within the array, and need a
    C-contiguous ``param`` (they index its flat order)."""

    def __init__(self, weight_decay, param):
        self.rate = weight_decay
        self.array = weight_decay if hasattr(weight_decay, "shape") and weight_decay.ndim else None
        self.spans = list(weight_decay) if isinstance(weight_decay, (list, tuple)) else None
        if self.spans is None:
            return
        end = 0
        for start, stop, _ in self.spans:
            if not end <= start <= stop <= param.size:
                raise ValueError(f"weight-decay spans must be sorted, disjoint and within [0, {param.size}]: "
                                 f"got {self.spans}")
            end = stop
        if param.ndim > 1 and not param.flags.c_contiguous:
            raise ValueError("weight-decay spans index a flat buffer: pass C-contiguous arrays")
        self.stops = [stop for _, stop, _ in self.spans]

    def pieces(self, lo, hi, rates=None):
        """Chunk ``[lo, hi)`` cut by weight decay: ``(a, b, rate)`` with ``a:b`` relative to the chunk
        and ``rate`` None (no decay), a number, or ``rates``, the chunk's view of :attr:`array` (as
        :func:`chunks` gives it). A number or an array covers the whole chunk; spans leave None
        between them."""
        if self.spans is None:
            yield 0, hi - lo, self.rate if self.array is None else rates
            return
        pos = lo
        for start, stop, rate in self.spans[bisect_right(self.stops, lo):]:
            if start >= hi:
                break
            start, stop = max(start, lo), min(stop, hi)
            if start > pos:
                yield pos - lo, start - lo, None
            yield start - lo, stop - lo, rate
            pos = stop
        if pos < hi:
            yield pos - lo, hi - lo, None


def none_of(x):
    """``x`` with no elements (its empty slice), or ``x`` itself when it is a number: an operand for
    the dtype probes of :meth:`Scratch.out`."""
    return x[:0] if getattr(x, "ndim", 0) else x


class Scratch:
    """The temporaries of one blocked update: ``out(key, n, like)`` is an ``n``-element view of one
    buffer of ``size`` elements (a :func:`block_length`) kept per ``key``, made on first use with the
    dtype of ``like()``, the operation applied to empty slices: the dtype the whole-array temporary
    would have had. Off the blocked path (``size`` None: one chunk) ``out`` is None and ``like`` is not
    called: each operation allocates its result."""

    def __init__(self, size):
        self.size = size  # None off the blocked path
        self.buffers = {}

    def out(self, key, n, like):
        if self.size is None:
            return None
        if key not in self.buffers:
            self.buffers[key] = np.empty(self.size, like().dtype)
        return self.buffers[key][:n]
