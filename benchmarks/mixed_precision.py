"""Mixed-precision benchmark: step time, data-parallel bytes and the loss curve's gap to float32.

    mpiexec -n 2 python benchmarks/mixed_precision.py [STEPS]      (about 3 minutes on 2 shared cores)

Trains train.py's default GPT (2 layers, 64 wide, T = 64, global batch 16) on dp = 2 ranks for STEPS
(default 150) AdamW steps in float32, float16 (float32 masters, dynamic loss scaling) and emulated
bfloat16, with the same data and schedule. Per dtype: median step time, the bytes each rank's
gradient all-reduces carry per step (from the trace), final loss, the largest |loss - float32 loss|
over the run, and the skipped steps. Writes benchmarks/results/mixed_precision.json (rank 0).
"""
import argparse
import json
import time
from pathlib import Path

import numpy as np

import minidist
from minidist.amp import DynamicLossScaler, MixedPrecision
from minidist.data import ByteTokenizer, get_batch, grammar_text, inputs_and_targets
from minidist.model import GPT, GPTConfig
from minidist.optim import AdamW, clip_grad_norm, lr_at
from minidist.parallel.data_parallel import DataParallel
from minidist.parallel.sampler import dp_rows

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)
BATCH, LR = 16, 3e-3
HERE = Path(__file__).resolve().parent
TOKENS = ByteTokenizer().encode(grammar_text(200_000))


def run(group, dtype, steps):
    """Train on dp group ``group`` in ``dtype``; returns per-step losses (averaged over dp), step
    seconds, data-parallel all-reduce bytes, and skipped flags."""
    model = GPT(CONFIG, seed=0, dtype="float16" if dtype == "float16" else "float32")
    dp = DataParallel(model, group)
    amp = None if dtype == "float32" else MixedPrecision(
        model, dtype, DynamicLossScaler(group=group) if dtype == "float16" else DynamicLossScaler.static(1.0, group=group))
    optimizer = AdamW(amp.master_parameters() if amp else model.named_parameters(), lr=LR, betas=(0.9, 0.95),
                      weight_decay=0.1)
    rows = dp_rows(BATCH, group.rank, group.size)
    out = {"loss": [], "seconds": [], "dp_bytes": [], "skipped": []}
    for step in range(steps):
        idx, targets = inputs_and_targets(get_batch(TOKENS, step, BATCH, CONFIG.block_size, 0)[rows])
        group.barrier()
        t0 = time.perf_counter()
        group.trace.clear()
        dp.zero_grad()
        _, loss = model(idx, targets)
        amp.backward(loss) if amp else loss.backward(np.ones_like(loss.data))
        dp.finish()
        out["dp_bytes"].append(sum(e.nbytes for e in group.trace.events if e.op == "all_reduce"))
        optimizer.lr = lr_at(step, LR, 20, steps, LR / 10)
        if amp:
            out["skipped"].append(amp.step(optimizer, max_norm=1.0).skipped)
        else:
            clip_grad_norm(model.parameters(), 1.0)
            optimizer.step()
        out["seconds"].append(time.perf_counter() - t0)
        out["loss"].append(float(group.all_reduce(np.array([loss.item()]), op="avg")[0]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150, help="training steps per dtype (default %(default)s)")
    steps = ap.parse_args().steps
    world = minidist.init()
    runs = {dtype: run(world, dtype, steps) for dtype in ("float32", "float16", "bfloat16")}
    if world.rank != 0:
        return
    reference = np.array(runs["float32"]["loss"])
    rows = []
    for dtype, r in runs.items():
        rows.append({"dtype": dtype, "steps": steps, "dp": world.size,
                     "median_step_s": float(np.median(r["seconds"][5:])),
                     "dp_bytes_per_step": r["dp_bytes"][0],
                     "final_loss": r["loss"][-1],
                     "max_gap_to_float32": float(np.abs(np.array(r["loss"]) - reference).max()),
                     "skipped_steps": int(sum(r["skipped"]))})
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "mixed_precision.json").write_text(json.dumps(rows, indent=1))
    print("| dtype | median step (s) | DP bytes / step / rank | final loss | max gap to float32 | skipped |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['dtype']} | {row['median_step_s']:.3f} | {row['dp_bytes_per_step']:,} | "
              f"{row['final_loss']:.4f} | {row['max_gap_to_float32']:.4f} | {row['skipped_steps']} |")


if __name__ == "__main__":
    main()
