"""Token files on disk and the global batch of every training step.

A token file is raw uint8 tokens (one byte each); a corpus of shards is read through
:class:`~minidist.data.tokens.Tokens` (data/folder.py). A batch reads only the windows it needs
(:func:`read_windows`), so a corpus larger than RAM works unchanged.

Batches are a pure function of (seed, step): rerunning a step, resuming from a checkpoint, or
running with N data-parallel ranks all see the same tokens. :func:`get_batch` returns the GLOBAL
batch; a data-parallel rank takes its own rows of it (rows ``rank*B/N : (rank+1)*B/N``).
"""
import numpy as np


def load_tokens(path):
    """The tokens of a uint8 token file as a read-only np.memmap, shape (n_tokens,).
    (With the byte-level tokenizer any UTF-8 text file is a valid token file.)"""
    return np.memmap(path, dtype=np.uint8, mode="r")


def train_val_split(tokens, val_fraction=0.1):
    """(train, val): the first ``1 - val_fraction`` of the tokens and the rest, as views (no copy)."""
    n_val = int(len(tokens) * val_fraction)
    return tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]


def window_starts(n_tokens: int, step: int, batch_size: int, block_size: int, seed: int = 0) -> np.ndarray:
    """The start of each of the B windows of ``step``'s global batch, shape (B,): drawn uniformly by a
    generator seeded with (seed, step), so the batch depends on nothing else."""
    n_starts = n_tokens - block_size
    if n_starts < 1:
        raise ValueError(f"{n_tokens} tokens cannot fill one window of block_size + 1 = {block_size + 1}")
    return np.random.default_rng([seed, step]).integers(0, n_starts, size=batch_size)


def get_batch(tokens, step, batch_size, block_size, seed=0):
    """The global batch of ``step``: (B, T+1) int64 windows of ``tokens``, B = batch_size, T = block_size,
    starting at :func:`window_starts`. Inputs are ``batch[:, :-1]`` and next-token targets
    ``batch[:, 1:]`` (see :func:`inputs_and_targets`).
    """
    starts = window_starts(len(tokens), step, batch_size, block_size, seed)  # (B,)
    return read_windows(tokens, starts, [(0, block_size + 1)])              # (B, T+1)


def read_windows(tokens, starts, spans, width: int | None = None) -> np.ndarray:
    """(len(starts), W) int64: for each window start s and each ``(a, b)`` of ``spans``, the tokens
    ``s + a .. s + b`` at columns a..b (W: ``width``, else the largest b), zero in the columns no span
    covers. A rank that uses only some positions of a window reads only those (``tokens``: an array, a
    memmap, or a :class:`~minidist.data.tokens.Tokens`, which reads them with one pread each)."""
    out = np.zeros((len(starts), width if width is not None else max(b for _, b in spans)), dtype=np.int64)
    for row, s in enumerate(np.asarray(starts, dtype=np.int64).tolist()):
        for a, b in spans:
            out[row, a:b] = tokens[s + a:s + b]
    return out


def inputs_and_targets(batch):
    """Split a (B, T+1) batch into inputs idx (B, T) and targets (B, T): each target is the next token."""
    return batch[:, :-1], batch[:, 1:]
