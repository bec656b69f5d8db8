"""What ``--data`` names, opened and checked before anything is sent: a :class:`Corpus`.

    a file                      one uint8 token per byte (a UTF-8 text file is one): the last 10% validates
    a prepared folder           ``manifest.json`` + ``train_*.bin`` / ``val_*.bin`` llm.c shards (data/prepare.py)
    an llm.c folder             ``*train*.bin`` / ``*val*.bin`` llm.c shards, no manifest
    a nanoGPT folder            ``train.bin`` / ``val.bin``: raw uint16 tokens, no header; its ``meta.pkl``
                                (a character vocabulary), when there, read with no class allowed

Every shard's header and size are checked on every rank. A prepared folder's manifest says each
shard's token count, largest token and SHA-256: every shard is hashed at the start, on every rank,
and one whose bytes are not those its manifest promises is refused, naming it, before any of its
tokens reaches a step (about 0.7 s of CPU per GiB here: benchmarks/data_hash.py). A token read later that is
outside the vocabulary (the shard changed during the run) is still refused, naming its shard
(data/tokens.py). A folder without a manifest is read once at the start, whole, for its largest
token and its hash (``prepare`` it to keep a record of both).

The run's identity (checkpoint/identity.py) takes :attr:`Corpus.identity`: the training tokens'
count and a SHA-256 (of the tokens for a file or a folder read whole, of the manifest's list of train
shards for a prepared folder).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

import numpy as np

from minidist.data.meta_pkl import META, read_meta
from minidist.data.shards import is_shard, shard_part
from minidist.data.tokens import DataError, Part, Tokens, file_tokens
from minidist.untrusted import file_sha256, read_json

MANIFEST = "manifest.json"
READ_CHUNK = 1 << 24  # bytes per read of a folder read whole
MANIFEST_LIMIT = 1 << 26  # a manifest.json larger than 64 MiB is not one


@dataclasses.dataclass
class Corpus:
    """The train and validation tokens of ``--data``, what they are and what they need."""
    train: Tokens
    val: Tokens
    kind: str                  # "file", "prepared", "llm.c" or "nanogpt"
    vocab_size: int | None     # the data's vocabulary (None: not known: --vocab-size must say)
    largest: int               # the largest token id in the data
    largest_in: str            # the file that holds it (the first such)
    tokenizer: str | None      # "bytes", a tokenizer.json's or a meta.pkl's path, or None (ids only)
    identity: dict             # data_tokens, data_sha256


def open_corpus(path, val_fraction: float = 0.1) -> Corpus:
    """The :class:`Corpus` at ``path`` (module docstring); a :class:`DataError` naming what is
    wrong with it otherwise. Reads headers, the manifest, and (a file, or a folder without a
    manifest) every token once."""
    path = Path(path)
    if path.is_file():
        return _text_file(path, val_fraction)
    if not path.is_dir():  # (a FIFO is never opened: it would block)
        raise DataError(f"{path}: {'neither a regular file nor a folder' if path.exists() else 'no such file or folder'}")
    if (path / MANIFEST).exists():
        return _prepared(path)
    bins = sorted(p for p in path.iterdir() if p.suffix == ".bin" and p.is_file())
    if any(SHARD_NAME.match(p.name) for p in bins):  # prepare's names: its manifest is written last
        raise DataError(f"{path}: holds prepared shards ({', '.join(p.name for p in bins[:2])}...) but no {MANIFEST}: "
                        f"its preparation did not finish (or the manifest was removed); run python -m "
                        f"minidist.data.prepare again")
    if not bins:
        raise DataError(f"{path}: no token shards (*.bin) and no {MANIFEST}: prepare text with "
                        f"python -m minidist.data.prepare TEXT... --out {path}")
    shards = [p for p in bins if is_shard(p)]
    if shards and len(shards) != len(bins):
        raise DataError(f"{path}: mixed formats: {', '.join(p.name for p in shards)} are llm.c shards, "
                        f"{', '.join(p.name for p in bins if p not in shards)} are not")
    if shards:
        train = [shard_part(p) for p in bins if "train" in p.name]
        val = [shard_part(p) for p in bins if "val" in p.name]
        return _read_whole(path, "llm.c", train, val)
    if {p.name for p in bins} != {"train.bin", "val.bin"}:
        raise DataError(f"{path}: {', '.join(p.name for p in bins)}: neither llm.c shards (magic number "
                        f"20240520) nor nanoGPT's train.bin and val.bin (raw uint16)")
    parts = []
    for name in ("train.bin", "val.bin"):
        size = (path / name).stat().st_size
        if size % 2:
            raise DataError(f"{path / name}: {size:,} bytes, an odd number: not uint16 tokens (truncated?)")
        parts.append(Part(str(path / name), 0, size // 2, "uint16"))
    corpus = _read_whole(path, "nanogpt", [parts[0]], [parts[1]])
    if corpus.tokenizer is None and (path / META).is_file():  # a character vocabulary, no class allowed
        corpus = dataclasses.replace(corpus, vocab_size=read_meta(path / META).vocab_size, tokenizer=str(path / META))
    return corpus


def _text_file(path: Path, val_fraction: float) -> Corpus:
    """A uint8 token file: the first ``1 - val_fraction`` trains, the rest validates."""
    tokens = file_tokens(path)
    n_train = len(tokens) - int(len(tokens) * val_fraction)
    train, val = tokens.slice(0, n_train), tokens.slice(n_train, len(tokens))
    digest, largest, where = _scan(train.parts, val.parts)
    return Corpus(train, val, "file", 256, largest, where, "bytes", {"data_tokens": len(train), "data_sha256": digest})


def _read_whole(path: Path, kind: str, train: list[Part], val: list[Part]) -> Corpus:
    """A folder without a manifest: every token read once, for the largest and the train part's hash."""
    if not train or not val:
        missing = "train" if not train else "val"
        raise DataError(f"{path}: no {missing} shard (a file with '{missing}' in its name)")
    digest, largest, where = _scan(train, val)
    tokenizer = path / "tokenizer.json"
    return Corpus(Tokens(train), Tokens(val), kind, None, largest, where, str(tokenizer) if tokenizer.is_file() else None,
                  {"data_tokens": sum(p.count for p in train), "data_sha256": digest})


