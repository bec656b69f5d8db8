"""The folders and files a run writes: checked at start-up, and held for its lifetime.

Every output path is checked before the first step (:func:`output_problems`), so a run never trains
for an hour and then finds it cannot write its result. The folders two runs must never share are
held with an advisory lock (:class:`minidist.folder_lock.FolderLock`) from start-up to the end: the
checkpoint folder by rank 0 (checkpoints live on a filesystem every rank sees), each rank's own
folder under ``--offload-dir`` by that rank (it may be a disk of its machine alone).
"""
from __future__ import annotations

import contextlib

import numpy as np

from minidist.checkpoint.paths import ckpt_dir_problems
from minidist.files import PathRefused, file_problems, folder_problems
from minidist.comm.machines import Machines
from minidist.folder_lock import FolderInUse, FolderLock, holder_token
from minidist.parallel.zero.offload import rank_folder


class FoldersInUse(RuntimeError):
    """Another live run holds a folder this run needs (exit 2: nothing was written)."""


class FolderNotShared(RuntimeError):
    """A rank on another machine than rank 0 does not see rank 0's ``--ckpt-dir`` (exit 2: nothing
    was written)."""


def output_problems(cfg) -> list[str]:
    """What is wrong with the paths ``cfg`` writes, found at start-up: ``--export`` and the metrics,
    trace, checkpoint, offload and Hugging Face folders (a link, a file where a folder goes, a folder
    where a file goes, no permission)."""
    found = file_problems("--export", cfg.export) if cfg.export is not None else []
    for flag, folder in (("--export-hf", cfg.export_hf), ("--out", cfg.out), ("--trace", cfg.trace),
                         ("--offload-dir", cfg.offload_dir)):
        found += folder_problems(flag, folder) if folder is not None else []
    return found + (ckpt_dir_problems(cfg.ckpt_dir) if cfg.ckpt_dir is not None else [])


@contextlib.contextmanager
def held_folders(cfg, world, machines: Machines | None = None):
    """A context in which this run holds its ``--ckpt-dir`` (rank 0) and its ranks' folders under
    ``--offload-dir`` (each rank its own), or :class:`FoldersInUse` on every rank if any rank found
    one held by another run. Collective over ``world`` when either flag is given: one all-reduce
    (max) of one int64, every rank's "which of my folders is taken" (sends nothing otherwise). When
    ``machines`` (``comm/machines.py``) are several and ``--ckpt-dir`` is given, also one broadcast
    of rank 0's lock token (int64) and one all-reduce (max) of one int64: a rank on another machine
    that does not find the token in the folder's lock raises :class:`FolderNotShared`, on every rank."""
    if cfg.ckpt_dir is None and cfg.offload_dir is None:
        yield
        return
    wanted = ([("--ckpt-dir", cfg.ckpt_dir)] if cfg.ckpt_dir is not None and world.rank == 0 else []) + \
             ([("--offload-dir", rank_folder(cfg.offload_dir, world.rank))] if cfg.offload_dir is not None else [])
    locks, refusal = [], ""
    for flag, folder in wanted:
        try:
            locks.append(FolderLock(folder, flag))
        except (FolderInUse, PathRefused) as e:  # a link planted at a rank's folder: refused like a holder
            refusal = str(e)
    taken = np.array([world.rank + 1 if refusal else 0], np.int64)  # (1,)
    world.all_reduce(taken, op="max", label="setup: which rank found its folder held by another run")
    try:
        if taken[0]:
            raise FoldersInUse(refusal or f"rank {int(taken[0]) - 1} found its folder held by another run (its "
                                          "message names the holder)")
        if cfg.ckpt_dir is not None and machines is not None and machines.count > 1:
            check_shared(cfg.ckpt_dir, world, machines, locks[0].token if world.rank == 0 else 0)
        yield
    finally:
        for lock in locks:
            lock.release()


def check_shared(ckpt_dir, world, machines: Machines, token: int) -> None:
    """Raise :class:`FolderNotShared` on every rank unless every rank on another machine than rank
    0 finds rank 0's lock ``token`` (rank 0's argument) in ``ckpt_dir``: a checkpoint is one folder
    that every rank writes its files into and rank 0 then reads, so it must be the same folder on
    every machine. Collective: one broadcast of the token (int64) from rank 0, one all-reduce (max)
    of the first rank that does not see it, plus one (int64)."""
    shared = np.array([token], np.int64)  # (1,)
    world.broadcast(shared, src=0, label="setup: rank 0's token in the checkpoint folder's lock, to every rank")
    elsewhere = machines.of_rank[world.rank] != machines.of_rank[0]
    blind = np.array([world.rank + 1 if elsewhere and holder_token(ckpt_dir) != int(shared[0]) else 0], np.int64)
    world.all_reduce(blind, op="max", label="setup: which rank does not see rank 0's checkpoint folder")
    if blind[0]:
        rank = int(blind[0]) - 1
        raise FolderNotShared(
            f"--ckpt-dir {ckpt_dir} is not one folder that every machine sees: rank {rank} (machine "
            f"{machines.of_rank[rank]}) does not find in it the lock rank 0 holds there (machine 0). Every rank writes "
            f"its checkpoint files into that folder and rank 0 then reads them all: put it on a file system every "
            f"machine mounts (NFS, Lustre, ...)")
