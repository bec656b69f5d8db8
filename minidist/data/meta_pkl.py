"""nanoGPT's character vocabulary: the ``meta.pkl`` beside its ``train.bin`` / ``val.bin``.

nanoGPT's ``prepare.py`` for a character model pickles ``{"vocab_size": 65, "itos": {0: "\\n", ...},
"stoi": {"\\n": 0, ...}}``. A pickle can run any code when it is loaded, so this one is read by an
unpickler that finds no class at all: the opcodes that build dicts, lists, tuples, strings and
integers need none, and anything else (a class, a function, ``os.system``) is refused before it is
called. What comes out is then checked for shape: a dict whose ``itos`` maps 0..n-1 to strings,
whose ``stoi`` is its inverse where it is given, and whose ``vocab_size`` is n.

    vocabulary = read_meta(Path("shakespeare_char/meta.pkl"))
    vocabulary.decode([20, 43, 50, 50, 53])   # 'Hello'
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np

from minidist.data.tokens import DataError
from minidist.untrusted import read_bounded

META = "meta.pkl"
META_LIMIT = 1 << 24  # bytes: a character vocabulary is a few KiB; 16 MiB is no vocabulary
PLAIN = (dict, list, tuple, str, int)


class _Refused(pickle.UnpicklingError):
    """A class or persistent id the pickle asked for, refused before anything was called."""


class _NoClasses(pickle.Unpickler):
    """An unpickler for plain data: it refuses every class and persistent id it is asked for."""

    def find_class(self, module, name):
        raise _Refused(f"it names {module}.{name}, and only dicts, lists, strings and integers are read")

    def persistent_load(self, pid):
        raise _Refused("it holds a persistent id, and only dicts, lists, strings and integers are read")


def _plain(value) -> bool:
    """Whether ``value`` holds only :data:`PLAIN` values (no bool, no float), walked without recursion,
    each object once (a pickle's memo can share one list many times, or put a list inside itself)."""
    todo, seen = [value], set()
    while todo:
        item = todo.pop()
        if type(item) not in PLAIN:
            return False
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
    return True


class CharVocabulary:
    """Text <-> ids, one id per entry of ``itos`` (nanoGPT's characters, or any strings)."""

    def __init__(self, itos: list[str]):
        self.itos = itos
        self.stoi = {s: i for i, s in enumerate(itos)}
        self.vocab_size = len(itos)

    def encode(self, text: str) -> np.ndarray:
        """The ids of ``text``'s characters (int64), skipping those the vocabulary lacks ([0] when none is known)."""
        ids = [self.stoi[c] for c in text if c in self.stoi]
        return np.asarray(ids or [0], dtype=np.int64)

    def decode(self, ids) -> str:
        """The text of ``ids``; an id outside the vocabulary (a larger model can sample it) is '\\ufffd'."""
        n = self.vocab_size
        return "".join(self.itos[i] if 0 <= i < n else "\ufffd" for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist())


def read_meta(path: Path) -> CharVocabulary:
    """The :class:`CharVocabulary` of nanoGPT's ``meta.pkl`` at ``path``, read with no class allowed
    (module docstring); a :class:`DataError` of one line naming the file otherwise."""
    raw = read_bounded(path, META_LIMIT, "a character vocabulary", error=DataError)  # the one bounded reader
    try:
        meta = _NoClasses(io.BytesIO(raw)).load()
    except _Refused as e:
        raise DataError(f"{path}: refused: {e}") from e
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            OverflowError, MemoryError) as e:  # cut short, or not a pickle at all
        raise DataError(f"{path}: not a pickle of plain data ({e.__class__.__name__}: {e})") from e
    if not isinstance(meta, dict) or not _plain(meta) or not isinstance(meta.get("itos"), dict):
        raise DataError(f"{path}: not nanoGPT's vocabulary (a dict of plain data with 'itos': id -> character)")
    itos = meta["itos"]
    n = len(itos)
    if n == 0 or set(itos) != set(range(n)) or not all(isinstance(s, str) for s in itos.values()):
        raise DataError(f"{path}: 'itos' does not map the ids 0..{n - 1} to strings")
    vocabulary = CharVocabulary([itos[i] for i in range(n)])
    if len(vocabulary.stoi) != n:
        raise DataError(f"{path}: 'itos' gives two ids the same string")
    if meta.get("vocab_size", n) != n or meta.get("stoi", vocabulary.stoi) != vocabulary.stoi:
        raise DataError(f"{path}: 'vocab_size' or 'stoi' disagree with 'itos' ({n} entries)")
    return vocabulary
