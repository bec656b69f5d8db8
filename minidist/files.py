"""The files a run writes: created without following links, written whole or not at all, with their
space reserved before they are memory-mapped, and their paths checked before the first step.

A path a user gives (``--export``, ``--out``, ``--offload-dir``...) may hold anything by the time the
run writes it: a link planted at a file's name, a FIFO, a file where a folder should be. So:

    create(path)            opens for writing with O_NOFOLLOW (a link at ``path`` is refused, its
                            target untouched) and O_NONBLOCK (a FIFO is refused, not waited on), and
                            checks the open file is a regular one
    write_atomically(p, b)  writes a temporary file beside ``p`` exclusively (O_EXCL), fsyncs it and
                            renames it over ``p``: ``p`` holds its old content or all of ``b``, and a
                            link at ``p`` is replaced, never written through; a failed write (a full
                            disk) names ``p`` (:func:`naming`); ``temporary_of`` tells its temporaries,
                            which a killed writer leaves, by their names
    reserve(f, n, path)     allocates the file's n bytes on the disk now (posix_fallocate): a full disk
                            is an OSError naming the path here, not a SIGBUS later, when a store
                            through a memory mapping finds no block to write
    real_folder(path)       creates a folder (and its parents) and checks it is one, not a link to one
    folder_problems / file_problems
                            what is wrong with a path as a flag's folder or file, found at start-up
"""
from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class PathRefused(OSError):
    """A path the run will not write through: a link, a FIFO, a device, a file where a folder goes."""


class NoSpace(OSError):
    """The disk cannot hold a file the run must write."""


def kind_of(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words ("a symbolic link", "a FIFO", "a regular file"...)."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a regular file"


def create(path, append: bool = False, text: bool = False, readable: bool = False):
    """A new file object writing to ``path`` (truncated, or appended to with ``append``; also for
    reading with ``readable``, as a memory mapping needs), opened without following a link at
    ``path`` and without blocking on a FIFO; :class:`PathRefused` naming ``path`` if it is a link or
    anything but a regular file."""
    flags = (os.O_RDWR if readable else os.O_WRONLY) | os.O_CREAT | NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):
            raise PathRefused(e.errno, f"{path} is a symbolic link: refused (a run never writes through a link)") from e
        if e.errno == errno.ENXIO:
            raise PathRefused(e.errno, f"{path} is a FIFO: refused (a run writes regular files)") from e
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise PathRefused(errno.EINVAL, f"{path} is {kind_of(mode)}, not a regular file: refused")
    os.set_blocking(fd, True)
    return os.fdopen(fd, ("a" if append else "w") + ("+" if readable else "") + ("" if text else "b"),
                     **({"encoding": "utf-8"} if text else {}))


def fsync_folder(path) -> None:
    """Make the entries of folder ``path`` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


TEMPORARY = re.compile(r"(.+)\.tmp[0-9]+")  # write_atomically's <name>.tmp<pid>


def temporary_of(name: str) -> str | None:
    """The name of the file whose temporary (:func:`write_atomically`'s) ``name`` is, or None."""
    match = TEMPORARY.fullmatch(name)
    return match.group(1) if match else None


def naming(error: OSError, path) -> OSError:
    """``error`` naming ``path`` if it names no file (a write or fsync's ENOSPC does not:
    ``[Errno 28] No space left on device: 'path'``)."""
    if error.filename is not None or error.errno is None:
        return error
    return type(error)(error.errno, error.strerror, str(path))


def write_atomically(path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` holds either its old content or all of ``data``:
    a temporary file beside it, created exclusively (never through a link planted at its name),
    flushed and fsynced, renamed over ``path`` (a link at ``path`` is replaced, not followed), and
    the folder fsynced. An OSError names ``path``."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a crashed writer's leftover (or a link: only the link goes)
    try:  # the open inside: a stop signal's Stopped raised as it returns must not leave the file behind
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise naming(e, path) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def reserve(f, nbytes: int, path) -> None:
    """Allocate ``nbytes`` of disk for open file ``f`` (at ``path``) now. :class:`NoSpace` naming ``path``
    and the size if the disk cannot hold them: found here, before any store through a memory mapping
    of the file (which, on a full disk, the kernel can only answer with SIGBUS)."""
    try:
        os.posix_fallocate(f.fileno(), 0, nbytes)
    except OSError as e:
        raise NoSpace(e.errno, f"{path}: cannot reserve {nbytes:,} bytes on its disk ({e.strerror})") from e


def real_folder(path) -> Path:
    """Create folder ``path`` and its parents if missing, and return it; OSError if it (the last
    component) is a link or not a folder (:class:`PathRefused`), so nothing is created in a link's target."""
    path = Path(path)
    if not os.path.lexists(path):
        path.mkdir(parents=True, exist_ok=True)
    mode = os.lstat(path).st_mode
    if not stat.S_ISDIR(mode):
        raise PathRefused(errno.ENOTDIR, f"{path} is {kind_of(mode)}, not a folder: refused (a run never follows a link)")
    return path


def _nearest_existing(path: Path) -> Path:
    return next(p for p in (path, *path.parents) if os.path.lexists(p))


def _unreadable(check):
    """``check`` made total: an OSError while looking at the path (a name too long for its file system,
    a part of it unreadable) is one more problem, named by its flag."""
    def checked(flag: str, path) -> list[str]:
        try:
            return check(flag, path)
        except OSError as e:
            return [f"{flag} {path}: {e.strerror or e}"]
    checked.__doc__, checked.__name__ = check.__doc__, check.__name__
    return checked


@_unreadable
def folder_problems(flag: str, path) -> list[str]:
    """What is wrong with ``path`` as the folder of ``flag``, found at start-up: a link, something
    that is not a folder, a part of the path that is not a folder, or no permission to write there.
    A folder that does not exist yet is fine if it can be created."""
    path = Path(path)
    if path.is_symlink():
        return [f"{flag} {path} is a symbolic link (to {os.readlink(path)}): give the real folder (a run never "
                "writes through a link)"]
    existing = _nearest_existing(path)
    if not existing.is_dir():
        return [f"{flag} {path} exists and is not a folder" if existing == path else
                f"{flag} {path}: {existing} is not a folder"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"{flag} {path}: no permission to write in {existing}"]
    return []


@_unreadable
def file_problems(flag: str, path) -> list[str]:
    """What is wrong with ``path`` as the file ``flag`` writes, found at start-up: a link, an
    existing folder or anything but a regular file at ``path``, or a folder it cannot be made in.
    An existing regular file is fine: it is replaced when the run ends."""
    path = Path(path)
    if path.is_symlink():
        return [f"{flag} {path} is a symbolic link: refused (a run never writes through a link)"]
    if path.exists():
        mode = os.stat(path).st_mode
        return [] if stat.S_ISREG(mode) else [f"{flag} {path} is {kind_of(mode)}, not a file it can replace"]
    return folder_problems(flag, path.parent) if str(path.parent) not in ("", ".") else []
