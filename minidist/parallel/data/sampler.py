"""Each data-parallel rank reads its own rows of the global batch (PyTorch's DistributedSampler).

The global batch of a step is :func:`minidist.data.get_batch`: B windows of the token file whose
starts are drawn from (seed, step). dp rank d owns rows ``numpy.array_split(range(B), dp)[d]``. The
sampler draws the same B starts (a few integers) but reads only its own rows' windows from the
memory-mapped token file, so no rank ever reads, let alone holds, the whole batch or the corpus.
"""
from __future__ import annotations

import numpy as np

from minidist.data.dataset import window_starts
from minidist.device import get_array_module


def dp_rows(batch_size: int, dp_rank: int, dp_size: int) -> np.ndarray:
    """The rows of the global batch that dp rank ``dp_rank`` of ``dp_size`` trains on."""
    return np.array_split(np.arange(batch_size), dp_size)[dp_rank]


class DistributedSampler:
    """Rows ``dp_rows(batch_size, dp_rank, dp_size)`` of every step's global batch, read from
    ``tokens`` (typically a read-only ``np.memmap``)."""

    def __init__(self, tokens, batch_size: int, block_size: int, seed: int, dp_rank: int, dp_size: int):
        if batch_size % dp_size:
            raise ValueError(f"batch_size {batch_size} is not divisible by dp {dp_size}")
        self.tokens, self.block_size, self.seed = tokens, block_size, seed
        self.batch_size = batch_size
        self.rows = dp_rows(batch_size, dp_rank, dp_size)

    def batch(self, step: int) -> np.ndarray:
        """This rank's (B/dp, T+1) int64 rows of the global batch of ``step``."""
        starts = window_starts(len(self.tokens), step, self.batch_size, self.block_size, self.seed)  # (B,)
        index = starts[self.rows, None] + np.arange(self.block_size + 1)  # (B/dp, T+1)
        return self.tokens[index].astype(np.int64)  # reads only these windows of the memmap


def micro_batches(batch: np.ndarray, n: int) -> list[np.ndarray]:
    """``batch`` (b, T+1) cut into ``n`` consecutive micro-batches of b/n rows (b % n must be 0):
    views, in the batch's memory (host or GPU)."""
    if len(batch) % n:
        raise ValueError(f"{len(batch)} rows cannot be cut into {n} equal micro-batches")
    return get_array_module(batch).split(batch, n)
