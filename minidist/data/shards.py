"""Token shards in llm.c's format: a header of 256 int32 (magic 20240520, version 1, the token
count, the rest zero), then the tokens as uint16, little-endian.

:func:`write_shard` writes one (atomically: data/prepare.py and the tests use it); :func:`shard_part`
checks one before a run trusts it: the magic, the version, and a size that holds exactly the tokens
its header counts (a shard cut short by a full disk or a killed writer is refused, not half read).
"""
from __future__ import annotations

import os

import numpy as np

from minidist.data.tokens import DataError, Part
from minidist.files import write_atomically

MAGIC, VERSION = 20240520, 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = "uint16"  # llm.c's: a vocabulary of up to 65,536 (GPT-2's is 50,257)


def header(count: int) -> np.ndarray:
    """The (256,) int32 header of a shard of ``count`` tokens."""
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[:3] = MAGIC, VERSION, count
    return h


def write_shard(path, tokens) -> None:
    """Write ``tokens`` (ids below 65,536) to ``path`` as one llm.c shard, atomically."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2 ** 16):
        raise ValueError(f"{path}: token ids must be in [0, 65536) to be stored as uint16")
    write_atomically(path, header(tokens.size).tobytes() + tokens.astype("<u2").tobytes())


def read_header(path) -> np.ndarray | None:
    """The first 256 int32 of ``path``, or None when the file is shorter than a header."""
    with open(path, "rb") as f:
        data = f.read(HEADER_BYTES)
    return np.frombuffer(data, dtype="<i4") if len(data) == HEADER_BYTES else None


def is_shard(path) -> bool:
    """Whether ``path`` starts with llm.c's magic number."""
    h = read_header(path)
    return h is not None and int(h[0]) == MAGIC


def shard_part(path) -> Part:
    """The tokens of the llm.c shard ``path`` as a :class:`Part`, after checking its header and size;
    a :class:`DataError` naming the file and what is wrong otherwise."""
    if not os.path.isfile(path):  # missing, or a FIFO or a folder: never opened (a FIFO would block)
        raise DataError(f"{path}: {'not a regular file' if os.path.lexists(path) else 'missing'}")
    h = read_header(path)
    if h is None:
        raise DataError(f"{path}: shorter than the 1,024-byte header of an llm.c shard")
    if int(h[0]) != MAGIC:
        raise DataError(f"{path}: wrong magic number {int(h[0])} (an llm.c shard starts with {MAGIC})")
    if int(h[1]) != VERSION:
        raise DataError(f"{path}: llm.c shard version {int(h[1])}; this reads version {VERSION} (uint16 tokens)")
    count, size = int(h[2]), os.stat(path).st_size
    if count < 0 or size != HEADER_BYTES + 2 * count:
        state = "truncated" if size < HEADER_BYTES + 2 * count else "longer than its header says"
        raise DataError(f"{path}: {state}: its header counts {count:,} tokens ({HEADER_BYTES + 2 * count:,} bytes "
                        f"with the header), the file has {size:,} bytes")
    return Part(str(path), HEADER_BYTES, count, TOKEN_DTYPE)
