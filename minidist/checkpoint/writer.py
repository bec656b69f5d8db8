"""Saving a sharded checkpoint: every rank writes its own pieces; rank 0 commits with the manifest.

Where a save writes: into a fresh hidden folder ``ROOT/.saving-<session>-<n>-step-000123`` (the
session is a random number rank 0 draws when the writer is built, so no earlier save, crashed or
planted, has that name); every rank writes its pair of files there; rank 0 writes the manifest and
renames the folder to ``step-000123``. A stale entry of that name (an incomplete or corrupt save, or
a link planted there) is moved aside or unlinked first, never followed; nothing is written outside
``ROOT``. What a save never writes: a tensor holding NaN or inf (the run had diverged): every rank
then raises :class:`~minidist.checkpoint.format.NonFiniteError`, and the newest checkpoint stays the
last one saved before the divergence. Nor pieces that miss part of a tensor or hold part of it twice
(the reader's rule, ``regions.coverage_problem``).

What a save sends: one all-reduce (max) of one integer per rank (every rank's files are on disk, or
which ranks failed to write them: every rank then raises, none waits for the others forever) and one
broadcast of one integer from rank 0 (the checkpoint is committed: it counts), both on the writer's
OWN group, split off the training group when the writer is built (with one broadcast of the session
number). That is what lets an asynchronous save run in a background thread while training keeps
calling collectives on its own groups: the two threads never share a group, so their collectives
cannot interleave in different orders on different ranks (the reason PyTorch's async checkpointing
also wants a separate process group). A stop signal that reaches a rank during a save (its
:meth:`CheckpointWriter.abandon`) travels in those two integers: every other rank's save then raises
:class:`~minidist.checkpoint.format.SaveStopped`, and it stops as that rank did, instead of failing.

    writer = CheckpointWriter("ckpt", world, keep=2)
    writer.save(step, pieces, meta={"layout": {...}, "data_position": step})   # blocking
    writer.save(step, pieces, meta, async_=True)  # copies the arrays, returns, writes in background
    writer.wait()                                 # before exiting; a save also waits for the previous
"""
from __future__ import annotations

import math
import os
import secrets
import sys
import threading
from pathlib import Path

import numpy as np
from safetensors.numpy import save as safetensors_bytes

from minidist.checkpoint.format import (FORMAT, MANIFEST, VERSION, CheckpointError, NonFiniteError, SaveStopped,
                                        manifest_digest, non_finite, piece_key, rank_file, rank_meta_file, sha256_bytes,
                                        step_dir, step_dirs, step_of, to_json)
from minidist.checkpoint.paths import check_folder, check_regular, read_json_bytes, remove_entry
from minidist.checkpoint.reader import read_manifest
from minidist.checkpoint.regions import Flat, box_shape, contains, coverage_problem, flat_boxes, full_box
from minidist.checkpoint.schema import DTYPES, check_manifest, parse_json
from minidist.files import fsync_folder, write_atomically
from minidist.waiting import join

LEFTOVERS = (".saving-", ".replaced-", ".abandoned-")  # hidden folders of saves that crashed or stopped half-way
NON_FINITE = 2  # a rank's failure code when its tensors hold NaN or inf (any other failure: 1)
STOPPED = 100  # ... and STOPPED + n when stop signal n reached it during the save (its abandon(n))


