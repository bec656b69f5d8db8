"""Lesson 17: data at scale: token shards prepared once, each rank reading only its bytes, the next
batch read while this step computes.

    python tutorials/17_data_shards.py                        (one process: the ranks of part 2 are threads)
    python tutorials/17_data_shards.py --png data.png         (also draw who reads what, and the prefetch)

A real corpus is not a text file read at every start. It is tokenized once into SHARDS, files of
token ids (llm.c's format: a 1,024-byte header, then uint16 ids), with a manifest that records each
shard's size and SHA-256 (``python -m minidist.data.prepare``, minidist/data/prepare.py). A run
opens the shards without reading them (data/folder.py) and then reads, at every step, only what it
uses (data/tokens.py: one ``os.pread`` per window, every byte counted):

    a dp rank       its B/dp rows of the global batch (the windows' starts: drawn from (seed, step))
    a cp rank       of each window only its chunks of the sequence, plus the next token as targets
    a pp stage      the first the ids, the last the targets, the stages between them nothing
    a tp rank       what its tp group's other ranks read (every one of them needs the ids)

And it reads step s + 1's rows in a thread while step s computes (data/prefetch.py): when storage
keeps up, the step never waits for data.

  1. Prepare the generated corpus into shards; prepare again: the cache (nothing written).
  2. A dp 2 x cp 2 x pp 2 run (8 thread ranks): which rows and positions of which shard each rank
     reads for one step, in bytes, against the formula; together they read every token once per
     (tp) copy, and their run equals one process on the full batch.
  3. Prefetch on slow storage (a read made to take a few ms): the step's wait for data with and
     without it (printed: measured on a shared machine), the batches bitwise equal.
"""
import argparse
import contextlib
import io
import tempfile
import time
import types
from pathlib import Path

import numpy as np

import minidist
from minidist.data import grammar_text
from minidist.data.dataset import window_starts
from minidist.data.folder import open_corpus
from minidist.data.prefetch import Prefetcher
from minidist.data.prepare import prepare
from minidist.launch_check import check_launch
from minidist.parallel.data.sampler import DistributedSampler
from minidist.train import train
from minidist.train.config import TrainConfig
from minidist.train.feed import rank_spans

LAYOUT = dict(dp=2, cp=2, pp=2, micro_batches=2, cp_algorithm="zigzag")
RUN = dict(n_layer=2, n_head=2, n_embd=16, block_size=16, batch_size=4, steps=2, eval_every=100, eval_iters=1,
           sample_tokens=0, dtype="float64", seed=1)
STEP = 0  # the step whose reads part 2 shows


def part1(root: Path):
    print("=== 1. prepare once: text -> token shards + manifest, and the cache ===")
    text = root / "corpus.txt"
    text.write_text(grammar_text(2_000_000, seed=1))
    first = prepare([text], root / "shards", shard_tokens=600_000, workers=2)
    again = prepare([text], root / "shards", shard_tokens=600_000, workers=2)
    for name, result in (("first", first), ("again", again)):
        shards = ", ".join(f"{s['name']} ({s['tokens']:,})" for s in result.manifest["shards"])
        print(f"  {name}: {'cached, nothing written' if result.cached else 'prepared'} in {result.seconds:.2f} s"
              + (f": {shards}" if not result.cached else ""))
    assert not first.cached and again.cached and first.manifest == again.manifest
    print("  the second run hashed the input and every shard, found them as the manifest says, and wrote nothing")
    return root / "shards"


def reads_of(folder: Path, cfg: TrainConfig):
    """Every rank's (dp, pp, cp) coordinates, the positions of each window it reads, the bytes it
    read for step STEP, and which shard bytes they were."""
    rows = []
    for d in range(cfg.dp):
        for p in range(cfg.pp):
            for c in range(cfg.cp):
                tokens = open_corpus(folder).train
                sampler = DistributedSampler(tokens, cfg.batch_size, cfg.block_size, cfg.seed, d, cfg.dp,
                                             spans=rank_spans(cfg, types.SimpleNamespace(pp_rank=p, cp_rank=c)))
                sampler.batch(STEP)
                rows.append(dict(d=d, p=p, c=c, rows=sampler.rows, spans=sampler.spans, read=tokens.bytes_read,
                                 formula=sampler.bytes_per_step(), shards=shard_ranges(tokens, sampler)))
    return rows


def shard_ranges(tokens, sampler):
    """The (shard name, first byte, last byte + 1) of the first window this rank read."""
    start = int(window_starts(len(tokens), STEP, sampler.batch_size, sampler.block_size, sampler.seed)[sampler.rows[0]])
    size = tokens.dtype.itemsize
    return [(Path(part.path).name, part.offset + size * first, part.offset + size * (first + n))
            for a, b in sampler.spans for part, first, n in tokens.pieces(start + a, start + b)]


