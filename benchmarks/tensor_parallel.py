"""Benchmark tensor parallelism against one process: step time, time in collectives, bytes sent.

    mpiexec -n 1 python benchmarks/tensor_parallel.py      # one process: GPT, and the TP model at tp=1
    mpiexec -n 2 python benchmarks/tensor_parallel.py      # tp=2, without and with sequence parallelism
    mpiexec -n 4 python benchmarks/tensor_parallel.py      # tp=4
    python benchmarks/tensor_parallel.py --plot            # table + figure from the saved JSON

One step = forward, backward and (under sequence parallelism) the gradient sync of replicated
parameters; float32, one thread per rank (OMP_NUM_THREADS=1), hand-written ring collectives. The
layouts are timed ALTERNATELY (GPT / TP / TP+SP / GPT ...) so a noisy neighbour hurts all alike; a
step's time is the slowest rank's; the median over repeats is kept. "in collectives" is the time
inside the tp group's collectives (from the trace), "collective buffers" the bytes of the buffers
they were given per step (on the wire a ring all-reduce sends 2(n-1)/n of that per rank, an
all-gather or reduce-scatter (n-1)/n).
Results: benchmarks/results/tensor_parallel_{n}ranks.json; --plot writes
benchmarks/figures/tensor_parallel.png and prints the markdown table for RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

import minidist
from minidist.model import GPT, GPTConfig
from minidist.parallel.tensor.apply import tensor_parallel
from minidist.parallel.compose.complete import sync_sequence_parallel_grads

HERE = Path(__file__).resolve().parent
CONFIG = GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=8, n_embd=256)
B, T = 4, 128


def step(model, group, idx, targets):
    """Forward + backward (+ the sequence-parallel sync); returns seconds on this rank."""
    start = time.perf_counter()
    model.zero_grad()
    _, loss = model(idx, targets)
    loss.backward()
    if group is not None:
        sync_sequence_parallel_grads(model, group)
    return time.perf_counter() - start


def measure(world, repeats: int, warmup: int) -> dict:
    """Time every layout this world size offers, alternately; the slowest rank's time per step."""
    rng = np.random.default_rng(0)
    idx, targets = rng.integers(0, CONFIG.vocab_size, (B, T)), rng.integers(0, CONFIG.vocab_size, (B, T))
    layouts = {f"tp={world.size}": (tensor_parallel(GPT(CONFIG, 0, "float32"), world), world),
               f"tp={world.size}+sp": (tensor_parallel(GPT(CONFIG, 0, "float32"), world, sequence_parallel=True), world)}
    if world.size == 1:
        layouts = {"one process (GPT)": (GPT(CONFIG, 0, "float32"), None), **layouts}
    times = {name: [] for name in layouts}
    comm = {name: [] for name in layouts}
    sent = {}
    for i in range(warmup + repeats):
        for name, (model, group) in layouts.items():
            world.barrier()
            world.trace.clear()
            seconds = step(model, group, idx, targets)
            events = [e for e in world.trace.events if e.kind == "collective"]
            slowest = world.all_reduce(np.array([seconds, sum(e.duration for e in events)]), op="max")
            if i >= warmup:
                times[name].append(slowest[0])
                comm[name].append(slowest[1])
                sent[name] = sum(e.nbytes for e in events)
    return {name: dict(ms=1e3 * statistics.median(times[name]), comm_ms=1e3 * statistics.median(comm[name]),
                       collective_bytes=sent[name]) for name in layouts}


def plot():
    """Print the markdown table and draw step time (compute vs collectives) per layout."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {}
    for n in (1, 2, 4):
        path = HERE / "results" / f"tensor_parallel_{n}ranks.json"
        if path.exists():
            rows.update(json.loads(path.read_text())["layouts"])
    base = rows["one process (GPT)"]["ms"]
    print("| layout | ms/step | in collectives (ms) | collective buffers per step | vs one process |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['ms']:.1f} | {r['comm_ms']:.1f} | {r['collective_bytes'] / 2**20:.2f} MiB | "
              f"{r['ms'] / base:.2f}x |")
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    names = list(rows)
    comm = [rows[n]["comm_ms"] for n in names]
    compute = [rows[n]["ms"] - rows[n]["comm_ms"] for n in names]
    ax.barh(names, compute, label="compute (and waiting)", color="#4c72b0")
    ax.barh(names, comm, left=compute, label="inside tp collectives", color="#dd8452")
    for y, name in enumerate(names):  # the step's total at the end of its bar
        r = rows[name]
        ax.text(r["ms"] + 2, y, f"{r['ms']:.0f} ms, {r['ms'] / base:.2f}x", va="center", fontsize=8)
    ax.set_xlim(0, 1.22 * max(r["ms"] for r in rows.values()))
    ax.set_xlabel("ms per step (forward + backward), slowest rank")
    ax.set_title(f"Tensor parallelism: GPT {CONFIG.n_layer} layers, {CONFIG.n_embd} wide, T = {T}, B = {B}, float32, "
                 "1 thread per rank", fontsize=10)
    ax.tick_params(axis="y", labelsize=9)
    ax.invert_yaxis()
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False, fontsize=9)
    fig.tight_layout()
    fig.savefig(HERE / "figures" / "tensor_parallel.png", dpi=120, bbox_inches="tight")


def main():
    p = argparse.ArgumentParser(description="Tensor parallelism vs one process.")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--plot", action="store_true", help="no MPI: table and figure from the saved results")
    args = p.parse_args()
    if args.plot:
        plot()
        return
    world = minidist.init(backend="ring")
    layouts = measure(world, args.repeats, args.warmup)
    if world.rank == 0:
        result = dict(ranks=world.size, config=CONFIG.__dict__, batch=[B, T], machine=platform.machine(),
                      numpy=np.__version__, layouts=layouts)
        path = HERE / "results" / f"tensor_parallel_{world.size}ranks.json"
        path.write_text(json.dumps(result, indent=1))
        for name, r in layouts.items():
            print(f"{name:<20} {r['ms']:8.1f} ms/step  {r['comm_ms']:7.1f} ms in collectives  "
                  f"{r['collective_bytes'] / 2**20:6.2f} MiB in collective buffers")


if __name__ == "__main__":
    main()
