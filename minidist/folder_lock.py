"""A run's hold on a folder: an advisory lock, taken at start-up and kept for the run's lifetime.

Two runs writing one ``--ckpt-dir`` delete each other's saves in progress; two runs in one
``--offload-dir`` write each other's memory-mapped stores. So a run holds such a folder with
``flock`` on the file ``.minidist.lock`` in it, which records the holder (pid, host, since when, and a
random token that tells ranks on other machines whether they see the same folder). A
second run finds the lock taken and is refused, naming the holder. A taker checks, once it holds the
lock, that the file is still the one at the name (one that created it may remove it on leaving:
``release(remove=True)``). The kernel releases a ``flock``
when its process dies however it dies (``kill -9`` included): a dead run's lock is simply free
again, and the next run takes it over and writes itself in as the holder. (``flock`` is advisory:
it keeps out other minidist runs, not a user's ``rm``. On NFS, Linux maps it onto the server's byte-range
locks.)
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time

from minidist.files import NOFOLLOW, PathRefused, real_folder
from minidist.untrusted import parse_json

LOCK_FILE = ".minidist.lock"
MAX_HOLDER_BYTES = 4096


class FolderInUse(RuntimeError):
    """Another live process holds the folder."""


class FolderLock:
    """Holds ``folder`` (created if missing; refused if a link) until :meth:`release`, or raises
    :class:`FolderInUse` naming the process that holds it. ``purpose`` says what the folder is for,
    in the message."""

    def __init__(self, folder, purpose: str = "folder"):
        self.folder = real_folder(folder)
        self.path = self.folder / LOCK_FILE
        while True:
            fd, self.created = _open(self.path)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise PathRefused(errno.EINVAL, f"{self.path} is not a regular file: refused")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise FolderInUse(f"{purpose} {self.folder} is in use by another run ({holder}): give each run its "
                                  f"own folder, or wait for that run to end") from None
            if _is_at(fd, self.path):
                break
            os.close(fd)  # the file was removed (release(remove=True)) between our open and our lock: again
        self.token = int.from_bytes(os.urandom(7), "little")  # this hold's own number: who else sees the file
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "token": self.token,
                                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        self._fd = fd

    def release(self, remove: bool = False) -> None:
        """Let the folder go. The lock file stays, unless ``remove`` and this hold created it (a command
        that refused its input leaves nothing behind): it is removed while still held, and a run that
        opened it meanwhile finds it gone once it holds it, and takes the new one."""
        if self._fd is not None:
            if remove and self.created and _is_at(self._fd, self.path):
                self.path.unlink(missing_ok=True)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _open(path) -> tuple[int, bool]:
    """(a descriptor of lock file ``path``, whether this call created it); never through a link, never
    waiting on a FIFO."""
    flags = os.O_RDWR | NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    while True:
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            pass
        try:
            return os.open(path, flags), False
        except FileNotFoundError:  # removed in between: create it
            continue


def _is_at(fd: int, path) -> bool:
    """Whether open file ``fd`` is still the file at ``path``."""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


def _holder(fd: int) -> str:
    """Who holds the lock, as the holder wrote it: "pid 123 on host h since ..."; read bounded and
    checked (the file is untrusted)."""
    try:
        record = parse_json(os.pread(fd, MAX_HOLDER_BYTES, 0))
        return f"pid {int(record['pid'])} on host {str(record['host'])[:255]} since {str(record['since'])[:32]}"
    except (ValueError, KeyError, TypeError):
        return "its holder did not say who it is"


def holder_token(folder) -> int | None:
    """The ``token`` the holder of ``folder``'s lock wrote, or None (no lock file, a link, unreadable
    or not a holder's record): read bounded, without following a link, and checked. A rank on
    another machine that finds rank 0's token sees the same folder (a shared file system)."""
    try:
        fd = os.open(os.path.join(folder, LOCK_FILE), os.O_RDONLY | NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        token = parse_json(os.pread(fd, MAX_HOLDER_BYTES, 0))["token"]
        return token if type(token) is int else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        os.close(fd)
