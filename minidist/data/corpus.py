"""The default training text: sentences from a small English-like grammar, generated, never downloaded.

Why a grammar: a tiny byte-level model learns it visibly within a few hundred steps. First it learns
which bytes occur (lower-case letters, spaces: the loss falls from ln 256 = 5.5 to about 3), then the
spelling of its 60-odd words (below 2), then the word order and the singular/plural agreement
("the cat sees ...", "the cats see ..."). Samples from a trained model read like the corpus.

The text is a pure function of the seed, cached once as a uint8 token file
(``grammar-v1-<bytes>-<seed>.bin``, see :func:`default_corpus`) beside a record of its size and
SHA-256 (``<name>.json``), so a damaged cache is noticed and regenerated instead of trained on.
"""
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from minidist.data.tokenizer import ByteTokenizer
from minidist.untrusted import read_json

RECORD_BYTES = 4096  # a cached corpus's record is about 100 bytes

DETERMINERS = ["the", "a", "every", "one", "my", "your", "that"]
ADJECTIVES = ["small", "big", "red", "green", "quiet", "happy", "old", "young", "brave", "lazy",
              "clever", "tiny", "wild", "gentle", "bright"]
NOUNS = ["cat", "dog", "bird", "fox", "horse", "child", "farmer", "king", "robot", "teacher",
         "river", "tree", "ship", "garden", "mouse", "queen", "wizard", "baker"]
PLURALS = {"child": "children", "mouse": "mice", "fox": "foxes"}
VERBS = ["see", "like", "follow", "find", "watch", "help", "chase", "visit", "paint", "call",
         "carry", "teach"]
ADVERBS = ["slowly", "quickly", "often", "never", "quietly", "happily", "always"]
PLACES = ["near the river", "in the garden", "at night", "under the tree", "on the ship",
          "by the old house"]


def plural_of(noun):
    """'cat' -> 'cats', 'fox' -> 'foxes', 'child' -> 'children'."""
    return PLURALS.get(noun, noun + "s")


def third_person(verb):
    """'see' -> 'sees', 'watch' -> 'watches', 'carry' -> 'carries', 'teach' -> 'teaches'."""
    if verb.endswith(("ch", "sh", "s", "x")):
        return verb + "es"
    if verb.endswith("y"):
        return verb[:-1] + "ies"
    return verb + "s"


def _noun_phrase(rng):
    """(words, plural?) e.g. (['the', 'brave', 'foxes'], True)."""
    noun = NOUNS[rng.integers(len(NOUNS))]
    plural = rng.random() < 0.3
    det = "the" if plural else DETERMINERS[rng.integers(len(DETERMINERS))]
    words = [det]
    if rng.random() < 0.5:
        words.append(ADJECTIVES[rng.integers(len(ADJECTIVES))])
    words.append(plural_of(noun) if plural else noun)
    return words, plural


def sentence(rng):
    """One sentence: subject, (adverb), verb agreeing with the subject, object, (place), full stop."""
    subject, plural = _noun_phrase(rng)
    obj, _ = _noun_phrase(rng)
    verb = VERBS[rng.integers(len(VERBS))]
    words = subject
    if rng.random() < 0.25:
        words = words + [ADVERBS[rng.integers(len(ADVERBS))]]
    words = words + [verb if plural else third_person(verb)] + obj
    if rng.random() < 0.3:
        words.append(PLACES[rng.integers(len(PLACES))])
    text = " ".join(words)
    return text[0].upper() + text[1:] + "."


def grammar_text(n_bytes, seed=0):
    """At least ``n_bytes`` of text, one sentence per line, a deterministic function of ``seed``."""
    rng = np.random.default_rng(seed)
    lines, size = [], 0
    while size < n_bytes:
        lines.append(sentence(rng))
        size += len(lines[-1]) + 1
    return "\n".join(lines) + "\n"


def default_data_dir():
    """Where generated data is cached unless a directory is given: ``~/.cache/minidist``."""
    return Path.home() / ".cache" / "minidist"


def default_corpus(data_dir=None, n_bytes=1_000_000, seed=0):
    """Path of the default corpus token file, generating it on first use (about 1 MB, < 1 s).

    A cached file is used only if it matches its record (size and SHA-256, see :func:`cache_problem`);
    one that does not (cut short by a full disk or a killed writer, damaged, or without a record) is
    regenerated, with a line on stderr naming it. The record and then the file are each written to a
    unique temporary name and renamed, so several processes or threads starting at once (ranks of
    one job) never read a half-written file nor trip over each other.
    """
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    path = data_dir / f"grammar-v1-{n_bytes}-{seed}.bin"
    problem = cache_problem(path)
    if problem is None:
        return path
    if path.exists():
        print(f"minidist.data: the corpus cache {path} {problem}: regenerating it", file=sys.stderr, flush=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    tokens = ByteTokenizer().encode(grammar_text(n_bytes, seed))
    record = {"bytes": len(tokens), "sha256": hashlib.sha256(tokens).hexdigest()}
    write_atomically(record_path(path), json.dumps(record).encode())  # first: a new file always has its record
    write_atomically(path, tokens.tobytes())
    return path


def record_path(path):
    """Where the size and SHA-256 of the cached corpus ``path`` are recorded: ``<name>.json`` beside it."""
    return path.with_name(path.name + ".json")


def cache_problem(path):
    """What is wrong with the cached corpus ``path``, in words, or None when its size and SHA-256
    match its record."""
    if not path.exists():
        return "does not exist"
    try:
        record = read_json(record_path(path), RECORD_BYTES, "a corpus record")  # bounded (minidist/untrusted.py)
        size, digest = int(record["bytes"]), str(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"has no valid record {record_path(path).name}"
    actual = path.stat().st_size
    if actual != size:
        return f"is {'truncated' if actual < size else 'too long'}: {actual} bytes, its record says {size}"
    if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
        return "is damaged: its SHA-256 differs from its record"
    return None


def write_atomically(path, data: bytes):
    """Write ``data`` to ``path`` through a unique temporary file in the same folder and a rename:
    a reader sees the old file or the whole new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
