"""What reading the data costs a step, measured side by side in one run.

    python benchmarks/data_loading.py                  (about two minutes on 2 cores)
    python benchmarks/data_loading.py --gpt2-steps 0   (without the GPT-2 small step: seconds)

1. The loader against the step: the time to read one step's batch from token shards (one process,
   whole windows: ``DistributedSampler.batch``, one ``os.pread`` per window) against the time of
   the training step on it (forward, backward, AdamW; float32), for the default model (B 16 x T 64)
   and GPT-2 small's sizes (124M parameters, vocabulary 50,257; B 2 x T 1,024: the step is timed
   ``--gpt2-steps`` times), as a ratio.
2. Bytes read per rank against the formula (rows x positions read x 2 bytes) for the layouts of the
   tests, counted by the reader itself (``Tokens.bytes_read``): equal, or the script fails.
3. The step's wait for data, with and without prefetch (data/prefetch.py), on storage slowed to
   ``--delay`` ms a read (a sleep before each read: a network file system's latency) and on the page
   cache, for the default model's real step: the mean wait per step after the first.

Shards: the generated corpus (bytes as uint16 tokens, llm.c's format) or, for GPT-2's sizes, random
ids below 50,257, written to a temporary folder (the page cache: what it measures is the loader's
own cost, not a disk's). Results: a Markdown table on stdout and benchmarks/results/data_loading.json.
"""
import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from minidist.data import grammar_text  # noqa: E402
from minidist.data.folder import open_corpus  # noqa: E402
from minidist.data.prefetch import Prefetcher  # noqa: E402
from minidist.data.shards import write_shard  # noqa: E402
from minidist.parallel.data.sampler import DistributedSampler  # noqa: E402
from minidist.parallel.step import train_step  # noqa: E402
from minidist.train.build import build_parallel, world_of_one  # noqa: E402
from minidist.train.config import TrainConfig  # noqa: E402
from minidist.train.feed import rank_spans  # noqa: E402
from minidist.parallel.mesh import DeviceMesh  # noqa: E402

SIZES = {
    "default (2 x 64, vocab 256)": dict(n_layer=2, n_head=4, n_embd=64, block_size=64, batch_size=16, vocab_size=256),
    "GPT-2 small (12 x 768, vocab 50,257)": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, batch_size=2,
                                                 vocab_size=50257),
}
LAYOUTS = {"one process": {}, "dp 2": dict(dp=2), "cp 2": dict(cp=2), "cp 2 zigzag": dict(cp=2, cp_algorithm="zigzag"),
           "pp 2": dict(pp=2), "dp 2 x cp 2 x pp 2": dict(dp=2, cp=2, pp=2)}