def _scan(train: list[Part], val: list[Part]) -> tuple[str, int, str]:
    """(SHA-256 of the train parts' bytes, the largest token of all, the file holding it), reading each
    part once, in chunks of READ_CHUNK bytes, through the one reader (data/tokens.py)."""
    digest, largest, where = hashlib.sha256(), 0, train[0].path if train else ""
    for part in train + val:
        tokens, step = Tokens([part]), READ_CHUNK // np.dtype(part.dtype).itemsize
        for lo in range(0, len(tokens), step):
            chunk = tokens.read(lo, min(lo + step, len(tokens)))  # a DataError if the file was cut short
            if part in train:
                digest.update(chunk.tobytes())
            top = int(chunk.max())
            largest, where = (top, part.path) if top > largest else (largest, where)
        tokens.close()
    return digest.hexdigest(), largest, where


SHARD_NAME = re.compile(r"^(train|val)_\d{6}\.bin$")


def _prepared(path: Path) -> Corpus:
    """A folder written by data/prepare.py: its manifest checked against every shard's header, then
    against every shard's bytes (their SHA-256)."""
    manifest = read_manifest(path)
    parts = {"train": [], "val": []}
    for entry in manifest["shards"]:
        part = shard_part(path / entry["name"])
        if part.count != entry["tokens"]:
            raise DataError(f"{part.path}: {part.count:,} tokens, its manifest says {entry['tokens']:,}")
        parts[entry["split"]].append(part)
    for entry in manifest["shards"]:  # the headers first (cheap), then every byte
        digest = file_sha256(path / entry["name"], DataError)
        if digest != entry["sha256"]:
            raise DataError(f"{path / entry['name']}: its SHA-256 is not its manifest's ({digest[:12]}..., the manifest "
                            f"says {entry['sha256'][:12]}...): it changed after it was prepared; prepare the folder again")
    if not parts["train"] or not parts["val"]:
        raise DataError(f"{path / MANIFEST}: no {'train' if not parts['train'] else 'val'} shard")
    top = max(manifest["shards"], key=lambda e: e["largest"])
    largest = top["largest"]
    if largest >= manifest["vocab_size"]:
        raise DataError(f"{path / MANIFEST}: largest token {largest} is outside its vocabulary of {manifest['vocab_size']}")
    train_list = [[e["name"], e["tokens"], e["sha256"]] for e in manifest["shards"] if e["split"] == "train"]
    tokenizer = manifest["tokenizer"]["kind"]
    vocab = manifest["vocab_size"]
    return Corpus(Tokens(parts["train"], vocab), Tokens(parts["val"], vocab), "prepared", vocab, largest, str(path / top["name"]),
                  "bytes" if tokenizer == "bytes" else str(path / "tokenizer.json"),
                  {"data_tokens": sum(e[1] for e in train_list),
                   "data_sha256": hashlib.sha256(json.dumps(train_list).encode()).hexdigest()})


def read_manifest(path: Path) -> dict:
    """``path/manifest.json``, checked field by field (it is read from disk: trusted only once it
    has the shape data/prepare.py writes); a :class:`DataError` naming the first wrong field."""
    file = path / MANIFEST
    manifest = read_json(file, MANIFEST_LIMIT, "a data manifest", DataError)  # bounded in size and depth

    def need(ok, what):
        if not ok:
            raise DataError(f"{file}: {what}")
    need(isinstance(manifest, dict), "not a JSON object")
    need(manifest.get("format") == "minidist-shards" and manifest.get("version") == 1,
         'format must be "minidist-shards", version 1')
    need(type(manifest.get("vocab_size")) is int and 0 < manifest["vocab_size"] <= 2 ** 16,
         "vocab_size must be an integer in [1, 65536]")
    need(isinstance(manifest.get("tokenizer"), dict) and manifest["tokenizer"].get("kind") in ("bytes", "bpe", "file"),
         "tokenizer.kind must be bytes, bpe or file")
    need(isinstance(manifest.get("shards"), list) and manifest["shards"], "shards must be a non-empty list")
    for i, e in enumerate(manifest["shards"]):
        need(isinstance(e, dict) and isinstance(e.get("name"), str) and SHARD_NAME.match(e["name"]),
             f"shards[{i}].name must be train_NNNNNN.bin or val_NNNNNN.bin")
        need(e.get("split") == e["name"].split("_")[0], f"shards[{i}].split must match its name")
        need(type(e.get("tokens")) is int and 0 < e["tokens"] < 2 ** 62, f"shards[{i}].tokens must be an integer >= 1")
        need(type(e.get("largest")) is int and 0 <= e["largest"] < 2 ** 16, f"shards[{i}].largest must be in [0, 65536)")
        need(isinstance(e.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", e["sha256"]),
             f"shards[{i}].sha256 must be 64 hex digits")
    names = [e["name"] for e in manifest["shards"]]
    need(len(set(names)) == len(names), "a shard is named twice")
    if manifest["tokenizer"]["kind"] != "bytes":
        need((path / "tokenizer.json").is_file(), "names a tokenizer, but tokenizer.json is not beside it")
    return manifest
