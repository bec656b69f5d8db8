"""Reading a file a run did not write itself, with bounds: the one reader of every such file.

A data manifest, a tokenizer.json, a hostfile, a checkpoint's JSON, a Hugging Face config.json, a
trace, a memory report: each may hold anything by the time it is read (a FIFO, a sparse 4 GiB
file, ``[`` repeated 100,000 times). So each is read here, and each failure is one exception whose
message names the file:

    read_bounded(path, limit, what)     the bytes of regular file ``path``, at most ``limit`` of them:
                                        checked to be a regular file before it is opened (a device or a
                                        FIFO is never opened: a FIFO would block), opened without
                                        blocking, checked again once open; a link is followed, or with
                                        ``follow_links=False`` refused
    parse_json(data)                    the JSON value of ``data``: UTF-8 JSON, its arrays and objects
                                        nested at most :data:`MAX_DEPTH` deep (Python's parser recurses:
                                        past about 1,000 levels it raises RecursionError, here a
                                        ValueError like any other). ValueError saying why not
    read_json(path, limit, what)        both: the JSON value of file ``path`` (``json_of(data, path,
                                        what)``: of bytes already read)
    open_bounded(path)                  the open file, for a reader of lines (a trace, metrics)
    file_sha256(path)                   the SHA-256 of regular file ``path``, to compare with what a
                                        manifest promised (read in blocks: no bound but the file's size)

``what`` says what the file should be ("a data manifest"), in the messages; ``error`` is the
exception class raised (a :class:`Unreadable` unless the caller names its own).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import stat

from minidist.files import NOFOLLOW, kind_of

HASH_BLOCK = 1 << 20  # bytes per read while hashing (hashlib lets other threads run meanwhile)
MAX_DEPTH = 64
"""The deepest nesting of arrays and objects read: a manifest or a config nests 3 or 4 deep, a
tokenizer.json about 6."""


class Unreadable(ValueError):
    """A file that is not what it should be; the message names it."""


def open_bounded(path, error=Unreadable, follow_links: bool = True):
    """A binary file object reading ``path``, which must be a regular file: checked before opening
    (``stat``, or ``lstat`` without ``follow_links``), opened without blocking (and without following
    a link unless ``follow_links``), checked again on the open file. ``error`` naming ``path`` otherwise."""
    try:
        mode = (os.stat if follow_links else os.lstat)(path).st_mode
    except OSError as e:
        raise error(f"{path}: {'missing' if e.errno == errno.ENOENT else e.strerror}") from e
    if not stat.S_ISREG(mode):
        raise error(f"{path} is {kind_of(mode)}, not a regular file: refused without opening it")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else NOFOLLOW))
    except OSError as e:
        raise error(f"{path}: cannot be opened ({e.strerror})") from e
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{path} is {kind_of(mode)}, not a regular file: refused")
    return os.fdopen(fd, "rb")


def read_bounded(path, limit: int, what: str, error=Unreadable, follow_links: bool = True) -> bytes:
    """The bytes of regular file ``path`` (:func:`open_bounded`), at most ``limit``: ``error`` naming
    ``path`` and ``what`` it should be when it is larger (only ``limit + 1`` bytes are read)."""
    with open_bounded(path, error, follow_links) as f:
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise error(f"{path}: cannot be read ({e.strerror})") from e
    if len(data) > limit:
        raise error(f"{path}: larger than {_size(limit)}: not {what}")
    return data


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n:,} bytes"


def parse_json(data, **hooks):
    """The JSON value of ``data`` (bytes or str); ValueError saying why when it is not UTF-8, not
    JSON, or nested deeper than :data:`MAX_DEPTH`. ``hooks`` go to ``json.loads`` (a caller's rule on
    numbers: ``parse_constant``, ``parse_float``; their ValueError is one more reason)."""
    try:
        value = json.loads(data, **hooks)
    except RecursionError as e:
        raise ValueError(f"nested too deep (over {MAX_DEPTH} levels)") from e
    opens = (b"[", b"{") if isinstance(data, (bytes, bytearray)) else ("[", "{")
    if data.count(opens[0]) + data.count(opens[1]) > MAX_DEPTH and depth(value) > MAX_DEPTH:  # (cheap test first)
        raise ValueError(f"nested too deep (over {MAX_DEPTH} levels)")
    return value


def depth(value) -> int:
    """How deep the arrays and objects of a parsed JSON ``value`` nest (0 for a number or a string),
    found without recursion, stopping past :data:`MAX_DEPTH`."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            break
        todo.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def json_of(data, path, what: str, error=Unreadable, **hooks):
    """:func:`parse_json` of ``data`` (with ``hooks``), read from ``path``; ``error`` naming ``path``
    and ``what`` it should be when it is not such JSON."""
    try:
        return parse_json(data, **hooks)
    except ValueError as e:  # (a UnicodeDecodeError is one)
        raise error(f"{path}: not {what} (not JSON: {e})") from e


def read_json(path, limit: int, what: str, error=Unreadable, follow_links: bool = True, **hooks):
    """The JSON value of regular file ``path``: :func:`read_bounded`, then :func:`json_of`."""
    return json_of(read_bounded(path, limit, what, error, follow_links), path, what, error, **hooks)


def sha256_stream(f) -> str:
    """The SHA-256 of what is left to read in binary file ``f``, read in :data:`HASH_BLOCK` blocks."""
    digest = hashlib.sha256()
    for block in iter(lambda: f.read(HASH_BLOCK), b""):
        digest.update(block)
    return digest.hexdigest()


def file_sha256(path, error=Unreadable) -> str:
    """The SHA-256 of regular file ``path`` (:func:`open_bounded`: a FIFO or a device is refused)."""
    with open_bounded(path, error) as f:
        return sha256_stream(f)
