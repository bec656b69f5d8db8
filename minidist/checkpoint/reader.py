"""Reading a checkpoint back, into ANY layout: the resharding engine.

A checkpoint stores boxes of global tensors (regions.py). A layout that wants its shard asks for the
box (or the :class:`~minidist.checkpoint.regions.Flat` range) it holds; :meth:`Checkpoint.read`
intersects that with every stored box of the tensor, whichever rank wrote it, and copies the overlaps
(reading only those slices from the files). Nothing in the reader knows about dp, tp, pp or ZeRO: a
checkpoint saved at (dp 2, tp 2) loads at (tp 2, pp 2) or (dp 4) because each new rank simply asks
for different boxes.

    ckpt = Checkpoint(latest_valid("ckpt"))          # verified: schema, sizes and sha256 of every file
    w = ckpt.read("transformer.h.0.mlp.c_fc.weight", ((128, 256), (0, 64)))   # (128, 64)
    full = ckpt.read_full("lm_head.weight")
"""
from __future__ import annotations

import math
import os
import struct
import sys
from pathlib import Path

import numpy as np
from safetensors import safe_open

from minidist.checkpoint.format import MANIFEST, CheckpointError, NonFiniteError, non_finite, sha256_bytes, step_dirs
from minidist.checkpoint.paths import check_folder, open_regular, read_json_bytes, sha256_file
from minidist.checkpoint.regions import (Flat, box_shape, contains, coverage_problem, flat_boxes, full_box, intersect,
                                         slices)
from minidist.checkpoint.schema import (DTYPES, check_manifest, check_rank_meta, check_safetensors_header,
                                        parse_json)

_ITEMSIZE = {code: np.dtype(name).itemsize for name, code in DTYPES.items()}


def read_manifest(step_dir) -> dict:
    """The manifest of ``step_dir``, checked: the folder is a real folder, the manifest a regular
    file that passes its own checksum and the schema (schema.py). Reads no other file."""
    step_dir = Path(step_dir)
    check_folder(step_dir)
    path = step_dir / MANIFEST
    if not os.path.lexists(path):
        raise CheckpointError(f"{path}: missing (the save never finished)")
    return check_manifest(parse_json(read_json_bytes(path), path), path, step_dir)


def verify(step_dir) -> dict:
    """The manifest of ``step_dir`` if the checkpoint is complete and intact, else CheckpointError
    naming the file and what is wrong: the manifest missing (the save never finished), unreadable,
    failing its checksum or the schema; a file it names missing, not a regular file (a link, a
    device: refused without opening it), truncated (size differs) or corrupted (sha256 differs); a
    rank's JSON or safetensors header disagreeing with the manifest; the boxes of a tensor leaving
    part of it uncovered or covering part of it twice (counting elements is not enough: boxes that
    add up may still overlap and leave a hole); a NaN or inf in any tensor (NonFiniteError)."""
    return _verified(step_dir)[0]


def _verified(step_dir) -> tuple[dict, dict]:
    """(manifest, {rank: its JSON}) of ``step_dir``, every file checked (see :func:`verify`)."""
    try:
        return _verify_files(Path(step_dir))
    except OSError as e:  # a read error, a permission, a file vanishing: this checkpoint is unusable
        raise CheckpointError(f"{e.filename or step_dir}: {e.strerror or e}") from e


def _verify_files(step_dir: Path) -> tuple[dict, dict]:
    """The manifest, then per rank: its data file's size and sha256 (regular files only), its JSON's
    size, sha256 and schema, its safetensors header; then that the boxes of every tensor cover it
    exactly once (no hole, no overlap); then that every value is finite."""
    manifest = read_manifest(step_dir)
    infos = {}
    for r, entry in enumerate(manifest["ranks"]):
        data_path, meta_path = step_dir / entry["file"], step_dir / entry["meta_file"]
        _same_digest(data_path, sha256_file(data_path, entry["bytes"]), entry["sha256"])
        with open_regular(meta_path, entry["meta_bytes"]) as f:
            data = f.read()
        _same_digest(meta_path, sha256_bytes(data), entry["meta_sha256"])
        infos[r] = check_rank_meta(parse_json(data, meta_path), meta_path, r, manifest)
        check_safetensors_header(_safetensors_header(data_path, entry["bytes"]), data_path, infos[r])
    boxes = {}
    for info in infos.values():
        for desc in info["tensors"].values():
            boxes.setdefault(desc["name"], []).append(tuple(map(tuple, desc["box"])))
    for name, spec in manifest["tensors"].items():
        problem = coverage_problem(spec["global_shape"], boxes.get(name, []))
        if problem is not None:
            raise CheckpointError(f"{step_dir / MANIFEST}: tensor {name} {spec['global_shape']} {problem}")
    for r, entry in enumerate(manifest["ranks"]):  # last: it reads every value again
        _all_finite(step_dir / entry["file"], infos[r]["tensors"])
    return manifest, infos


