"""The checkpoint on disk, and how its files are written so that a crash never leaves a half-file.

    DIR/step-000123/
        rank-00000.safetensors    this rank's pieces: one tensor per (global name, box), keyed
                                  "transformer.h.0.mlp.c_fc.weight[0:128,0:64]" (safetensors: no pickle)
        rank-00000.json           for each key: global name, GLOBAL shape, dtype and box (see
                                  regions.py); the sha256 and size of the .safetensors file; rank_meta
        ...                       (one pair per rank)
        manifest.json             written LAST, by rank 0, once every rank's pair is on disk: step,
                                  world size, meta (layout, RNG states, data position, loss scale,
                                  extras), every rank file with its sha256 and size, every tensor's
                                  global shape and dtype

A step folder counts only if its manifest exists and every file it lists has the listed size and
sha256 (:func:`minidist.checkpoint.reader.verify`). Each file is written atomically: to a temporary
name, flushed, fsync'ed, renamed over the final name, and the folder fsync'ed so the rename itself
survives a power cut. So a crash at any moment leaves either the old state or the new one.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

FORMAT = "minidist-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_STEP = re.compile(r"^step-(\d+)$")


class CheckpointError(Exception):
    """A checkpoint that cannot be used (incomplete, truncated, corrupted, or not covering what is
    asked of it). The message names the file and what is wrong with it."""


def step_dir(root, step: int) -> Path:
    """``root/step-000123``: where the checkpoint of ``step`` lives."""
    return Path(root) / f"step-{step:06d}"


def step_of(path) -> int | None:
    """The step of a ``step-000123`` folder, or None for any other name."""
    m = _STEP.match(Path(path).name)
    return int(m.group(1)) if m else None


def step_dirs(root) -> list:
    """Every ``step-*`` folder under ``root``, oldest step first (empty if ``root`` does not exist)."""
    root = Path(root)
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None] if root.is_dir() else []
    return sorted(found, key=step_of)


def rank_file(rank: int) -> str:
    """Name of the tensor file of ``rank``."""
    return f"rank-{rank:05d}.safetensors"


def rank_meta_file(rank: int) -> str:
    """Name of the JSON metadata of ``rank``."""
    return f"rank-{rank:05d}.json"


def piece_key(name: str, box) -> str:
    """The safetensors key of one piece: ``name[start:stop,...]`` (``name[]`` for a 0-d tensor)."""
    return f"{name}[{','.join(f'{a}:{b}' for a, b in box)}]"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write(path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` holds either its old content or all of ``data``:
    write a temporary file beside it, flush and fsync it, rename it over ``path``, fsync the folder."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path) -> None:
    """Make the entries of folder ``path`` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def to_json(obj) -> bytes:
    return (json.dumps(obj, indent=1) + "\n").encode()
