"""A run's tokens: one or more files read as one array, by ``os.pread`` of exactly the bytes asked for.

A corpus may be one file (the generated default, a text file: uint8 byte tokens) or many shards
(uint16 tokens after a header: llm.c's format, or nanoGPT's raw ``train.bin``). :class:`Tokens` puts
them end to end, so a window's position is its place in the concatenation, and a window that runs
over the end of one shard continues in the next. Nothing is mapped or read ahead: a read of tokens
``[lo, hi)`` reads ``(hi - lo) * itemsize`` bytes, and :attr:`Tokens.bytes_read` counts them, so a
test (and lesson 17) can say exactly which bytes each rank read.

``os.pread`` releases the GIL while it waits for the disk, so a reader thread (data/prefetch.py)
overlaps the read with the step's compute.
"""
from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np


class DataError(ValueError):
    """A data folder or shard that cannot be trained on, in words naming the file."""


@dataclasses.dataclass(frozen=True)
class Part:
    """``count`` tokens of ``dtype`` in ``path``, the first at byte ``offset``."""
    path: str
    offset: int
    count: int
    dtype: str


class Tokens:
    """The tokens of ``parts`` end to end, as one read-only sequence of ``len(self)`` tokens.

    Thread-safe: each file is opened once, and pread takes no file position."""

    def __init__(self, parts: list[Part], vocab_check: int | None = None):
        self.parts = [p for p in parts if p.count > 0]
        self.ends = np.cumsum([p.count for p in self.parts], dtype=np.int64)  # (n_parts,) token index after each
        self.vocab_check = vocab_check  # a token at or above it in a read is a DataError naming its shard
        self.bytes_read = 0
        self._fds, self._lock = {}, threading.Lock()

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.parts[0].dtype) if self.parts else np.dtype(np.uint8)

    def slice(self, lo: int, hi: int) -> Tokens:
        """Tokens ``[lo, hi)`` of this sequence, as a Tokens of their own (no read)."""
        parts, start = [], 0
        for p in self.parts:
            a, b = max(lo - start, 0), min(hi - start, p.count)
            if a < b:
                itemsize = np.dtype(p.dtype).itemsize
                parts.append(Part(p.path, p.offset + a * itemsize, b - a, p.dtype))
            start += p.count
        return Tokens(parts, self.vocab_check)

    def pieces(self, lo: int, hi: int) -> list[tuple[Part, int, int]]:
        """Where tokens ``[lo, hi)`` lie: (part, its first token's index in the part, count) per shard,
        in order. Reads nothing."""
        if not 0 <= lo <= hi <= len(self):
            raise IndexError(f"tokens [{lo}, {hi}) are outside the {len(self)} tokens")
        out, i = [], int(np.searchsorted(self.ends, lo, side="right"))
        while lo < hi:
            first = int(self.ends[i]) - self.parts[i].count
            n = min(hi, int(self.ends[i])) - lo
            out.append((self.parts[i], lo - first, n))
            lo, i = lo + n, i + 1
        return out

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Tokens ``[lo, hi)`` as an array of their dtype, read by one pread per shard they lie in."""
        pieces = [self._pread(part, first, n) for part, first, n in self.pieces(lo, hi)]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces else np.zeros(0, self.dtype)

    def __getitem__(self, key: slice) -> np.ndarray:
        """``tokens[lo:hi]``: :meth:`read` (a contiguous slice only: what a window is)."""
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("Tokens are read by contiguous slices: tokens[lo:hi]")
        lo, hi, _ = key.indices(len(self))
        return self.read(lo, max(lo, hi))

    def _pread(self, part: Part, first: int, n: int) -> np.ndarray:
        """``n`` tokens of ``part`` from its token ``first``: one pread, checked against the vocabulary."""
        itemsize = np.dtype(part.dtype).itemsize
        data = os.pread(self._fd(part.path), n * itemsize, part.offset + first * itemsize)
        if len(data) != n * itemsize:
            raise DataError(f"{part.path}: cut short while training: {len(data)} of {n * itemsize} bytes at "
                            f"byte {part.offset + first * itemsize}")
        with self._lock:
            self.bytes_read += len(data)
        tokens = np.frombuffer(data, dtype=part.dtype)
        if self.vocab_check is not None and n and int(tokens.max()) >= self.vocab_check:
            raise DataError(f"{part.path}: token id {int(tokens.max())} is outside the vocabulary of "
                            f"{self.vocab_check} (the shard changed after it was checked)")
        return tokens

    def _fd(self, path: str) -> int:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            return self._fds[path]

    def close(self) -> None:
        """Close the files (a later read opens them again)."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (at interpreter exit)
            pass


def file_tokens(path, dtype="uint8", offset: int = 0) -> Tokens:
    """The tokens of one file of ``dtype`` tokens after ``offset`` header bytes."""
    size = os.stat(path).st_size - offset
    return Tokens([Part(str(path), offset, size // np.dtype(dtype).itemsize, np.dtype(dtype).name)])