def _all_finite(path, pieces: dict) -> None:
    """NonFiniteError unless every value of the float ``pieces`` of safetensors file ``path`` is
    finite (one piece in memory at a time). A trainer never writes NaN or inf (writer.py), but a
    checkpoint written before that check, or by another tool, may hold them."""
    with safe_open(path, framework="np") as f:
        for key in pieces:
            try:
                array = f.get_tensor(key)
            except Exception as e:  # noqa: BLE001 -- changed on disk since it was verified
                raise CheckpointError(f"{path}: cannot read {key} ({e})") from e
            bad = non_finite(array)
            if bad:
                raise NonFiniteError(f"{path}: {key} holds {bad} NaN or inf values (the run had diverged)")


def _same_digest(path, actual: str, recorded: str) -> None:
    if actual != recorded:
        raise CheckpointError(f"{path}: checksum mismatch (sha256 {actual[:12]}..., the manifest says "
                              f"{recorded[:12]}...): the file is corrupted")


def _safetensors_header(path, size: int) -> dict:
    """{key: (shape, dtype code)} of safetensors file ``path`` (``size`` bytes), read from its
    header; CheckpointError if the header is malformed or a piece's bytes are not inside the file."""
    with open_regular(path, size) as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= size - 8:
            raise CheckpointError(f"{path}: not a safetensors file (header length {n})")
        header = parse_json(f.read(n), path)
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    try:  # and whatever else the safetensors library itself insists on
        with safe_open(path, framework="np") as f:
            f.keys()
    except Exception as e:  # noqa: BLE001 -- the library's own error types, whatever they are
        raise CheckpointError(f"{path}: not a valid safetensors file ({e})") from e
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        shape, code = (entry.get("shape"), entry.get("dtype")) if isinstance(entry, dict) else (None, None)
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        ok = (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
              and isinstance(code, str) and code in _ITEMSIZE
              and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
              and 0 <= offsets[0] <= offsets[1] <= size - 8 - n
              and offsets[1] - offsets[0] == math.prod(shape) * _ITEMSIZE[code])
        if not ok:
            raise CheckpointError(f"{path}: the safetensors entry {key!r} is malformed or outside the file")
        out[key] = (shape, code)
    return out


def latest_valid(root, log=None, accept=None):
    """The newest step folder under ``root`` that passes :func:`verify` (and ``accept(manifest,
    folder)``, if given, which raises CheckpointError for a manifest its caller cannot use), or None.
    Every newer entry that fails is skipped with one line on ``log`` (default: stderr) saying which
    file is wrong and how. Never raises for what it finds on disk."""
    found = latest_checkpoint(root, log, accept)
    return found.dir if found is not None else None


def latest_checkpoint(root, log=None, accept=None) -> "Checkpoint | None":
    """:func:`latest_valid`'s checkpoint, opened: a :class:`Checkpoint`, its files verified once."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    if Path(root).is_symlink():
        log(f"checkpoints in {root} refused: it is a symbolic link (a checkpoint never follows links)")
        return None
    try:
        found = step_dirs(root)
    except OSError as e:
        log(f"checkpoints in {root} cannot be listed: {e.strerror or e}")
        return None
    for d in reversed(found):
        try:
            ckpt = Checkpoint(d)
            if accept is not None:
                accept(ckpt.manifest, d)
            return ckpt
        except CheckpointError as e:
            log(f"checkpoint {d.name} skipped: {e}")
    return None


class Checkpoint:
    """One verified checkpoint folder, indexed: for every global tensor, which rank file holds which
    boxes of it. ``step``, ``meta`` (the manifest's meta dict), ``world_size`` and ``names``."""

    def __init__(self, step_dir):
        self.dir = Path(step_dir)
        self.manifest, infos = _verified(self.dir)
        self.step, self.meta = self.manifest["step"], self.manifest["meta"]
        self.world_size = self.manifest["world_size"]
        self.rank_meta, self._pieces = {}, {}  # name -> [(file, key, box)]
        for r, info in infos.items():
            self.rank_meta[r] = info["rank_meta"]
            for key, desc in info["tensors"].items():
                self._pieces.setdefault(desc["name"], []).append(
                    (self.dir / info["file"], key, tuple(map(tuple, desc["box"]))))

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
        for path, key, stored in self._pieces.get(name, []):
            overlap = intersect(stored, box)
            if overlap is None:
                continue
            try:
                with safe_open(path, framework="np") as f:
                    out[slices(overlap, box)] = f.get_slice(key)[slices(overlap, stored)] if box else f.get_tensor(key)
            except Exception as e:  # noqa: BLE001 -- changed on disk since it was verified
                raise CheckpointError(f"{path}: cannot read {key} ({e})") from e
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

