"""Saving a sharded checkpoint: every rank writes its own pieces; rank 0 commits with the manifest.

What a save sends: one barrier (every rank's files are on disk) and one broadcast of one integer from
rank 0 (the manifest is written: the checkpoint counts), both on the writer's OWN group, split off
the training group when the writer is built. That is what lets an asynchronous save run in a
background thread while training keeps calling collectives on its own groups: the two threads never
share a group, so their collectives cannot interleave in different orders on different ranks (the
reason PyTorch's async checkpointing also wants a separate process group).

    writer = CheckpointWriter("ckpt", world, keep=2)
    writer.save(step, pieces, meta={"layout": {...}, "data_position": step + 1})   # blocking
    writer.save(step, pieces, meta, async_=True)  # copies the arrays, returns, writes in background
    writer.wait()                                 # before exiting; a save also waits for the previous
"""
from __future__ import annotations

import json
import math
import shutil
import threading

import numpy as np
from safetensors.numpy import save as safetensors_bytes

from minidist.checkpoint.format import (FORMAT, MANIFEST, VERSION, CheckpointError, atomic_write, piece_key,
                                        rank_file, rank_meta_file, sha256_bytes, sha256_file, step_dir, step_dirs,
                                        step_of, to_json)
from minidist.checkpoint.regions import Flat, box_shape, contains, flat_boxes, full_box, slices