def shards(folder: Path, vocab: int, n: int = 4_000_000) -> Path:
    """An llm.c folder of ``n`` train tokens (4 shards) and n/10 val: the grammar's bytes, or random ids."""
    folder.mkdir(parents=True, exist_ok=True)
    tokens = (np.frombuffer(grammar_text(n + n // 10).encode(), np.uint8)[:n + n // 10].astype(np.uint16) if vocab == 256
              else np.random.default_rng(0).integers(0, vocab, n + n // 10).astype(np.uint16))
    for i in range(4):
        write_shard(folder / f"b_train_{i:06d}.bin", tokens[i * n // 4:(i + 1) * n // 4])
    write_shard(folder / "b_val_000000.bin", tokens[n:])
    return folder


def model_step(cfg):
    """(step(batch) -> None, the step's batch shape): one process's training step of ``cfg``."""
    mesh = DeviceMesh(world_of_one())
    model, state, engine = build_parallel(cfg, mesh)
    return lambda batch: train_step(model, state, batch, 1e-4, 1.0, engine=engine, mesh=mesh)


def loader_vs_step(root: Path, gpt2_steps: int) -> list[dict]:
    rows = []
    for name, size in SIZES.items():
        if "GPT-2" in name and gpt2_steps == 0:
            continue
        folder = shards(root / f"v{size['vocab_size']}", size["vocab_size"])
        cfg = TrainConfig(**size, data=str(folder))
        sampler = DistributedSampler(open_corpus(folder).train, cfg.batch_size, cfg.block_size, 0, 0, 1)
        reads = []
        for step in range(200):
            t0 = time.perf_counter()
            batch = sampler.batch(step)
            reads.append(time.perf_counter() - t0)
        step_fn, steps = model_step(cfg), []
        for step in range(gpt2_steps + 1 if "GPT-2" in name else 12):
            t0 = time.perf_counter()
            step_fn(sampler.batch(step))
            steps.append(time.perf_counter() - t0)
        read, compute = statistics.median(reads), statistics.median(steps[1:])
        rows.append(dict(model=name, batch=f"{cfg.batch_size} x {cfg.block_size + 1}", read_ms=1e3 * read,
                         step_ms=1e3 * compute, ratio=read / compute, bytes=batch.shape[0] * batch.shape[1] * 2))
    return rows


def bytes_per_rank(root: Path) -> list[dict]:
    folder = shards(root / "v256", 256)
    rows = []
    for name, layout in LAYOUTS.items():
        cfg = TrainConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, batch_size=16, **layout)
        per_rank = []
        for d in range(cfg.dp):
            for p in range(cfg.pp):
                for c in range(cfg.cp):
                    tokens = open_corpus(folder).train
                    sampler = DistributedSampler(tokens, cfg.batch_size, cfg.block_size, 0, d, cfg.dp,
                                                 spans=rank_spans(cfg, types.SimpleNamespace(pp_rank=p, cp_rank=c)))
                    sampler.batch(5)
                    assert tokens.bytes_read == sampler.bytes_per_step(), (name, d, p, c)
                    per_rank.append(tokens.bytes_read)
        whole = cfg.batch_size * (cfg.block_size + 1) * 2
        rows.append(dict(layout=name, ranks=len(per_rank), per_rank=sorted(set(per_rank)), total=sum(per_rank),
                         whole_batch=whole))
    return rows


class Slow:
    """``read(step)`` after a sleep of ``delay`` s: storage with latency."""

    def __init__(self, read, delay):
        self.read, self.delay = read, delay

    def __call__(self, step):
        time.sleep(self.delay)
        return self.read(step)


def prefetch_wait(root: Path, delay: float, steps: int = 30) -> list[dict]:
    folder = shards(root / "v256", 256)
    cfg = TrainConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, batch_size=16, data=str(folder))
    sampler = DistributedSampler(open_corpus(folder).train, cfg.batch_size, cfg.block_size, 0, 0, 1)
    step_fn = model_step(cfg)
    rows = []
    for storage, d in (("page cache", 0.0), (f"{1e3 * delay:.0f} ms a read", delay)):
        for ahead in (False, True):
            waits, computes = [], []
            with Prefetcher(Slow(sampler.batch, d), range(steps), ahead=ahead) as reads:
                for step in range(steps):
                    got = reads.get(step)
                    t0 = time.perf_counter()
                    step_fn(got.batch)
                    waits.append(got.wait_s)
                    computes.append(time.perf_counter() - t0)
            rows.append(dict(storage=storage, prefetch=ahead, wait_ms=1e3 * statistics.mean(waits[1:]),
                             step_ms=1e3 * statistics.median(computes[1:])))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpt2-steps", type=int, default=1, help="GPT-2 small steps timed (0: skip it)")
    p.add_argument("--delay", type=float, default=0.005, help="seconds a slowed read sleeps")
    args = p.parse_args()
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="minidist-bench-data-") as tmp:
        root = Path(tmp)
        results = dict(machine=platform.machine(), load_before=load, loader=loader_vs_step(root, args.gpt2_steps),
                       bytes=bytes_per_rank(root), prefetch=prefetch_wait(root, args.delay))
    results["load_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"load before: {results['load_before']}\nload after:  {results['load_after']}\n")
    print("| model | batch (rows x tokens) | read a batch | a training step | read / step |\n|---|---|---|---|---|")
    for r in results["loader"]:
        print(f"| {r['model']} | {r['batch']} | {r['read_ms']:.3f} ms | {r['step_ms']:.1f} ms | {r['ratio']:.2e} |")
    print("\n| layout (B 16 x T 64, uint16) | ranks | bytes a rank reads a step | all ranks | the whole batch |\n"
          "|---|---|---|---|---|")
    for r in results["bytes"]:
        print(f"| {r['layout']} | {r['ranks']} | {', '.join(f'{b:,}' for b in r['per_rank'])} (= formula) | "
              f"{r['total']:,} | {r['whole_batch']:,} |")
    print("\n| storage | prefetch | the step's wait for data | the step's compute |\n|---|---|---|---|")
    for r in results["prefetch"]:
        print(f"| {r['storage']} | {'yes' if r['prefetch'] else 'no'} | {r['wait_ms']:.3f} ms | {r['step_ms']:.1f} ms |")
    out = REPO / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "data_loading.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
