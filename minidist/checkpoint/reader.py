"""Reading a checkpoint back, into ANY layout: the resharding engine.

A checkpoint stores boxes of global tensors (regions.py). A layout that wants its shard asks for the
box (or the :class:`~minidist.checkpoint.regions.Flat` range) it holds; :meth:`Checkpoint.read`
intersects that with every stored box of the tensor, whichever rank wrote it, and copies the overlaps
(reading only those slices from the files). Nothing in the reader knows about dp, tp, pp or ZeRO: a
checkpoint saved at (dp 2, tp 2) loads at (tp 2, pp 2) or (dp 4) because each new rank simply asks
for different boxes.

    ckpt = Checkpoint(latest_valid("ckpt"))          # verified: sizes and sha256 of every file
    w = ckpt.read("transformer.h.0.mlp.c_fc.weight", ((128, 256), (0, 64)))   # (128, 64)
    full = ckpt.read_full("lm_head.weight")
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
from safetensors import safe_open

from minidist.checkpoint.format import FORMAT, MANIFEST, VERSION, CheckpointError, sha256_file, step_dirs
from minidist.checkpoint.regions import Flat, box_shape, contains, flat_boxes, full_box, intersect, slices


def verify(step_dir) -> dict:
    """The manifest of ``step_dir`` if the checkpoint is complete and intact, else CheckpointError
    naming the file and what is wrong: manifest missing (the save never finished) or unreadable, a
    rank file missing, truncated (size differs) or corrupted (sha256 differs)."""
    step_dir = Path(step_dir)
    path = step_dir / MANIFEST
    if not path.exists():
        raise CheckpointError(f"{path}: missing (the save never finished)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable JSON ({e})") from e
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: not a {FORMAT} version {VERSION} manifest")
    for r in manifest["ranks"]:
        for name, size, digest in ((r["file"], r["bytes"], r["sha256"]),
                                   (r["meta_file"], r["meta_bytes"], r["meta_sha256"])):
            f = step_dir / name
            if not f.exists():
                raise CheckpointError(f"{f}: missing")
            if f.stat().st_size != size:
                raise CheckpointError(f"{f}: truncated or overwritten: {f.stat().st_size} bytes, the manifest "
                                      f"says {size}")
            if sha256_file(f) != digest:
                raise CheckpointError(f"{f}: checksum mismatch (sha256 {sha256_file(f)[:12]}..., the manifest "
                                      f"says {digest[:12]}...): the file is corrupted")
    return manifest


def latest_valid(root, log=None):
    """The newest step folder under ``root`` that passes :func:`verify`, or None. Every newer folder
    that fails is skipped with one line on ``log`` (default: stderr) saying which file is wrong and
    how, and which checkpoint is used instead."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    for d in reversed(step_dirs(root)):
        try:
            verify(d)
            return d
        except CheckpointError as e:
            log(f"checkpoint {d.name} skipped: {e}")
    return None


class Checkpoint:
    """One verified checkpoint folder, indexed: for every global tensor, which rank file holds which
    boxes of it. ``step``, ``meta`` (the manifest's meta dict), ``world_size`` and ``names``."""

    def __init__(self, step_dir, verify_checksums: bool = True):
        self.dir = Path(step_dir)
        self.manifest = verify(self.dir) if verify_checksums else json.loads((self.dir / MANIFEST).read_text())
        self.step, self.meta = self.manifest["step"], self.manifest["meta"]
        self.world_size = self.manifest["world_size"]
        self.rank_meta, self._pieces = {}, {}  # name -> [(file, key, box)]
        for r in self.manifest["ranks"]:
            info = json.loads((self.dir / r["meta_file"]).read_text())
            self.rank_meta[r["rank"]] = info["rank_meta"]
            for key, desc in info["tensors"].items():
                self._pieces.setdefault(desc["name"], []).append(
                    (self.dir / r["file"], key, tuple(map(tuple, desc["box"]))))

    @property
    def names(self) -> list:
        """Every global tensor name in the checkpoint, sorted."""
        return sorted(self.manifest["tensors"])

    def global_shape(self, name: str) -> tuple:
        return tuple(self._spec(name)["global_shape"])

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(self._spec(name)["dtype"])

    def read(self, name: str, region):
        """The part ``region`` (a box, or a :class:`Flat` range: then a 1-D array) of global tensor
        ``name``, assembled from every stored box that overlaps it. CheckpointError if the region
        leaves the tensor or some of it was never written."""
        if isinstance(region, Flat):
            boxes = flat_boxes(tuple(map(tuple, region.box)), region.lo, region.hi)
            parts = [self.read(name, box).reshape(-1) for box in boxes]
            return np.concatenate(parts) if parts else np.zeros(0, self.dtype(name))
        box = tuple(tuple(int(v) for v in pair) for pair in region)
        shape = self.global_shape(name)
        if len(box) != len(shape) or not contains(full_box(shape), box):
            raise CheckpointError(f"{self.dir}: region {box} is not inside {name} {shape}")
        out = np.zeros(box_shape(box), self.dtype(name))
        covered = np.zeros(out.shape, dtype=bool)
        for path, key, stored in self._pieces[name]:
            overlap = intersect(stored, box)
            if overlap is None:
                continue
            with safe_open(path, framework="np") as f:
                out[slices(overlap, box)] = f.get_slice(key)[slices(overlap, stored)] if box else f.get_tensor(key)
            covered[slices(overlap, box)] = True
        if not covered.all():
            raise CheckpointError(f"{self.dir}: {int((~covered).sum())} of {math.prod(out.shape)} elements of "
                                  f"{name}{list(box)} are in no rank file")
        return out

    def read_full(self, name: str):
        """The whole global tensor ``name``."""
        return self.read(name, full_box(self.global_shape(name)))

    def _spec(self, name: str) -> dict:
        if name not in self.manifest["tensors"]:
            raise CheckpointError(f"{self.dir}: no tensor named {name!r} (it holds {len(self.names)} tensors, "
                                  f"e.g. {self.names[:3]})")
        return self.manifest["tensors"][name]


def read(step_dir, name: str, region):
    """Region ``region`` of tensor ``name`` from the checkpoint in ``step_dir`` (see :meth:`Checkpoint.read`)."""
    return Checkpoint(step_dir).read(name, region)


def read_full(step_dir, name: str):
    """The whole tensor ``name`` from the checkpoint in ``step_dir``."""
    return Checkpoint(step_dir).read_full(name)