class CheckpointWriter:
    """Writes checkpoints of ``group``'s ranks under ``root`` and keeps the newest ``keep`` of them.

    Building it is collective over ``group``: one ``split`` (the writer's own group) and one
    broadcast of one integer (the session number that names its save folders). Older checkpoints,
    and leftovers of crashed saves, are removed by rank 0 only after a newer one is complete.
    """

    def __init__(self, root, group, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the checkpoint just written), got {keep}")
        self.root, self.keep = Path(root), keep
        self.group = group.split(0, name="checkpoint")
        session = np.array([secrets.randbits(62) if self.group.rank == 0 else 0], np.int64)
        self.group.broadcast(session, src=0, label="setup: the checkpoint session number, from rank 0")
        self._session, self._saves = f"{int(session[0]):016x}", 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._abandoned, self._abandoning = False, threading.Lock()  # a stop: no save folder made or committed after it
        self._stop_signal = 0  # the stop signal that abandoned the saves (0: none, or not a signal)

    def save(self, step: int, pieces, meta: dict | None = None, rank_meta: dict | None = None,
             async_: bool = False) -> None:
        """Save this rank's ``pieces`` (:class:`~minidist.checkpoint.regions.Piece`: global name,
        array, global shape, region) as checkpoint ``step``. ``meta`` (JSON; rank 0's is kept) goes
        into the manifest, ``rank_meta`` into this rank's JSON. Collective over the writer's group:
        sends one all-reduce and one broadcast of a few integers (module docstring).

        Blocking: returns once the checkpoint counts on every rank. ``async_``: copies every array
        (so training may overwrite its parameters at once), returns, and writes in a background
        thread; :meth:`wait` joins it and re-raises its error. Either way, a save first waits for
        the previous one."""
        self.wait()
        if not (isinstance(step, int) and step >= 0):
            raise ValueError(f"a checkpoint's step must be an int >= 0, got {step!r}")
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
            join(self._thread)
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def leftovers(self) -> list[Path]:
        """Rank 0: the hidden folders of saves that other sessions left unfinished (a run stopped or
        killed during a save), removed; every other rank: none. Only for a root this run holds alone
        (the trainer's --ckpt-dir, held by its lock): another live writer's save would look the same.
        Sends nothing."""
        if self.group.rank != 0 or not self.root.is_dir():
            return []
        found = sorted(e for e in self.root.iterdir() if e.name.startswith(LEFTOVERS) and f"-{self._session}-" not in e.name)
        for entry in found:
            remove_entry(entry)
        return found

    def abandon(self, signum: int = 0) -> None:
        """The run stops (a signal, a failure) with a save perhaps under way: this session's unfinished
        save folders are taken away, each by one atomic rename (so rank 0's commit, also a rename of the
        folder, and a removal by any rank cannot both happen: one of the two renames finds nothing) and
        then removed. This rank's background save can neither write into a save folder nor commit one
        after this returns (both happen under the lock this takes); the last rank to abandon removes what
        any rank wrote. The background save is not waited for: its peers may be gone, and a stop does not
        wait on them. ``signum``: the stop signal's number, when one stopped the run: a background save
        that meets the stop tells the other ranks so in its collectives (:data:`STOPPED`), and each of them
        raises :class:`~minidist.checkpoint.format.SaveStopped`, to stop alike instead of failing.
        Sends nothing itself."""
        with self._abandoning:
            self._abandoned, self._stop_signal = True, signum
            for entry in self.root.glob(f".saving-{self._session}-*") if self.root.is_dir() else ():
                dead = entry.with_name(f".abandoned-{self.group.rank}-{entry.name}")
                try:
                    os.rename(entry, dead)
                except FileNotFoundError:  # committed, or taken away by another rank, meanwhile
                    continue
                remove_entry(dead)

    def _background(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # noqa: BLE001 -- re-raised by wait()
            self._error = e

    def _write(self, step: int, entries: dict, meta: dict, rank_meta: dict) -> None:
        rank = self.group.rank
        self._saves += 1
        staging = self.root / f".saving-{self._session}-{self._saves}-step-{step:06d}"
        failed, problem = np.zeros(self.group.size, np.int64), None
        try:
            self._write_rank_files(staging, rank, step, entries, rank_meta)
        except Exception as e:  # noqa: BLE001 -- the other ranks must hear of it, not hang
            problem, failed[rank] = e, self._stopped_code() or (NON_FINITE if isinstance(e, NonFiniteError) else 1)
        self.group.all_reduce(failed, op="max", label="setup: which ranks failed to write their checkpoint files")
        if failed.any() and rank == 0:
            remove_entry(staging)  # every rank is past its writes
        if problem is not None:
            raise problem
        if failed.max() >= STOPPED:  # a stop signal reached a rank during its writes: stop alike
            raise SaveStopped(f"checkpoint {step} not saved: rank {int(failed.argmax())} was stopped",
                              int(failed.max()) - STOPPED)
        if (failed == NON_FINITE).any():  # every rank raises the same kind of error: the run diverged
            raise NonFiniteError(f"checkpoint {step} not written: rank(s) {np.flatnonzero(failed == NON_FINITE).tolist()} "
                                 "hold NaN or inf values (the run had diverged)")
        if failed.any():
            raise CheckpointError(f"{staging}: rank(s) {np.flatnonzero(failed).tolist()} could not write their "
                                  f"files (see their errors); checkpoint {step} not saved")
        ok = np.zeros(1, np.int64)
        if rank == 0:
            try:
                self._commit(staging, step, meta)
                ok[0] = 1
            except Exception as e:  # noqa: BLE001 -- the other ranks must hear of it, not hang
                problem, ok[0] = e, self._stopped_code()
                remove_entry(staging)
        self.group.broadcast(ok, src=0, label="setup: whether rank 0 committed the checkpoint")
        if problem is not None:
            raise problem
        if ok[0] >= STOPPED:  # a stop signal reached rank 0 before its commit: stop alike
            raise SaveStopped(f"checkpoint {step} not committed: rank 0 was stopped", int(ok[0]) - STOPPED)
        if not ok[0]:
            raise CheckpointError(f"{staging}: rank 0 could not commit the checkpoint (see rank 0's error)")
        if rank == 0:
            try:
                self._remove_old(step)
            except OSError as e:  # the new checkpoint counts; an old one left behind is no reason to stop
                print(f"checkpoint: could not remove old checkpoints in {self.root}: {e}", file=sys.stderr, flush=True)

    def _stopped_code(self) -> int:
        """STOPPED + the signal's number if a stop signal abandoned this rank's saves, else 0."""
        return STOPPED + self._stop_signal if self._abandoned and self._stop_signal else 0

    def _write_rank_files(self, staging: Path, rank: int, step: int, entries: dict, rank_meta: dict) -> None:
        """This rank's tensors and their description, into the save folder (made by whichever rank
        gets there first; it must be a real folder inside a real root). NonFiniteError, before
        anything is written, if a tensor holds NaN or inf: a diverged run never becomes a checkpoint."""
        for key, (array, _) in entries.items():
            bad = non_finite(array)
            if bad:
                raise NonFiniteError(f"checkpoint {step} not written: {key} holds {bad} NaN or inf values on rank "
                                     f"{rank} (the run had diverged)")
        if self.root.is_symlink():
            raise CheckpointError(f"{self.root}: a symbolic link (refused: a checkpoint never follows links)")
        data = safetensors_bytes({key: array for key, (array, _) in entries.items()})
        with self._abandoning:  # a stop's abandon() comes before this rank writes into the folder, or after
            if self._abandoned:
                raise CheckpointError(f"checkpoint {step} not written: the run is stopping")
            staging.mkdir(parents=True, exist_ok=True)
            check_folder(staging)
            write_atomically(staging / rank_file(rank), data)
            write_atomically(staging / rank_meta_file(rank), to_json(dict(
                format=FORMAT, version=VERSION, rank=rank, step=step, file=rank_file(rank), bytes=len(data),
                sha256=sha256_bytes(data), tensors={key: desc for key, (_, desc) in entries.items()},
                rank_meta=rank_meta)))

    def _commit(self, staging: Path, step: int, meta: dict) -> None:
        """Rank 0: the manifest into the save folder, then the folder renamed to ``step-NNNNNN``. An
        entry already of that name is moved aside (a folder) or unlinked (a link or file: its target
        is never touched), and removed once the new checkpoint is in place."""
        target = step_dir(self.root, step)
        manifest = _manifest(staging, step, self.group.size, meta)
        check_manifest(manifest, staging / MANIFEST, target)  # never commit what the reader would refuse
        old = None
        with self._abandoning:  # a stop's abandon() either comes before (nothing committed) or after (committed)
            if self._abandoned:
                raise CheckpointError(f"checkpoint {step} not committed: the run is stopping")
            write_atomically(staging / MANIFEST, to_json(manifest))
            if os.path.lexists(target):
                if target.is_dir() and not target.is_symlink():
                    old = self.root / f".replaced-{self._session}-{self._saves}-step-{step:06d}"
                    os.rename(target, old)
                else:
                    target.unlink()
            os.rename(staging, target)
        fsync_folder(self.root)
        if old is not None:
            remove_entry(old)

    def _remove_old(self, step: int) -> None:
        """Keep the newest ``keep`` committed checkpoints up to ``step``; remove every other entry
        older than ``step`` (older checkpoints, crashed or corrupt saves, links: unlinked, never
        followed) and the hidden folders of earlier sessions' crashed saves."""
        older = [d for d in step_dirs(self.root) if step_of(d) <= step]
        kept = set([d for d in older if _committed(d)][-self.keep:])
        for d in older:
            if d not in kept:
                remove_entry(d)
        self.leftovers()  # not this session's: the other ranks may be writing the next save


def _committed(folder) -> bool:
    """Whether ``folder`` is a real folder holding a manifest that passes its checksum and the
    schema (its data files are not read: that is the reader's full :func:`verify`)."""
    try:
        read_manifest(folder)
        return True
    except CheckpointError:
        return False


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
            if str(array.dtype) not in DTYPES:
                raise ValueError(f"{name}: dtype {array.dtype} is not one a checkpoint holds ({', '.join(DTYPES)})")
            entries[key] = (array, dict(name=name, global_shape=list(global_shape), dtype=str(array.dtype),
                                        box=[list(pair) for pair in box]))
    return entries


def _manifest(folder, step: int, world_size: int, meta: dict) -> dict:
    """Rank 0's commit record: every rank's files with their checksums, every tensor's global shape
    and dtype. Raises CheckpointError if the ranks disagree on a tensor or leave part of one unwritten."""
    ranks, tensors, boxes = [], {}, {}
    for r in range(world_size):
        meta_path = folder / rank_meta_file(r)
        raw = read_json_bytes(meta_path)
        info = parse_json(raw, meta_path)
        check_regular(folder / info["file"], info["bytes"])
        ranks.append(dict(rank=r, file=info["file"], bytes=info["bytes"], sha256=info["sha256"],
                          meta_file=meta_path.name, meta_bytes=len(raw), meta_sha256=sha256_bytes(raw)))
        for desc in info["tensors"].values():
            name, spec = desc["name"], dict(global_shape=desc["global_shape"], dtype=desc["dtype"])
            if tensors.setdefault(name, spec) != spec:
                raise CheckpointError(f"{folder}: rank {r} writes {name} as {spec}, another rank as {tensors[name]}")
            boxes.setdefault(name, []).append(tuple(map(tuple, desc["box"])))
    for name, spec in tensors.items():  # the reader's rule (reader.verify): every element exactly once
        problem = coverage_problem(spec["global_shape"], boxes[name])
        if problem is not None:
            raise CheckpointError(f"{folder}: the ranks do not write each element of {name} exactly once: tensor "
                                  f"{name} {spec['global_shape']} {problem}")
    manifest = dict(format=FORMAT, version=VERSION, step=step, world_size=world_size, meta=meta, ranks=ranks,
                    tensors=tensors)
    return {**manifest, "sha256": manifest_digest(manifest)}