class CheckpointWriter:
    """Writes checkpoints of ``group``'s ranks under ``root`` and keeps the newest ``keep`` of them.

    Building it is collective over ``group`` (one ``split``: the writer's own group). Older
    checkpoints are removed by rank 0 only after a newer one is complete.
    """

    def __init__(self, root, group, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the checkpoint just written), got {keep}")
        self.root, self.keep = root, keep
        self.group = group.split(0, name="checkpoint")
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, step: int, pieces, meta: dict | None = None, rank_meta: dict | None = None,
             async_: bool = False) -> None:
        """Save this rank's ``pieces`` (:class:`~minidist.checkpoint.regions.Piece`: global name,
        array, global shape, region) as checkpoint ``step``. ``meta`` (JSON; rank 0's is kept) goes
        into the manifest, ``rank_meta`` into this rank's JSON. Collective over the writer's group.

        Blocking: returns once the checkpoint counts on every rank. ``async_``: copies every array
        (so training may overwrite its parameters at once), returns, and writes in a background
        thread; :meth:`wait` joins it and re-raises its error. Either way, a save first waits for
        the previous one."""
        self.wait()
        entries = _entries(pieces, copy=async_)  # {key: (array, json description)}
        if not async_:
            self._write(step, entries, meta or {}, rank_meta or {})
            return
        self._thread = threading.Thread(target=self._background, args=(step, entries, meta or {}, rank_meta or {}),
                                        name=f"checkpoint step {step}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _background(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # noqa: BLE001 -- re-raised by wait()
            self._error = e

    def _write(self, step: int, entries: dict, meta: dict, rank_meta: dict) -> None:
        rank, folder = self.group.rank, step_dir(self.root, step)
        folder.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            (folder / MANIFEST).unlink(missing_ok=True)  # a stale save of the same step no longer counts
        data = safetensors_bytes({key: array for key, (array, _) in entries.items()})
        atomic_write(folder / rank_file(rank), data)
        atomic_write(folder / rank_meta_file(rank), to_json(dict(
            format=FORMAT, version=VERSION, rank=rank, step=step, file=rank_file(rank), bytes=len(data),
            sha256=sha256_bytes(data), tensors={key: desc for key, (_, desc) in entries.items()},
            rank_meta=rank_meta)))
        self.group.barrier()  # every rank's files are on disk
        ok = np.zeros(1, np.int64)
        problem = None
        if rank == 0:
            try:
                atomic_write(folder / MANIFEST, to_json(_manifest(folder, step, self.group.size, meta)))
                ok[0] = 1
            except Exception as e:  # noqa: BLE001 -- the other ranks must hear of it, not hang
                problem = e
        self.group.broadcast(ok, src=0)  # the checkpoint counts (or not) on every rank
        if problem is not None:
            raise problem
        if not ok[0]:
            raise CheckpointError(f"{folder}: rank 0 could not commit the checkpoint (see rank 0's error)")
        if rank == 0:
            self._remove_old(step)

    def _remove_old(self, step: int) -> None:
        """Keep the newest ``keep`` complete checkpoints up to ``step``; remove every other folder
        older than ``step`` (older complete ones and crashed, incomplete saves)."""
        older = [d for d in step_dirs(self.root) if step_of(d) <= step]
        complete = [d for d in older if (d / MANIFEST).exists()]
        kept = set(complete[-self.keep:])
        for d in older:
            if d not in kept:
                shutil.rmtree(d, ignore_errors=True)


def _entries(pieces, copy: bool) -> dict:
    """{safetensors key: (contiguous array, its JSON description)} for ``pieces``, with every
    :class:`Flat` range cut into boxes. ``copy``: snapshot the arrays (asynchronous saves)."""
    entries = {}
    for name, data, global_shape, region in pieces:
        data, global_shape = np.asarray(data), tuple(int(n) for n in global_shape)
        if isinstance(region, Flat):
            if data.shape != (region.hi - region.lo,):
                raise ValueError(f"{name}: a Flat region {region.lo}:{region.hi} needs a 1-D array of "
                                 f"{region.hi - region.lo} elements, got shape {data.shape}")
            boxes, offset = flat_boxes(tuple(map(tuple, region.box)), region.lo, region.hi), 0
            parts = []
            for box in boxes:
                n = math.prod(box_shape(box))
                parts.append((box, data[offset:offset + n].reshape(box_shape(box))))
                offset += n
        else:
            box = tuple(tuple(int(v) for v in pair) for pair in region)
            if data.shape != box_shape(box):
                raise ValueError(f"{name}: region {box} has shape {box_shape(box)}, the array {data.shape}")
            parts = [(box, data)]
        for box, array in parts:
            if len(box) != len(global_shape) or not contains(full_box(global_shape), box):
                raise ValueError(f"{name}: region {box} does not lie inside the global shape {global_shape}")
            key = piece_key(name, box)
            if key in entries:
                raise ValueError(f"{name}: region {box} given twice")
            array = np.array(array, copy=True, order="C") if copy else np.asarray(array, order="C")
            entries[key] = (array, dict(name=name, global_shape=list(global_shape), dtype=str(array.dtype),
                                        box=[list(pair) for pair in box]))
    return entries


def _manifest(folder, step: int, world_size: int, meta: dict) -> dict:
    """Rank 0's commit record: every rank's files with their checksums, every tensor's global shape
    and dtype. Raises CheckpointError if the ranks disagree on a tensor or leave part of one unwritten."""
    ranks, tensors, boxes = [], {}, {}
    for r in range(world_size):
        meta_path = folder / rank_meta_file(r)
        info = json.loads(meta_path.read_text())
        ranks.append(dict(rank=r, file=info["file"], bytes=info["bytes"], sha256=info["sha256"],
                          meta_file=meta_path.name, meta_bytes=meta_path.stat().st_size,
                          meta_sha256=sha256_file(meta_path)))
        for desc in info["tensors"].values():
            name, spec = desc["name"], dict(global_shape=desc["global_shape"], dtype=desc["dtype"])
            if tensors.setdefault(name, spec) != spec:
                raise CheckpointError(f"{folder}: rank {r} writes {name} as {spec}, another rank as {tensors[name]}")
            boxes.setdefault(name, []).append(tuple(map(tuple, desc["box"])))
    for name, spec in tensors.items():
        covered = np.zeros(spec["global_shape"], dtype=bool)
        for box in boxes[name]:
            covered[slices(box, full_box(covered.shape))] = True
        if not covered.all():
            missing = np.argwhere(~covered)[0].tolist() if covered.ndim else []
            raise CheckpointError(f"{folder}: no rank wrote all of {name} {tuple(spec['global_shape'])}: "
                                  f"{int((~covered).sum())} elements missing, the first at {missing}")
    return dict(format=FORMAT, version=VERSION, step=step, world_size=world_size, meta=meta, ranks=ranks,
                tensors=tensors)
