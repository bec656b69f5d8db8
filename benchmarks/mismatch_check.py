"""What the default mismatch check costs: all-reduce with and without it, side by side in one run.

    mpiexec -n 2 python benchmarks/mismatch_check.py
    mpiexec -n 4 python benchmarks/mismatch_check.py --sizes 1K,4M --repeats 15
    mpiexec -n 2 python benchmarks/mismatch_check.py --train dp2,tp2     # what it costs a training step

Two groups over the same MPI transport: one with ``check_calls=True`` (the default: every collective
first swaps a 56-byte fingerprint with its ring neighbours, ``minidist/comm/fingerprint.py``), one with
``check_calls=False``; a third, ``debug=True``, all-gathers the fingerprints instead. They are timed
ALTERNATELY, repeat by repeat, so a noisy neighbour hurts all of them alike. A repeat times ``iters``
back-to-back float32 all-reduces after a barrier; its time is the slowest rank's; the table shows the
median over repeats and the ratio to the unchecked group.

``--train LAYOUTS`` measures what matters to a training run instead: the trainer's step time (tiny
GPT, float32, AdamW) with the check on and off, runs alternating (off, on, off, on, ...), the median
step of each; and how many collectives a step issues.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import minidist
from minidist.comm.group import ProcessGroup
from minidist.comm.trace import Trace
from minidist.train import train
from minidist.train.config import TrainConfig

MODES = {"unchecked": dict(check_calls=False), "checked": dict(check_calls=True), "debug": dict(debug=True)}


def parse_size(text: str) -> int:
    units = {"K": 1024, "M": 1024 ** 2}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def time_calls(group, x, iters: int) -> float:
    """Seconds per all-reduce of the slowest rank, over ``iters`` calls started together."""
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        group.all_reduce(x)
    return MPI.COMM_WORLD.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX)


LAYOUTS = {"dp2": dict(dp=2), "tp2": dict(tp=2), "pp2": dict(pp=2, micro_batches=4), "dp2zero3": dict(dp=2, zero=3)}


def step_times(world, layout: str, check_calls: bool, steps: int) -> tuple[list, int]:
    """The trainer's per-step seconds (slowest rank, first step left out) on a group over ``world``'s
    transport with or without the check, and the collectives one step issues on this rank."""
    group = ProcessGroup(world.transport, trace=Trace(world.rank), check_calls=check_calls)
    cfg = TrainConfig(steps=steps, n_layer=2, n_embd=64, n_head=4, block_size=32, batch_size=8, eval_every=10 ** 6,
                      eval_iters=1, sample_tokens=0, **LAYOUTS[layout])
    _, history = train(cfg, progress=False, world=group)
    seconds = [cfg.batch_size * cfg.block_size / r["tokens_per_s"] for r in history[1:]]
    seconds = [MPI.COMM_WORLD.allreduce(s, op=MPI.MAX) for s in seconds]
    calls = sum(e.kind == "collective" for e in group.trace.events)
    return seconds, calls // steps


def train_table(world, layouts: list, repeats: int, steps: int) -> None:
    if world.rank == 0:
        print(f"training step on {world.size} ranks (2 x 64 GPT, T 32, batch 8, float32 AdamW): median ms over "
              f"{repeats} runs of {steps} steps each way, slowest rank")
        print(f"{'layout':>10} {'collectives/step':>17} {'unchecked ms':>13} {'checked ms':>11} {'checked/unchecked':>18}")
    for layout in layouts:
        times = {False: [], True: []}
        for _ in range(repeats):
            for check in (False, True):
                seconds, calls = step_times(world, layout, check, steps)
                times[check] += seconds
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        if world.rank == 0:
            print(f"{layout:>10} {calls:>17} {med[False]:>13.2f} {med[True]:>11.2f} {med[True] / med[False]:>18.3f}",
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1K,4M", help="comma-separated buffer sizes in bytes (K, M suffixes)")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--budget", default="32M", help="bytes per repeat: iters = budget / size, 1..500")
    p.add_argument("--train", default=None, help=f"comma-separated layouts of {', '.join(LAYOUTS)}: time the "
                                                 "trainer's step instead")
    p.add_argument("--steps", type=int, default=30, help="--train: steps per run")
    args = p.parse_args()
    world = minidist.init(trace=False)
    if args.train:
        train_table(world, args.train.split(","), args.repeats, args.steps)
        return
    groups = {name: ProcessGroup(world.transport, trace=world.trace, **kw) for name, kw in MODES.items()}
    if world.rank == 0:
        print(f"all_reduce on {world.size} ranks, float32; median of {args.repeats} repeats, slowest rank")
        print(f"{'size':>8} {'iters':>6} " + " ".join(f"{m + ' us':>14}" for m in MODES)
              + f" {'checked/unchecked':>18} {'debug/unchecked':>16}")
    for size in map(parse_size, args.sizes.split(",")):
        x = np.zeros(size // 4, np.float32)  # stays 0: no overflow over thousands of sums
        iters = max(1, min(500, parse_size(args.budget) // size))
        times = {m: [] for m in MODES}
        for name, g in groups.items():  # warm-up: workspaces, MPI connections
            time_calls(g, x, 2)
        for _ in range(args.repeats):
            for name, g in groups.items():
                times[name].append(time_calls(g, x, iters))
        med = {m: statistics.median(t) * 1e6 for m, t in times.items()}
        if world.rank == 0:
            print(f"{size:>8} {iters:>6} " + " ".join(f"{med[m]:>14.1f}" for m in MODES)
                  + f" {med['checked'] / med['unchecked']:>18.2f} {med['debug'] / med['unchecked']:>16.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
