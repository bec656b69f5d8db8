"""ZeRO benchmark: bytes per rank against stage and dp size, and the step time of each stage.

    mpiexec -n 4 python benchmarks/zero.py        (about a minute on 2 shared cores)

dp = 4 is the world, dp = 2 the world split in two pairs, dp = 1 each rank alone. For each stage the
script trains a 4-layer, 128-wide float32 GPT (AdamW, B = 8 x T = 64 global) and reports, measured
from the live arrays after backward and gradient reduction: parameters, gradients, optimizer state,
activations (the graph before backward), next to the ZeRO formula; and the median step time.
Writes benchmarks/results/zero.json and benchmarks/figures/zero_memory.png (rank 0).
"""
import argparse
import json
import time
from pathlib import Path

import numpy as np

import minidist
from minidist.data import get_batch, inputs_and_targets
from minidist.model import GPT, GPTConfig
from minidist.parallel.zero import ZeroOptimizer

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
BATCH, STEPS = 8, 6
HERE = Path(__file__).resolve().parent
TOKENS = np.random.default_rng(0).integers(0, 256, size=100_000)


def measure(group, stage):
    """(bytes held by this rank, median step seconds) for ``stage`` on dp group ``group``."""
    model = GPT(CONFIG, seed=0, dtype="float32")
    zero = ZeroOptimizer(model, group, stage, "adamw", lr=1e-3, weight_decay=0.1)
    rows = np.array_split(np.arange(BATCH), group.size)[group.rank]
    times, held = [], None
    for step in range(STEPS):
        idx, targets = inputs_and_targets(get_batch(TOKENS, step, BATCH, CONFIG.block_size))
        t0 = time.perf_counter()
        zero.zero_grad()
        _, loss = model(idx[rows], targets[rows])
        activations = zero.activation_bytes(loss)
        loss.backward()
        zero.clip_grad_norm(1.0)
        if held is None:
            held = {**zero.model_state_bytes(), "activations": activations,
                    "formula": sum(zero.formula().values())}
        zero.step()
        times.append(time.perf_counter() - t0)
    return held, float(np.median(times[1:]))


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    world = minidist.init()
    groups = {world.size: world, 2: world.split(world.rank // 2, name="pair"), 1: world.split(world.rank, name="self")}
    rows = []
    for dp in sorted(groups):
        for stage in (0, 1, 2, 3):
            world.barrier()
            held, seconds = measure(groups[dp], stage)
            rows.append(dict(dp=dp, stage=stage, **held, ms_per_step=1e3 * seconds))
    if world.rank == 0:
        print(f"{'dp':>3} {'stage':>5} {'params':>9} {'grads':>9} {'optim':>9} {'states':>9} {'formula':>9} "
              f"{'activ.':>9} {'ms/step':>8}   (KiB per rank)")
        for r in rows:
            states = r["parameters"] + r["gradients"] + r["optimizer"]
            print(f"{r['dp']:>3} {r['stage']:>5} {r['parameters'] / 1024:>9.0f} {r['gradients'] / 1024:>9.0f} "
                  f"{r['optimizer'] / 1024:>9.0f} {states / 1024:>9.0f} {r['formula'] / 1024:>9.0f} "
                  f"{r['activations'] / 1024:>9.0f} {r['ms_per_step']:>8.1f}")
        (HERE / "results").mkdir(exist_ok=True)
        (HERE / "results" / "zero.json").write_text(json.dumps(rows, indent=1))
        plot(rows)


def plot(rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for stage in (0, 1, 2, 3):
        pts = [r for r in rows if r["stage"] == stage]
        ax.plot([r["dp"] for r in pts], [(r["parameters"] + r["gradients"] + r["optimizer"]) / 2**20 for r in pts],
                marker="o", label=f"stage {stage}")
    ax.set(xlabel="data-parallel ranks N", ylabel="model states per rank (MiB)", xticks=[1, 2, 4],
           title="ZeRO: parameters + gradients + AdamW state per rank (float32)")
    ax.legend()
    (HERE / "figures").mkdir(exist_ok=True)
    fig.savefig(HERE / "figures" / "zero_memory.png", dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
