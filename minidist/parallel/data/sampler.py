"""Each data-parallel rank reads its own rows of the global batch (PyTorch's DistributedSampler), and
of each row only the positions it uses.

The global batch of a step is :func:`minidist.data.get_batch`: B windows of T + 1 tokens whose
starts are drawn from (seed, step). dp rank d owns rows ``numpy.array_split(range(B), dp)[d]``. The
sampler draws the same B starts (a few integers) but reads only its own rows' windows, and of each
window only its ``spans`` (:func:`window_spans`: a cp rank's tokens, a pipeline stage's inputs or
targets), so no rank reads, let alone holds, the whole batch or the corpus.
"""
from __future__ import annotations

import numpy as np

from minidist.data.dataset import read_windows, window_starts
from minidist.device import get_array_module


def dp_rows(batch_size: int, dp_rank: int, dp_size: int) -> np.ndarray:
    """The rows of the global batch that dp rank ``dp_rank`` of ``dp_size`` trains on."""
    return np.array_split(np.arange(batch_size), dp_size)[dp_rank]


def window_spans(block_size: int, chunks=None, inputs: bool = True, targets: bool = True) -> list[tuple[int, int]]:
    """The (start, stop) positions of a (T+1)-token window that a rank reads, merged and sorted.
    ``chunks``: the (a, b) token ranges of the sequence the rank holds (context parallelism; None:
    all of it). Input ids of positions a..b are window positions a..b; their targets (the next
    tokens) are a+1..b+1. ``inputs`` / ``targets``: whether the rank uses them (a pipeline's first
    stage needs the ids, its last the targets, the others neither)."""
    chunks = chunks or [(0, block_size)]
    spans = sorted([(a, b) for a, b in chunks] * inputs + [(a + 1, b + 1) for a, b in chunks] * targets)
    merged = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


class DistributedSampler:
    """Rows ``dp_rows(batch_size, dp_rank, dp_size)`` of every step's global batch, read from
    ``tokens`` (a :class:`~minidist.data.tokens.Tokens`, or an array), only at ``spans``
    (:func:`window_spans`; None: whole windows); the positions not read are 0."""

    def __init__(self, tokens, batch_size: int, block_size: int, seed: int, dp_rank: int, dp_size: int,
                 spans=None):
        if batch_size % dp_size:
            raise ValueError(f"batch_size {batch_size} is not divisible by dp {dp_size}")
        self.tokens, self.block_size, self.seed = tokens, block_size, seed
        self.batch_size = batch_size
        self.rows = dp_rows(batch_size, dp_rank, dp_size)
        self.spans = spans if spans is not None else [(0, block_size + 1)]
        self.width = block_size + 1

    def batch(self, step: int) -> np.ndarray:
        """This rank's (B/dp, T+1) int64 rows of the global batch of ``step``."""
        starts = window_starts(len(self.tokens), step, self.batch_size, self.block_size, self.seed)  # (B,)
        return read_windows(self.tokens, starts[self.rows], self.spans, self.width)  # a span-less rank: zeros

    def bytes_per_step(self) -> int:
        """The bytes :meth:`batch` reads: rows x the positions its spans cover x the token size."""
        itemsize = getattr(self.tokens, "dtype", np.dtype(np.uint8)).itemsize
        return len(self.rows) * sum(b - a for a, b in self.spans) * itemsize


def micro_batches(batch: np.ndarray, n: int) -> list[np.ndarray]:
    """``batch`` (b, T+1) cut into ``n`` consecutive micro-batches of b/n rows (b % n must be 0):
    views, in the batch's memory (host or GPU)."""
    if len(batch) % n:
        raise ValueError(f"{len(batch)} rows cannot be cut into {n} equal micro-batches")
    return get_array_module(batch).split(batch, n)
