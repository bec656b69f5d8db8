"""Text to the token shards a run trains on: ``python -m minidist.data.prepare INPUT... --out DIR``.

    python -m minidist.data.prepare book.txt --out data/book                         # a token per byte
    python -m minidist.data.prepare a.txt b.txt --out data/ab --tokenizer bpe:4096   # learn a BPE
    python -m minidist.data.prepare web.txt --out data/web --tokenizer gpt2/tokenizer.json
    python -m minidist.train --data data/book ...

What it writes. The inputs, UTF-8 text read in the order given, become one stream of token ids
(data/encode.py: the text is cut into chunks at line breaks, which worker processes encode). The
last ``--val-fraction`` F of the stream, int(n * F) of its n tokens but at least one, is the
validation split; the rest, at least one token, the training split. Each split is cut into shards
of at most ``--shard-tokens`` tokens, DIR/train_000000.bin, train_000001.bin, ..., val_000000.bin,
..., in llm.c's format (data/shards.py): a 1,024-byte header (256 int32: magic 20240520, version 1,
the token count), then the tokens as uint16. A learned or given tokenizer is saved as
DIR/tokenizer.json (a run decodes its samples with it). Last comes DIR/manifest.json, what the
folder holds, which a run (data/folder.py) trusts without reading a token:

    {"format": "minidist-shards", "version": 1, "vocab_size": 4096,
     "tokenizer": {"kind": "bpe", "vocab": 4096, "asked_vocab": 4096, "sha256": "<tokenizer.json's>"},
     "inputs": [{"path": "/abs/path/a.txt", "bytes": 52873, "sha256": "..."}, ...],
     "val_fraction": 0.1, "shard_tokens": 10000000,
     "shards": [{"name": "train_000000.bin", "split": "train", "tokens": 10000000, "largest": 4095,
                 "sha256": "<the whole file's>"}, ...]}

``tokenizer.kind`` is ``bytes`` (vocab 256, no tokenizer.json), ``bpe`` (``asked_vocab`` is the
VOCAB of bpe:VOCAB; ``vocab`` is smaller when the text runs out of pairs to merge) or ``file``
(``source`` is the tokenizer.json given, copied byte for byte).

The cache. Preparing again is the same command. It hashes the inputs and compares with the
manifest: the same inputs (path, size and SHA-256 of each, in order), the same tokenizer (bpe: the
vocabulary asked; a given tokenizer.json: its SHA-256), the same --val-fraction and --shard-tokens,
and every file the manifest names (each shard, tokenizer.json) still hashing to what it recorded:
then the folder is up to date and nothing is written. Otherwise it says why ("train_000001.bin:
its SHA-256 differs from the manifest") and prepares the folder again: the old manifest goes first
(a crash midway leaves no manifest, never a stale one), the new one is written last, and after it
the shards that only the old one named are removed.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from minidist.data.encode import PrepareError, chunks, describe_input, encode_in_order, parse_tokenizer, train_bpe
from minidist.data.folder import MANIFEST, SHARD_NAME, read_manifest
from minidist.data.shards import write_shard
from minidist.data.tokens import DataError
from minidist.folder_lock import FolderInUse, FolderLock
from minidist.files import create, folder_problems, naming, real_folder, temporary_of, write_atomically
from minidist.untrusted import Unreadable, file_sha256

FORMAT, VERSION = "minidist-shards", 1
SHARD_TOKENS = 10_000_000
TOKENS_TMP = "tokens.tmp"  # the whole stream as raw uint16, while it is encoded (its length decides the split)


@dataclasses.dataclass
class Prepared:
    """What :func:`prepare` did: the folder's ``manifest``; ``cached`` True when the folder was already
    up to date (nothing written); ``notes``, lines worth printing (why it was prepared again...)."""
    manifest: dict
    cached: bool
    notes: list[str]
    seconds: float


def prepare(inputs, out, tokenizer: str = "bytes", val_fraction: float = 0.1, shard_tokens: int = SHARD_TOKENS,
            workers: int | None = None, progress: bool = False) -> Prepared:
    """Make folder ``out`` hold the shards, tokenizer.json and manifest of the text files ``inputs``
    (a list of paths, or one path) as the module docstring says, unless it already does. ``workers``
    processes encode (None: one per CPU; they are started by spawn, so a script that calls this needs
    ``if __name__ == "__main__":``); ``progress`` draws bars on stderr when it is a terminal.
    A :class:`PrepareError` in one line for a bad input or flag, before any file in ``out`` changes."""
    start = time.perf_counter()
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    workers = (os.cpu_count() or 1) if workers is None else workers
    refusals = [(not inputs, "no input text files"),
                (not 0 < val_fraction < 1, f"--val-fraction {val_fraction} is not between 0 and 1"),
                (shard_tokens < 1, f"--shard-tokens {shard_tokens} is not >= 1"),
                (workers < 1, f"--workers {workers} is not >= 1")]
    if any(bad for bad, _ in refusals):
        raise PrepareError(next(what for bad, what in refusals if bad))
    spec = parse_tokenizer(tokenizer)
    problems = folder_problems("--out", out)
    if problems:
        raise PrepareError(problems[0])
    described = [describe_input(path) for path in inputs]
    entries, n_chunks = [entry for entry, _ in described], sum(count for _, count in described)
    made = not os.path.lexists(out)
    out = real_folder(out)
    try:
        lock = FolderLock(out, "--out")  # one prepare at a time in a folder
    except FolderInUse as e:
        raise PrepareError(str(e)) from None
    try:
        result = _prepare_held(out, entries, n_chunks, spec, val_fraction, shard_tokens, workers, progress, start)
    except BaseException:  # refused or failed: no lock of its own left behind, nor the folder it made if empty
        lock.release(remove=True)
        if made:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    lock.release()
    return result


def _prepare_held(out, entries, n_chunks, spec, val_fraction, shard_tokens, workers, progress, start) -> Prepared:
    """:func:`prepare` once it holds ``out`` (so no other prepare writes there): first what a killed
    prepare left is removed, then the folder is prepared unless it is up to date."""
    notes = remove_leftovers(out)
    old, why = previous_manifest(out)
    if old is not None:
        why = difference(out, old, entries, spec, val_fraction, shard_tokens)
        if why is None:
            return Prepared(old, True, notes, time.perf_counter() - start)
    notes += [] if why is None else [f"{why}: preparing {out} again"]

    paths = [entry["path"] for entry in entries]
    tokenizer_json, tokenizer_entry = tokenizer_of(spec, paths, progress, notes)
    try:
        n = encode_to(out / TOKENS_TMP, paths, tokenizer_json, min(workers, n_chunks),
                      sum(e["bytes"] for e in entries), progress)
        n_val = max(1, int(n * val_fraction))
        if n - n_val < 1:
            raise PrepareError(f"the inputs give {n} token{'s' * (n != 1)}: too few for a training and a "
                               "validation token")
        (out / MANIFEST).unlink(missing_ok=True)  # from here until the new one is written, the folder has none
        if tokenizer_json is not None:
            write_atomically(out / "tokenizer.json", tokenizer_json.encode("utf-8"))
        shards = (write_shards(out, out / TOKENS_TMP, "train", 0, n - n_val, shard_tokens)
                  + write_shards(out, out / TOKENS_TMP, "val", n - n_val, n, shard_tokens))
    finally:
        (out / TOKENS_TMP).unlink(missing_ok=True)
    manifest = {"format": FORMAT, "version": VERSION, "vocab_size": tokenizer_entry["vocab"],
                "tokenizer": tokenizer_entry, "inputs": entries, "val_fraction": val_fraction,
                "shard_tokens": shard_tokens, "shards": shards}
    write_atomically(out / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    if old is not None:  # what only the old manifest named
        kept = {e["name"] for e in shards} | ({"tokenizer.json"} if tokenizer_json is not None else set())
        for name in [e["name"] for e in old["shards"]] + ["tokenizer.json"] * (old["tokenizer"]["kind"] != "bytes"):
            if name not in kept:
                (out / name).unlink(missing_ok=True)
    return Prepared(manifest, False, notes, time.perf_counter() - start)


def remove_leftovers(out: Path) -> list[str]:
    """Remove what a prepare killed in ``out`` left (its stream ``tokens.tmp``, the temporaries of
    shards, tokenizer.json and manifest.json being written); a note naming them, if any."""
    names = []
    for entry in sorted(os.scandir(out), key=lambda e: e.name):
        of = temporary_of(entry.name)
        if (entry.name == TOKENS_TMP or of in (MANIFEST, "tokenizer.json") or of is not None and SHARD_NAME.match(of)) \
                and not entry.is_dir(follow_symlinks=False):
            (out / entry.name).unlink(missing_ok=True)  # (a link goes, its target stays)
            names.append(entry.name)
    return [f"removed what an interrupted prepare left in {out}: {', '.join(names)}"] if names else []


def tokenizer_of(spec, paths: list[str], progress: bool, notes: list[str]) -> tuple[str | None, dict]:
    """(tokenizer.json text or None for bytes, the manifest's "tokenizer" entry) for ``spec``; a BPE
    is learned from the text files ``paths`` here (a note added if it learned fewer tokens than asked)."""
    if spec.kind == "bytes":
        return None, {"kind": "bytes", "vocab": 256}
    if spec.kind == "file":
        return spec.json, {"kind": "file", "vocab": spec.vocab, "sha256": spec.sha256, "source": spec.source}
    texts = (chunk.decode("utf-8") for path in paths for _, chunk in chunks(path))
    text, learned = train_bpe(texts, spec.vocab, progress)
    if learned < spec.vocab:
        notes.append(f"bpe:{spec.vocab} learned {learned:,} tokens: by then every word of the text was one token, "
                     "and nothing was left to merge")
    return text, {"kind": "bpe", "vocab": learned, "asked_vocab": spec.vocab,
                  "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}


def previous_manifest(out: Path) -> tuple[dict | None, str | None]:
    """(the manifest in ``out``, None), or (None, why it cannot be used), or (None, None) if there is none."""
    if not os.path.lexists(out / MANIFEST):
        return None, None
    try:
        return read_manifest(out), None
    except DataError as e:
        return None, str(e)


def difference(out: Path, old: dict, inputs: list[dict], spec, val_fraction: float, shard_tokens: int) -> str | None:
    """Why folder ``out``, described by manifest ``old``, is not what preparing ``inputs`` with these
    settings would write; None if it is (every file it names hashes to the manifest's SHA-256)."""
    if (old.get("format"), old.get("version")) != (FORMAT, VERSION):
        return f"{MANIFEST} is not {FORMAT} version {VERSION}"
    if old.get("inputs") != inputs:
        before = old.get("inputs") if isinstance(old.get("inputs"), list) else []
        same_paths = [o.get("path") if isinstance(o, dict) else None for o in before] == [e["path"] for e in inputs]
        if not same_paths:
            return "the inputs are not those it was prepared from"
        return f"{next(e['path'] for o, e in zip(before, inputs) if o != e)} changed since it was prepared"
    was = old["tokenizer"]
    if (was["kind"], was.get("asked_vocab"), was.get("sha256") if was["kind"] == "file" else None) != \
            (spec.kind, spec.vocab if spec.kind == "bpe" else None, spec.sha256):
        return "the tokenizer is not the one it was prepared with"
    if old.get("val_fraction") != val_fraction or old.get("shard_tokens") != shard_tokens:
        return (f"--val-fraction {val_fraction} --shard-tokens {shard_tokens} are not the ones it was prepared with "
                f"({old.get('val_fraction')}, {old.get('shard_tokens')})")
    named = [(e["name"], e["sha256"]) for e in old["shards"]]
    if was["kind"] != "bytes":
        named.append(("tokenizer.json", was.get("sha256")))
    for name, sha256 in named:
        if not os.path.lexists(out / name):
            return f"{name}: missing"
        try:
            if file_sha256(out / name) != sha256:
                return f"{name}: its SHA-256 differs from the manifest"
        except (Unreadable, OSError) as e:  # a FIFO, a folder, a read error
            return f"{name}: cannot be read ({e})"
    return None


def encode_to(tmp: Path, paths: list[str], tokenizer_json: str | None, workers: int, total_bytes: int,
              progress: bool) -> int:
    """Encode the text files ``paths`` into ``tmp`` as one stream of raw uint16 ids; their number."""
    stream = (chunk for path in paths for _, chunk in chunks(path))
    n = 0
    try:
        with create(tmp) as f, tqdm(total=total_bytes, unit="B", unit_scale=True, desc="encoding", leave=False,
                                    disable=None if progress else True) as bar:
            for size, ids in encode_in_order(stream, tokenizer_json, workers):
                f.write(memoryview(ids.astype("<u2", copy=False)))  # (a failed write says why: its errno)
                n += ids.size
                bar.update(size)
    except OSError as e:
        raise naming(e, tmp) from e
    return n


def write_shards(out: Path, tmp: Path, split: str, lo: int, hi: int, shard_tokens: int) -> list[dict]:
    """Tokens ``[lo, hi)`` of the stream in ``tmp`` as shards ``split``_000000.bin, ... of at most
    ``shard_tokens``; their manifest entries."""
    entries = []
    for k, first in enumerate(range(lo, hi, shard_tokens)):
        tokens = np.fromfile(tmp, dtype="<u2", count=min(shard_tokens, hi - first), offset=2 * first)  # (count,)
        name = f"{split}_{k:06d}.bin"
        write_shard(out / name, tokens)
        entries.append({"name": name, "split": split, "tokens": int(tokens.size), "largest": int(tokens.max()),
                        "sha256": file_sha256(out / name)})
    return entries


def summary(out, result: Prepared) -> str:
    """One line: what ``out`` holds, and (when it was written) how fast the text went."""
    shards = result.manifest["shards"]
    total = sum(e["tokens"] for e in shards)
    if result.cached:
        return f"{out} is up to date: {len(shards)} shards, {total:,} tokens (nothing to do)"
    counts = {split: [e["tokens"] for e in shards if e["split"] == split] for split in ("train", "val")}
    text = sum(e["bytes"] for e in result.manifest["inputs"])
    split = ", ".join(f"{name} {sum(c):,} in {len(c)} shard{'s' * (len(c) > 1)}" for name, c in counts.items())
    return (f"{out}: {total:,} tokens ({split}), vocabulary {result.manifest['vocab_size']:,}, {text / 1e6:,.1f} MB "
            f"of text in {result.seconds:.1f} s ({text / 1e6 / max(result.seconds, 1e-9):,.1f} MB/s)")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise PrepareError(f"{message} (--help lists the flags)")


def main(argv=None) -> int:
    """The command line: prepare, print the notes and a summary; a refusal is one line on stderr and exit 2."""
    parser = _Parser(prog="python -m minidist.data.prepare", description="Tokenize text files into llm.c shards "
                     "and a manifest.json that python -m minidist.train --data DIR reads. Run again, it does nothing "
                     "unless an input, the tokenizer, a flag or a file in DIR changed.")
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="UTF-8 text files, read in this order")
    parser.add_argument("--out", required=True, metavar="DIR", help="the folder of the shards and manifest.json")
    parser.add_argument("--tokenizer", default="bytes", metavar="SPEC", help="bytes (the default: a token per byte), "
                        "bpe:VOCAB (learn a byte-level BPE from the inputs), or the path of a tokenizer.json")
    parser.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                        help="the last fraction of the tokens, which validates (default 0.1)")
    parser.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS, metavar="N",
                        help=f"tokens per shard, at most (default {SHARD_TOKENS:_})")
    parser.add_argument("--workers", type=int, metavar="N", help="encoding processes (default: one per CPU)")
    try:
        args = parser.parse_args(argv)
        result = prepare(args.inputs, args.out, args.tokenizer, args.val_fraction, args.shard_tokens, args.workers,
                         progress=True)
    except (PrepareError, OSError) as e:  # a refusal: 2; a disk or a file that failed (named): 1
        print(f"minidist.data.prepare: {e}", file=sys.stderr)
        raise SystemExit(2 if isinstance(e, PrepareError) else 1) from None
    print("\n".join(result.notes + [summary(args.out, result)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