def part2(folder: Path):
    cfg = TrainConfig(**RUN, **LAYOUT, data=str(folder))
    T, B = cfg.block_size, cfg.batch_size
    print(f"\n=== 2. who reads which bytes: dp {cfg.dp} x cp {cfg.cp} ({cfg.cp_algorithm}) x pp {cfg.pp}, "
          f"B = {B} windows of T + 1 = {T + 1} tokens, uint16 ===")
    rows = reads_of(folder, cfg)
    print(f"  {'rank':<16}{'rows':<8}{'positions of each window':<30}{'bytes':>7}  first window's bytes")
    for r in rows:
        spans = " + ".join(f"{a}..{b - 1}" for a, b in r["spans"]) or "none (a middle stage)"
        where = ", ".join(f"{name} {lo:,}-{hi - 1:,}" for name, lo, hi in r["shards"]) or "-"
        print(f"  dp {r['d']} pp {r['p']} cp {r['c']}   {str([int(i) for i in r['rows']]):<8}{spans:<30}{r['read']:>7}  {where}")
        assert r["read"] == r["formula"], r
    per_window = {(r["p"], r["c"]): sum(b - a for a, b in r["spans"]) for r in rows if r["d"] == 0}
    print(f"  each rank reads rows x positions x 2 bytes: on stage 0 the ids of its cp chunks (T/cp = {T // cfg.cp} "
          f"positions of each window),\n  on stage {cfg.pp - 1} their targets, the same positions shifted by one")
    whole = (T + 1) * 2 * B
    total = sum(r["read"] for r in rows)
    print(f"  together: {total:,} bytes for a batch of {whole:,} bytes ({B} rows x {T + 1} tokens x 2 bytes): the ids "
          f"once on stage 0, the targets once on stage "
          f"{cfg.pp - 1} ({total / whole:.2f}x, against {cfg.dp * cfg.pp * cfg.cp}x if every rank read the whole batch)")
    if cfg.pp == 2:  # stage 0: its chunks' ids; stage 1: the same positions shifted by one, their targets
        assert set(per_window.values()) == {T // cfg.cp}, per_window
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer's own report: not this lesson's
        ref = train(TrainConfig(**RUN, data=str(folder)), progress=False)[1]
        ours = minidist.run_local(lambda g: train(cfg, progress=False, world=g)[1], cfg.dp * cfg.cp * cfg.pp)[0]
    print(f"  trained: losses {[round(r['loss'], 6) for r in ours]}, one process on the full batch "
          f"{[round(r['loss'], 6) for r in ref]}")
    np.testing.assert_allclose([r["loss"] for r in ours], [r["loss"] for r in ref], rtol=1e-10)
    return cfg, rows


class SlowStorage:
    """A read that takes ``delay`` seconds more, as from a disk or a network file system."""

    def __init__(self, sampler, delay: float):
        self.sampler, self.delay = sampler, delay

    def __call__(self, step):
        time.sleep(self.delay)  # the read's latency; the thread waits, the step's compute goes on
        return self.sampler.batch(step)


def step_compute(delay: float, ratio: float):
    """The step's compute: a fixed number of matmuls on fixed matrices, the same work at every step,
    chosen on this machine to last about ``ratio`` reads (one matmul timed once, before the runs)."""
    a = np.random.default_rng(0).standard_normal((256, 256)) / 16  # (256, 256): entries ~1/16, tanh stays O(1)

    def one():
        return np.tanh(a @ a)  # (256, 256); a never changes, so every call is the same work

    one()
    start = time.perf_counter()
    for _ in range(8):
        one()
    per = (time.perf_counter() - start) / 8
    n = max(1, int(np.ceil(ratio * delay / per)))

    def compute():
        for _ in range(n):
            one()
    return compute, n


def part3(folder: Path, steps: int = 8, delay: float = 0.02, ratio: float = 2.5):
    print(f"\n=== 3. the next batch read while this step computes: storage slowed to {1e3 * delay:.0f} ms a read ===")
    sampler = DistributedSampler(open_corpus(folder).train, 8, 64, 0, 0, 1)
    compute, n = step_compute(delay, ratio)
    print(f"  a step's compute: {n} matmuls of (256, 256) at every step, sized on this machine to ~{ratio:g} reads")
    timelines, batches, waits = {}, {}, {}
    for ahead in (False, True):
        events, got = [], []
        t0 = time.perf_counter()
        with Prefetcher(SlowStorage(sampler, delay), range(steps), ahead=ahead) as reads:
            for step in range(steps):
                f = reads.get(step)
                compute_start = time.perf_counter()
                compute()
                events.append((f.read_start - t0, f.read_end - t0, f.wait_s, compute_start - t0,
                               time.perf_counter() - t0))
                got.append(f.batch)
        timelines[ahead], batches[ahead] = events, got
        waits[ahead] = sum(e[2] for e in events[1:]) / (steps - 1)
        compute_s = sum(e[4] - e[3] for e in events[1:]) / (steps - 1)
        print(f"  {'with prefetch' if ahead else 'without':<15} each step waited {1e3 * waits[ahead]:5.1f} ms for its "
              f"batch (mean after the first), then computed for {1e3 * compute_s:5.1f} ms")
    assert all(a.tobytes() == b.tobytes() for a, b in zip(batches[False], batches[True]))
    print("  with prefetch the read of step s + 1 ran during step s's compute: a wait of ~0 whenever the read is the\n"
          "  shorter of the two. The batches are the same, bitwise: only WHEN the bytes are read changed")
    print("  (times measured on a shared machine: printed, never asserted)")
    return timelines, waits, delay


def draw(path: str, cfg, rows, prefetch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    timelines, waits, delay = prefetch
    fig = plt.figure(figsize=(12, 8.5))
    grid = fig.add_gridspec(3, 4, height_ratios=[1, 1, 1.5])
    T, B = cfg.block_size, cfg.batch_size
    for k, r in enumerate(rows):
        ax = fig.add_subplot(grid[k // 4, k % 4])
        mask = np.zeros((B, T + 1))
        for a, b in r["spans"]:
            mask[np.asarray(r["rows"])[:, None], np.arange(a, b)] = 1
        ax.imshow(mask, cmap="Blues", vmin=0, vmax=1.3, aspect="auto")
        ax.set_title(f"dp {r['d']} pp {r['p']} cp {r['c']}: {r['read']} B of "
                     + ("ids" if r["p"] == 0 else "targets"), fontsize=9)
        ax.set_xticks([0, T // 2, T]), ax.set_yticks(range(B))
        ax.set_xlabel("position in the window", fontsize=8), ax.set_ylabel("row of the batch", fontsize=8)
        ax.tick_params(labelsize=8)
    ax = fig.add_subplot(grid[2, :])
    colors = {"read": "#e8a33d", "compute": "#3b75af", "wait": "#b0b0b0"}
    ticks, names = [], []
    for y, ahead in ((2.6, False), (0, True)):  # without on top, as the text tells it
        for step, (read_start, read_end, wait, c0, c1) in enumerate(timelines[ahead]):
            bars = [(y + 0.5, read_start, read_end, colors["read"]), (y - 0.5, c0, c1, colors["compute"])]
            if wait > 1e-4:
                bars.append((y - 0.5, c0 - wait, c0, colors["wait"]))
            for row, lo, hi, color in bars:
                ax.barh(row, 1e3 * (hi - lo), left=1e3 * lo, height=0.8, color=color, edgecolor="white", linewidth=1.5)
            for row, lo, hi in ((y + 0.5, read_start, read_end), (y - 0.5, c0, c1)):  # the step each bar serves
                if hi - lo > 0.012:
                    ax.text(1e3 * (lo + hi) / 2, row, str(step), ha="center", va="center", fontsize=8, color="white")
        label = "with prefetch" if ahead else "without prefetch"
        ticks += [y + 0.5, y - 0.5]
        names += [f"{label}: reads" + (" (a thread)" if ahead else ""),
                  f"steps: mean wait {1e3 * waits[ahead]:.1f} ms"]
    ax.set_yticks(ticks, names, fontsize=9)
    ax.set_ylim(-1.1, 3.7), ax.set_xlim(left=0)
    ax.set_xlabel("time since the run started (ms); each bar numbered with the step it serves", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(handles=[Patch(color=colors["read"], label=f"a batch read ({1e3 * delay:.0f} ms of slowed storage)"),
                       Patch(color=colors["compute"], label="a step's compute (the same matmuls every step)"),
                       Patch(color=colors["wait"], label="the step waiting for its batch")],
              loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize=9, frameon=False)
    ax.set_title(f"3. Measured on this machine: each step waits {1e3 * waits[False]:.1f} ms for its batch without "
                 f"prefetch, {1e3 * waits[True]:.1f} ms with it (mean over steps 1-{len(timelines[True]) - 1})",
                 fontsize=10)
    fig.suptitle("2. Each rank reads only its rows and positions (blue) of the global batch, dp 2 x pp 2 x cp 2",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--png", help="draw who reads what, and the prefetch's timeline, into this file")
    args = parser.parse_args()
    check_launch(parser, args, mpiexec=False)
    with tempfile.TemporaryDirectory(prefix="minidist-lesson17-") as tmp:
        folder = part1(Path(tmp))
        cfg, rows = part2(folder)
        prefetch = part3(folder)
        if args.png:
            draw(args.png, cfg, rows, prefetch)
    print("\nTry:\n  1. LAYOUT = dict(dp=2, cp=2) (no pipeline, the ring's contiguous chunks): each rank reads T/cp + 1 = 9\n"
          "     positions of each window, its chunk's ids and one target more: 2 rows x 9 x 2 = 36 B\n"
          "  2. part3(folder, ratio=0.5): a step's compute half as long as the read; with prefetch the step still\n"
          "     waits, about read - compute = 10 ms: prefetch hides as much of the read as the step computes\n"
          "  3. python -m minidist.data.prepare corpus.txt --out shards --tokenizer bpe:512, then\n"
          "     python -m minidist.train --data shards: a vocabulary of 512 from the manifest, the sample decoded by it")
    print("\nEach rank read only its rows and positions, the run equals one process, and the prefetched batches are "
          "the synchronous ones. All checks passed.")


if __name__ == "__main__":
    main()
