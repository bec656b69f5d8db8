"""Text to token ids for data/prepare.py: the text cut into chunks, the tokenizer named by
``--tokenizer``, and the chunks encoded by a pool of worker processes, their tokens kept in order.

Chunks: each input file is cut into pieces of at most :data:`CHUNK_BYTES` bytes, each ending at the
last line break inside it (a line longer than a chunk is cut between two UTF-8 characters). The
cuts depend only on the text, never on the number of workers, so the tokens do not either: a BPE
tokenizer sees the same pieces whether one process encodes them or sixteen. A chunk never spans two
files.

Tokenizers (``--tokenizer``): ``bytes`` (one token per UTF-8 byte, ids 0..255), ``bpe:VOCAB`` (a
byte-level BPE of VOCAB tokens learned from the inputs with the ``tokenizers`` package), or the path
of a Hugging Face ``tokenizer.json``. Shards store uint16 ids, so a vocabulary holds at most 65,536.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import multiprocessing
import os
import stat
from pathlib import Path

import numpy as np

from minidist.data.hf_tokenizer import tokenizer_bytes
from minidist.data.tokens import DataError
from minidist.files import kind_of
from minidist.waiting import until

CHUNK_BYTES = 1 << 20   # bytes of text per chunk (at most; at least 4): fixed, so tokens never depend on --workers
MAX_VOCAB = 1 << 16     # ids are stored as uint16
AHEAD = 2               # chunks in flight per worker: enough to keep each busy, few enough to bound memory


class PrepareError(DataError):
    """An input, a flag or a tokenizer that ``prepare`` refuses, in one line naming it."""


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """What ``--tokenizer`` asks for: ``kind`` bytes, bpe or file; ``vocab`` the vocabulary
    (bpe: the one asked); for a file, its absolute path, its text and the SHA-256 of its bytes."""
    kind: str
    vocab: int
    source: str | None = None
    json: str | None = None
    sha256: str | None = None


def parse_tokenizer(spec: str) -> TokenizerSpec:
    """The :class:`TokenizerSpec` of ``--tokenizer spec`` (a file's is read and loaded, to check it);
    a :class:`PrepareError` saying what is wrong with it otherwise."""
    if spec == "bytes":
        return TokenizerSpec("bytes", 256)
    if spec.startswith("bpe:"):
        vocab = spec[4:]
        if not vocab.isdigit():
            raise PrepareError(f"--tokenizer {spec}: bpe:VOCAB takes a whole number of tokens, e.g. bpe:4096")
        if not 256 < int(vocab) <= MAX_VOCAB:
            raise PrepareError(f"--tokenizer {spec}: a byte-level BPE has more than the 256 byte tokens and at most "
                               f"{MAX_VOCAB:,} (uint16 shards)")
        _tokenizers(spec)
        return TokenizerSpec("bpe", int(vocab))
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise PrepareError(f"--tokenizer {spec}: neither bytes, bpe:VOCAB nor a tokenizer.json file")
    data = tokenizer_bytes(path, lambda message: PrepareError(f"--tokenizer {message}"))  # bounded, UTF-8 JSON
    text = data.decode("utf-8")
    try:
        vocab = _tokenizers(spec).Tokenizer.from_str(text).get_vocab_size()
    except Exception as e:  # the Rust side raises plain Exceptions for a malformed file
        raise PrepareError(f"--tokenizer {path}: not a tokenizer.json the tokenizers package can read "
                           f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from e
    if vocab > MAX_VOCAB:
        raise PrepareError(f"--tokenizer {path}: a vocabulary of {vocab:,} tokens does not fit uint16 shards "
                           f"(at most {MAX_VOCAB:,})")
    return TokenizerSpec("file", vocab, str(path.resolve()), text, hashlib.sha256(data).hexdigest())


def _tokenizers(spec: str):
    """The ``tokenizers`` package, or a :class:`PrepareError` saying how to install it."""
    try:
        import tokenizers
    except ImportError as e:
        raise PrepareError(f"--tokenizer {spec} needs the 'tokenizers' package: pip install tokenizers "
                           "(or pip install 'minidist[hf]')") from e
    return tokenizers


def chunks(path):
    """The bytes of file ``path`` as chunks of at most :data:`CHUNK_BYTES`, each cut after its last
    line break (or, in a longer line, between two UTF-8 characters): (offset, bytes) pairs."""
    size, offset, carry = CHUNK_BYTES, 0, b""
    with open(path, "rb") as f:
        while True:
            piece = carry + f.read(size - len(carry))
            if len(piece) < size:  # the end of the file
                if piece:
                    yield offset, piece
                return
            cut = piece.rfind(b"\n") + 1
            if cut == 0:  # no line break: cut before the last character (back over continuation bytes 10xxxxxx)
                cut = len(piece) - 1
                while cut > len(piece) - 4 and piece[cut] & 0xC0 == 0x80:
                    cut -= 1
            yield offset, piece[:cut]
            offset, carry = offset + cut, piece[cut:]


def train_bpe(texts, vocab: int, progress: bool = False) -> tuple[str, int]:
    """(tokenizer.json text, vocabulary) of a byte-level BPE with ``vocab`` tokens (fewer when no pair
    is left to merge) learned from the strings ``texts``: GPT-2's pre-tokenizer (no added space
    at a chunk's start) and decoder, every byte in the vocabulary, no special tokens. Deterministic."""
    tokenizers = _tokenizers(f"bpe:{vocab}")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab, show_progress=progress, special_tokens=[],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer.to_str(), tokenizer.get_vocab_size()


class ChunkEncoder:
    """Bytes of UTF-8 text -> uint16 token ids: one per byte (``tokenizer_json`` None), or with the
    tokenizer whose tokenizer.json text is ``tokenizer_json`` (no special tokens added)."""

    def __init__(self, tokenizer_json: str | None):
        self.tokenizer = None if tokenizer_json is None else _tokenizers("").Tokenizer.from_str(tokenizer_json)

    def __call__(self, chunk: bytes) -> np.ndarray:
        if self.tokenizer is None:
            return np.frombuffer(chunk, dtype=np.uint8).astype(np.uint16)
        return np.asarray(self.tokenizer.encode(chunk.decode("utf-8"), add_special_tokens=False).ids, dtype=np.uint16)


_worker_encoder: ChunkEncoder | None = None  # each worker process's own, made once by _start_worker


def _start_worker(tokenizer_json: str | None) -> None:
    global _worker_encoder
    _worker_encoder = ChunkEncoder(tokenizer_json)


def _encode_in_worker(chunk: bytes) -> np.ndarray:
    return _worker_encoder(chunk)


def encode_in_order(chunk_iter, tokenizer_json: str | None, workers: int):
    """The token ids of each chunk of ``chunk_iter`` (bytes), in order, as (its length, ids) pairs:
    encoded by a pool of ``workers`` processes, or in this process with one worker or the bytes
    tokenizer (a byte is its own token: sending the chunk to a worker would cost more than that).
    At most ``AHEAD * workers`` chunks are in flight, so a large corpus is never read whole into
    memory (``Pool.imap`` would read all of its input ahead of the workers)."""
    if workers == 1 or tokenizer_json is None:
        encoder = ChunkEncoder(tokenizer_json)
        for chunk in chunk_iter:
            yield len(chunk), encoder(chunk)
        return
    # spawn: fresh interpreters, which inherit none of this process's threads (tokenizers' own pool)
    with multiprocessing.get_context("spawn").Pool(workers, _start_worker, (tokenizer_json,)) as pool:
        pending = collections.deque()
        for chunk in chunk_iter:
            pending.append((len(chunk), pool.apply_async(_encode_in_worker, (chunk,))))
            if len(pending) >= AHEAD * workers:
                n, ids = pending.popleft()
                until(ids.ready, ids.wait)
                yield n, ids.get()
        while pending:
            n, ids = pending.popleft()
            until(ids.ready, ids.wait)
            yield n, ids.get()


def describe_input(path) -> tuple[dict, int]:
    """({"path": absolute, "bytes": size, "sha256": hex}, its number of chunks) of input text file
    ``path``, read once whole; a :class:`PrepareError` if it is missing, unreadable or not UTF-8."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise PrepareError(f"{path} is {kind_of(mode)}, not a text file (each input is read twice: to hash it, "
                               "then to encode it)")
        digest, size, count = hashlib.sha256(), 0, 0
        for offset, chunk in chunks(path):
            digest.update(chunk)
            size, count = size + len(chunk), count + 1
            try:
                chunk.decode("utf-8")
            except UnicodeDecodeError as e:
                raise PrepareError(f"{path}: not UTF-8 text (byte {offset + e.start:,} is 0x{chunk[e.start]:02x}, "
                                   f"{e.reason})") from None
    except FileNotFoundError:
        raise PrepareError(f"{path}: no such file") from None
    except OSError as e:
        raise PrepareError(f"{path}: cannot be read ({e.strerror or e})") from None
    return {"path": str(Path(path).resolve()), "bytes": size, "sha256": digest.hexdigest()}, count
