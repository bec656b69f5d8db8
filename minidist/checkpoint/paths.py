"""What a checkpoint may touch on disk: its own folder, and plain regular files inside it.

Nothing read from a checkpoint is trusted to name a place: a file name in a manifest must be exactly
the name the writer gives it (``rank-00003.safetensors``: no separators, no ``..``, schema.py), and
before a file is opened it must be a regular file (``lstat``: not a link, not a device, not a fifo)
of the recorded size. It is then opened with ``O_NOFOLLOW`` and checked again on the open
descriptor, so a file swapped for a link in between is refused rather than followed. Step folders
and the checkpoint root must be real folders, not links. Removing an old checkpoint never follows a
link either: a link is unlinked, a real folder removed with ``shutil.rmtree`` (which does not
descend into links).
"""
from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from minidist.checkpoint.format import CheckpointError
from minidist.files import folder_problems, kind_of
from minidist.untrusted import read_bounded, sha256_stream

MAX_JSON_BYTES = 64 << 20  # a manifest or rank JSON larger than this is not one we wrote


def check_folder(path) -> None:
    """CheckpointError unless ``path`` is a real folder (not a link to one)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError as e:
        raise CheckpointError(f"{path}: {e.strerror}") from e
    if stat.S_ISLNK(mode):
        raise CheckpointError(f"{path}: a symbolic link (refused: a checkpoint never leaves its folder)")
    if not stat.S_ISDIR(mode):
        raise CheckpointError(f"{path}: not a folder")


def check_regular(path, size: int | None = None) -> None:
    """CheckpointError unless ``path`` is a regular file (of ``size`` bytes if given), found WITHOUT
    opening it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: missing") from e
    except OSError as e:
        raise CheckpointError(f"{path}: {e.strerror}") from e
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: {kind_of(st.st_mode)}, not a regular file (refused without opening it)")
    if size is not None and st.st_size != size:
        raise CheckpointError(f"{path}: truncated or overwritten: {st.st_size} bytes, the manifest says {size}")


def open_regular(path, size: int | None = None):
    """A binary file object of regular file ``path`` (of ``size`` bytes if given): checked with
    ``lstat`` before opening, opened without following a link, checked again once open."""
    check_regular(path, size)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: missing") from e
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be opened as a regular file ({e.strerror})") from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (size is not None and st.st_size != size):
        os.close(fd)
        raise CheckpointError(f"{path}: changed while being checked (now {kind_of(st.st_mode)}, {st.st_size} bytes)")
    return os.fdopen(fd, "rb")


def read_json_bytes(path) -> bytes:
    """The bytes of JSON file ``path``: a regular file (not a link), at most :data:`MAX_JSON_BYTES`
    (minidist/untrusted.py, the one bounded reader)."""
    return read_bounded(path, MAX_JSON_BYTES, "a checkpoint's JSON", CheckpointError, follow_links=False)


def sha256_file(path, size: int) -> str:
    """The sha256 of regular file ``path`` of ``size`` bytes."""
    with open_regular(path, size) as f:
        return sha256_stream(f)


def remove_entry(path) -> None:
    """Remove ``path`` without following links: a link or file is unlinked (a link's target stays
    untouched), a real folder removed with everything in it. Missing: nothing to do."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        Path(path).unlink(missing_ok=True)


def ckpt_dir_problems(path) -> list[str]:
    """What is wrong with ``path`` as ``--ckpt-dir``, found at start-up (:func:`minidist.files.folder_problems`:
    a link, not a folder, a part of the path not a folder, no permission). A folder that does not
    exist yet is fine: the run creates it and holds it."""
    return folder_problems("--ckpt-dir", path)
