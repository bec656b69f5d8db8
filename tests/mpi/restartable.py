"""Rank script: a tiny checkpointed "training" for the launcher tests.

    python restartable.py --ckpt-dir DIR --steps S --save-every K --out FILE
                          [--resume] [--fail-at-step k --fail-rank r] [--always-fail]

State: a global vector w (12 float64) sharded over the ranks (numpy.array_split). A step:
w <- 0.5 w + 0.01 * sum(w) (an all-reduce) + step. Every K steps the shards are checkpointed with
their boxes, so a restart on ANOTHER number of ranks reads its own shard back (resharding).
``--fail-at-step k`` kills rank r (SIGKILL, no clean-up) when it reaches step k, unless resumed.
At the end rank 0 writes the full w to FILE (.npy).
"""
import argparse
import os
import signal

import numpy as np

import minidist
from minidist.checkpoint import Checkpoint, CheckpointWriter, Piece, latest_valid

p = argparse.ArgumentParser()
p.add_argument("--ckpt-dir", required=True)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--save-every", type=int, default=2)
p.add_argument("--out", required=True)
p.add_argument("--resume", action="store_true")
p.add_argument("--fail-at-step", type=int, default=None)
p.add_argument("--fail-rank", type=int, default=0)
p.add_argument("--always-fail", action="store_true")
args = p.parse_args()

world = minidist.init(timeout=30.0)
N = 12
rows = np.array_split(np.arange(N), world.size)[world.rank]
box = ((int(rows[0]), int(rows[-1]) + 1),) if len(rows) else ((0, 0),)
w, start = np.arange(N, dtype=np.float64)[rows], 0
writer = CheckpointWriter(args.ckpt_dir, world, keep=2)
found = latest_valid(args.ckpt_dir) if args.resume else None
if found is not None:
    ckpt = Checkpoint(found)
    w, start = ckpt.read("w", box), ckpt.meta["data_position"]
    if world.rank == 0:
        print(f"resumed from {found.name} (saved on {ckpt.world_size} ranks) at step {start} on {world.size} ranks",
              flush=True)

for step in range(start, args.steps):
    if args.always_fail or (step == args.fail_at_step and not args.resume and world.rank == args.fail_rank):
        os.kill(os.getpid(), signal.SIGKILL)
    total = world.all_reduce(np.array([w.sum()]))[0]
    w = 0.5 * w + 0.01 * total + step
    if (step + 1) % args.save_every == 0:
        writer.save(step + 1, [Piece("w", w, (N,), box)], meta={"data_position": step + 1})

full = world.all_gather(w, count=N)
if world.rank == 0:
    np.save(args.out, full)
