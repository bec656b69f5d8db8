"""What the start-up hash check of a prepared folder costs: ``python benchmarks/data_hash.py [--folder DIR]``.

A run's start opens its ``--data`` folder on every rank (data/folder.py's ``open_corpus``): every
shard's header, then every shard's SHA-256 against its manifest. This writes a 1 GiB prepared folder
(8 train shards of 64 Mi uint16 tokens, one val shard of 1 Mi; random ids below GPT-2's 50,257; made
once, kept in DIR) and times ``open_corpus`` three times with the hash check and three times with
the hashes taken from the manifest (the headers alone), plus SHA-256 of 1 GiB already in memory.
The page cache is warm after the first round (the folder was just read or written).
"""
import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from minidist.data import folder as data_folder
from minidist.data.shards import write_shard
from minidist.untrusted import file_sha256

SHARD_TOKENS, VAL_TOKENS, VOCAB = 64 << 20, 1 << 20, 50257


def make(root: Path) -> None:
    """A 1 GiB prepared folder at ``root`` (nothing done when its manifest is there)."""
    if (root / "manifest.json").exists():
        return
    root.mkdir(parents=True, exist_ok=True)
    rng, shards = np.random.default_rng(0), []
    for split, k, n in [("train", i, SHARD_TOKENS) for i in range(8)] + [("val", 0, VAL_TOKENS)]:
        name = f"{split}_{k:06d}.bin"
        tokens = rng.integers(0, VOCAB, n, dtype=np.uint16)
        write_shard(root / name, tokens)
        shards.append(dict(name=name, split=split, tokens=n, largest=int(tokens.max()), sha256=file_sha256(root / name)))
    (root / "tokenizer.json").write_text("{}")
    (root / "manifest.json").write_text(json.dumps(dict(format="minidist-shards", version=1, vocab_size=VOCAB,
                                                        tokenizer=dict(kind="file", vocab=VOCAB), inputs=[],
                                                        val_fraction=0.1, shard_tokens=SHARD_TOKENS, shards=shards)))


def timed(f) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    f()
    return time.perf_counter() - wall, time.process_time() - cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default="/tmp/minidist-hash-1gib", help="where the 1 GiB folder is made and kept")
    root = Path(parser.parse_args().folder)
    make(root)
    size = sum(p.stat().st_size for p in root.glob("*.bin"))
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"{size / 2**30:.3f} GiB in {len(list(root.glob('*.bin')))} shards; CPU {cpu}, {os.cpu_count()} cores; "
          f"load {' '.join(open('/proc/loadavg').read().split()[:3])}")
    for _ in range(3):
        wall, used = timed(lambda: data_folder.open_corpus(root))
        print(f"open_corpus, every shard hashed: {wall:.2f} s wall, {used:.2f} s CPU ({size / 2**30 / wall:.2f} GiB/s)")
    recorded = {e["name"]: e["sha256"] for e in data_folder.read_manifest(root)["shards"]}
    real, data_folder.file_sha256 = data_folder.file_sha256, lambda path, error: recorded[Path(path).name]
    try:
        for _ in range(3):
            wall, used = timed(lambda: data_folder.open_corpus(root))
            print(f"open_corpus, headers only: {wall:.3f} s wall, {used:.3f} s CPU")
    finally:
        data_folder.file_sha256 = real
    block = os.urandom(1 << 20)
    wall, used = timed(lambda: [hashlib.sha256(block) for _ in range(1024)])
    print(f"SHA-256 of 1 GiB in memory: {wall:.2f} s wall, {used:.2f} s CPU ({1 / wall:.2f} GiB/s)")
    print(f"load after: {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()
