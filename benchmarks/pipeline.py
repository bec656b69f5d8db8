"""Benchmark: step time and measured bubble of GPipe, 1F1B and interleaved 1F1B at several m.

    mpiexec -n 2 python benchmarks/pipeline.py            # pp = 2 over MPI
    mpiexec -n 4 python benchmarks/pipeline.py --steps 3  # pp = 4 (oversubscribed on 2 cores)

A GPT (8 blocks, 64 wide, float32) with a fixed global batch of 32 sequences of 64 tokens; each
schedule runs ``--steps`` steps after one warm-up step. Per configuration: median step time, the
measured bubble of the fastest step (from the trace's F/B spans: 1 - busy / step, averaged over
ranks) and the ideal (p-1)/(v m + p-1). Rank 0 prints a markdown table and writes JSON to
benchmarks/results/pipeline_<p>ranks.json.
"""
import argparse
import json
import time
from pathlib import Path

import numpy as np

import minidist
from minidist.data import get_batch
from minidist.model import GPT, GPTConfig
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.pipeline import (PipelineEngine, PipelineStage, compute_spans, executed_timeline,
                                        gather_spans, split_micro_batches)

CONFIG = GPTConfig(n_layer=8, n_head=4, n_embd=64, block_size=64)
BATCH = 32
TOKENS = np.random.default_rng(0).integers(0, 256, size=100_000)


def measure(world, schedule, m, v, steps):
    mesh = DeviceMesh(world, pp=world.size)
    stage = PipelineStage(GPT(CONFIG, seed=0), mesh.pp_rank, world.size, v)
    engine = PipelineEngine(stage, mesh, schedule, m, v)
    times, bubbles = [], []
    for step in range(steps + 1):
        micro = split_micro_batches(get_batch(TOKENS, step, BATCH, CONFIG.block_size), m)
        stage.zero_grad()
        world.barrier()
        world.trace.clear()
        start = time.perf_counter()
        engine.forward_backward(micro)
        engine.all_reduce_tied_grads()
        elapsed = np.array([time.perf_counter() - start])
        world.all_reduce(elapsed, op="max")
        spans = gather_spans(world, compute_spans(world.trace))
        if step > 0:  # step 0 warms up
            times.append(float(elapsed[0]))
            bubbles.append(executed_timeline(spans).bubble() if world.rank == 0 else 0.0)
    return dict(schedule=schedule, pp=world.size, m=m, v=v, step_ms=1e3 * float(np.median(times)),
                bubble=min(bubbles), ideal=engine.ideal.bubble())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    args = ap.parse_args()
    world = minidist.init()
    rows = []
    for m in args.micro_batches:
        for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
            if m % world.size == 0 or schedule != "interleaved":
                rows.append(measure(world, schedule, m, v, args.steps))
    if world.rank == 0:
        print("| schedule | p | m | v | step (ms) | bubble measured | bubble ideal (p-1)/(vm+p-1) |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['schedule']} | {r['pp']} | {r['m']} | {r['v']} | {r['step_ms']:.1f} | "
                  f"{100 * r['bubble']:.1f}% | {100 * r['ideal']:.1f}% |")
        out = Path(__file__).resolve().parent / "results" / f"pipeline_{world.size}ranks.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
