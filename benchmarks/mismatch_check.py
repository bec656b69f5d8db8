"""What the default mismatch check costs: all-reduce with and without it, side by side in one run.

    mpiexec -n 2 python benchmarks/mismatch_check.py
    mpiexec -n 4 python benchmarks/mismatch_check.py --sizes 1K,4M --repeats 15

Two groups over the same MPI transport: one with ``check_calls=True`` (the default: every collective
first swaps a 48-byte fingerprint with its ring neighbours, ``minidist/comm/fingerprint.py``), one with
``check_calls=False``; a third, ``debug=True``, all-gathers the fingerprints instead. They are timed
ALTERNATELY, repeat by repeat, so a noisy neighbour hurts all of them alike. A repeat times ``iters``
back-to-back float32 all-reduces after a barrier; its time is the slowest rank's; the table shows the
median over repeats and the ratio to the unchecked group.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import minidist
from minidist.comm.group import ProcessGroup

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1K,4M", help="comma-separated buffer sizes in bytes (K, M suffixes)")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--budget", default="32M", help="bytes per repeat: iters = budget / size, 1..500")
    args = p.parse_args()
    world = minidist.init(trace=False)
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
