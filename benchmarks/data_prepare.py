"""Data preparation throughput: ``python -m minidist.data.prepare`` in MB of text per second, for the
bytes tokenizer and a byte-level BPE, with 1 and 2 worker processes, beside the ``tokenizers``
package encoding the same chunks by itself.

    python benchmarks/data_prepare.py                  # 20 MB of the generated corpus, bpe:4096
    python benchmarks/data_prepare.py --mb 100 --vocab 8192 --workers 1,2,4 --json results/data_prepare.json

Rows, each a whole ``prepare`` into a fresh folder (hashing the text, encoding it, writing and
hashing the shards, fsyncing each file) unless it says otherwise:
- ``bytes``: one token per byte (encoded in the main process whatever --workers says: a byte is its token).
- ``bpe:VOCAB learn + encode``: the BPE learned from the text first (tokenizers' trainer, its own threads).
- ``tokenizer.json encode``: the same BPE given as a file: encoding alone, no learning.
- ``tokenizers encode_batch``: the yardstick, ``Tokenizer.encode_batch`` on the same chunks (already
  decoded, in memory), one process and its Rust threads; ``tokenizers encode``: the same chunk by chunk on
  one thread, which is what one minidist worker does per chunk.
- ``cache hit``: the bytes folder prepared again: the inputs and every shard hashed, nothing written.
The ratio column is each row's MB/s over ``tokenizers encode_batch``'s.

The generated corpus (minidist.data.grammar_text) has about 60 words, so a BPE learns every word
whole within about 500 tokens and stops there, however large VOCAB is; the table says how many it learned.
"""
import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from minidist.data import grammar_text
from minidist.data.encode import chunks
from minidist.data.prepare import prepare


def timed(fn):
    """(seconds, result) of fn()."""
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=20.0, help="MB of generated text (default 20)")
    parser.add_argument("--vocab", type=int, default=4096, help="the BPE's vocabulary asked (default 4096)")
    parser.add_argument("--workers", default="1,2", help="worker counts, comma-separated (default 1,2)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each row; the fastest counts (default 1)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    workers = [int(w) for w in args.workers.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text = tmp / "text.txt"
        text.write_text(grammar_text(int(args.mb * 1e6)), encoding="utf-8")
        mb = text.stat().st_size / 1e6

        def run(name, n_workers, tokenizer, folder=None):
            best = None
            for repeat in range(args.repeats):
                out = folder or tmp / f"{name.split()[0].replace(':', '')}-{n_workers}-{repeat}"
                result = prepare([text], out, tokenizer=tokenizer, workers=n_workers)
                best = result if best is None or result.seconds < best.seconds else best
            shards = best.manifest["shards"]
            rows.append({"what": name, "workers": n_workers, "seconds": best.seconds,
                         "vocab": best.manifest["vocab_size"], "tokens": sum(e["tokens"] for e in shards)})
            return out

        for n in workers:
            bytes_folder = run("bytes", n, "bytes")
        for n in workers:
            bpe_folder = run(f"bpe:{args.vocab} learn + encode", n, f"bpe:{args.vocab}")
        for n in workers:
            run("tokenizer.json encode", n, str(bpe_folder / "tokenizer.json"))
        run("cache hit (bytes)", workers[-1], "bytes", folder=bytes_folder)

        tokenizer = Tokenizer.from_file(str(bpe_folder / "tokenizer.json"))
        pieces = [chunk.decode("utf-8") for _, chunk in chunks(text)]
        for name, threads, encode in (
                ("tokenizers encode_batch", f"1 process, {os.cpu_count()} threads",
                 lambda: tokenizer.encode_batch(pieces, add_special_tokens=False)),
                ("tokenizers encode", "1 thread",
                 lambda: [tokenizer.encode(p, add_special_tokens=False) for p in pieces])):
            seconds = min(timed(encode)[0] for _ in range(args.repeats))
            rows.append({"what": name, "workers": threads, "seconds": seconds, "vocab": tokenizer.get_vocab_size(),
                         "tokens": sum(len(e.ids) for e in encode())})

    yardstick = next(r["seconds"] for r in rows if r["what"] == "tokenizers encode_batch")
    print(f"{mb:.1f} MB of generated text ({len(pieces)} chunks), {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n")
    print("| what | workers | vocab | tokens | seconds | MB/s | vs encode_batch |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        r["mb_per_s"], r["ratio"] = mb / r["seconds"], yardstick / r["seconds"]
        print(f"| {r['what']} | {r['workers']} | {r['vocab']:,} | {r['tokens']:,} | {r['seconds']:.2f} | "
              f"{r['mb_per_s']:.1f} | {r['ratio']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"mb": mb, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
