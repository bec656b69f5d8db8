"""Mixed-precision benchmark: step time, data-parallel bytes and the loss curve's gap to float32.

    mpiexec -n 2 python benchmarks/mixed_precision.py [--steps STEPS]      (about 3 minutes on 2 shared cores)

Runs the trainer (``minidist.train.train``: its default GPT, 2 layers, 64 wide, T = 64, global batch
16, AdamW, its schedule and clipping) on dp = 2 ranks for STEPS (default 150) steps with --dtype
float32, float16 (float32 masters, dynamic loss scaling) and emulated bfloat16, on the same data.
Per dtype: median step time, the bytes each rank's all-reduces over the data-parallel group carry
per step (the gradient buckets and the 8-byte loss average, from the trace), final loss, the largest
|loss - float32 loss| over the run, and the skipped steps. Writes benchmarks/results/mixed_precision.json (rank 0).
"""
import argparse
import json
from pathlib import Path

import numpy as np

import minidist
from minidist.train import train
from minidist.train.config import TrainConfig

HERE = Path(__file__).resolve().parent


def run(world, dtype, steps):
    """``python -m minidist.train --dp <world size> --dtype <dtype> --steps <steps>`` on ``world``;
    returns per-step losses (averaged over dp), step seconds, the bytes of the all-reduces over the
    data-parallel group per step (from the trace), and skipped flags."""
    cfg = TrainConfig(steps=steps, dtype=dtype, dp=world.size, eval_every=steps, eval_iters=1)
    world.trace.clear()
    _, history = train(cfg, progress=False, world=world)
    dp_bytes = sum(e.nbytes for e in world.trace.events if e.op == "all_reduce" and e.group.startswith("dp"))
    return {"loss": [r["loss"] for r in history],
            "seconds": [cfg.batch_size * cfg.block_size / r["tokens_per_s"] for r in history],
            "dp_bytes": dp_bytes // steps,
            "skipped": [r.get("skipped", False) for r in history]}


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
                     "dp_bytes_per_step": r["dp_bytes"],
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
