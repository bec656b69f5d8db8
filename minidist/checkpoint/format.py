"""The checkpoint on disk, and how its files are written so that a crash never leaves a half-file.

    DIR/step-000123/
        rank-00000.safetensors    this rank's pieces: one tensor per (global name, box), keyed
                                  "transformer.h.0.mlp.c_fc.weight[0:128,0:64]" (safetensors: no pickle)
        rank-00000.json           for each key: global name, GLOBAL shape, dtype and box (see
                                  regions.py); the sha256 and size of the .safetensors file; rank_meta
        ...                       (one pair per rank)
        manifest.json             written LAST, by rank 0, once every rank's pair is on disk: step,
                                  world size, meta (layout, run identity, data position, extras),
                                  every rank file with its sha256 and size, every tensor's global
                                  shape and dtype, and ``sha256``: the checksum of all of that
                                  (:func:`manifest_digest`)

A step folder counts only if it is a real folder (not a link), its manifest passes its own checksum
and the schema (schema.py), and every file it names is a regular file inside the folder with the
listed size and sha256 (:func:`minidist.checkpoint.reader.verify`). A save writes into a fresh hidden
folder ``.saving-...`` and renames it to ``step-000123`` once the manifest is in it (writer.py); every
file is written atomically (minidist/files.py: temporary name, fsync, rename, folder fsync'ed). So a crash at any moment
leaves either the old state or the new one.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

FORMAT = "minidist-checkpoint"
VERSION = 2  # 2: the manifest carries its own sha256; saves go through a hidden folder
MANIFEST = "manifest.json"
_STEP = re.compile(r"^step-(\d+)$")


class CheckpointError(Exception):
    """A checkpoint that cannot be used (incomplete, truncated, corrupted, or not covering what is
    asked of it). The message names the file and what is wrong with it."""


class SaveStopped(CheckpointError):
    """A save that did not complete because a stop signal (``signum``) reached another rank while it
    was under way: the rank that hears it stops as that rank did (train/entry.py)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class NonFiniteError(CheckpointError):
    """A checkpoint whose tensors hold NaN or inf: the run had diverged. Never written (writer.py
    refuses it on every rank), and skipped like any other damage when read (a checkpoint written
    before that check may hold them)."""


def non_finite(array) -> int:
    """How many elements of ``array`` (NumPy) are NaN or +-inf; 0 for integer and bool dtypes."""
    array = np.asarray(array)
    return int(array.size - np.count_nonzero(np.isfinite(array))) if array.dtype.kind in "fc" else 0


def step_dir(root, step: int) -> Path:
    """``root/step-000123``: where the checkpoint of ``step`` lives."""
    return Path(root) / f"step-{step:06d}"


def step_of(path) -> int | None:
    """The step of a ``step-000123`` folder, or None for any other name."""
    m = _STEP.match(Path(path).name)
    return int(m.group(1)) if m else None


def step_dirs(root) -> list:
    """Every entry named ``step-*`` under ``root``, oldest step first (empty if ``root`` is not a
    folder). Links and files with such names are listed too, so that the reader can say why it
    refuses them; nothing here follows a link."""
    root = Path(root)
    if not root.is_dir() or root.is_symlink():
        return []
    return sorted((p for p in root.iterdir() if step_of(p) is not None), key=step_of)


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


def canonical_json(obj) -> bytes:
    """The one byte string a JSON value hashes as: sorted keys, no spaces, ASCII, no NaN."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def manifest_digest(manifest: dict) -> str:
    """The sha256 a manifest stores under ``sha256``: of its canonical JSON without that field."""
    return sha256_bytes(canonical_json({k: v for k, v in manifest.items() if k != "sha256"}))


def to_json(obj) -> bytes:
    return (json.dumps(obj, indent=1) + "\n").encode()
