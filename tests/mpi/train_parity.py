"""Rank script: many parallel layouts, one mpiexec launch (run by tests/test_train_parallel_mpi.py).

For each layout the world is split into a sub-world of dp * tp ranks (the other ranks sit it out),
which trains 10 steps with ``minidist.train.train`` and exports the consolidated weights. Rank 0
compares losses and weights with one process on the full batch (computed here, on a world of one)
and prints one line per layout: ``PARITY dp tp sp micro optimizer dtype loss_err tensor_err
model_err`` (largest relative loss error over the steps; largest error of a weight tensor relative
to its largest element; L2 error of all weights together relative to their L2 norm).

    mpiexec -n 4 python tests/mpi/train_parity.py DATA_DIR OUT_DIR
"""
import dataclasses
import sys
from pathlib import Path

import numpy as np

import minidist
from minidist.train import train
from minidist.train.config import TrainConfig

TINY = dict(n_layer=2, n_head=4, n_embd=16, block_size=16, batch_size=8, steps=10, eval_every=100,
            eval_iters=1, sample_tokens=0, warmup=2, lr=1e-2, grad_clip=0.5, bucket_mb=0.01)


def layouts(world_size, both_optimizers=False):
    """(dp, tp, sequence_parallel, micro_batches, optimizer, dtype) for every layout that fits: each
    float64 layout with SGD and AdamW alternating (both over every dp x tp), or with both."""
    grid = [(dp, tp) for dp in (1, 2, 4) for tp in (1, 2, 4) if 1 < dp * tp <= world_size]
    shapes = [(dp, tp, sp, micro) for dp, tp in grid for sp in ((False, True) if tp > 1 else (False,))
              for micro in (1, 2)]
    for i, shape in enumerate(shapes):
        for optimizer in ("sgd", "adamw") if both_optimizers else (("sgd", "adamw")[i % 2],):
            yield *shape, optimizer, "float64"
    yield 2, 2, True, 2, "adamw", "float32"
    yield 4, 1, False, 2, "sgd", "float32"


def losses_and_weights(cfg, world=None):
    """Train ``cfg`` on ``world``; on its rank 0: (losses, exported full state); elsewhere None."""
    _, history = train(cfg, progress=False, world=world)
    if world is not None and world.rank != 0:
        return None
    return np.array([r["loss"] for r in history]), dict(np.load(cfg.export))


def main(data_dir, out_dir):
    world = minidist.init(timeout=60.0)
    base = TrainConfig(**TINY, data_dir=data_dir)
    references = {}
    for i, (dp, tp, sp, micro, optimizer, dtype) in enumerate(layouts(world.size, "--both-optimizers" in sys.argv)):
        cfg = dataclasses.replace(base, dp=dp, tp=tp, sequence_parallel=sp, micro_batches=micro,
                                  optimizer=optimizer, dtype=dtype, export=str(Path(out_dir) / f"{i}.npz"))
        sub = world.split(0 if world.rank < dp * tp else -1, name=f"layout{i}")
        result = losses_and_weights(cfg, sub) if sub is not None else None
        if world.rank != 0:
            continue
        key = (optimizer, dtype)
        if key not in references:
            references[key] = losses_and_weights(dataclasses.replace(
                base, optimizer=optimizer, dtype=dtype, export=str(Path(out_dir) / f"ref-{optimizer}-{dtype}.npz")))
        ref_losses, ref_weights = references[key]
        losses, weights = result
        loss_err = float(np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)))
        assert weights.keys() == ref_weights.keys()
        tensor_err = max(float(np.max(np.abs(weights[k] - v)) / np.max(np.abs(v))) for k, v in ref_weights.items())
        model_err = float(np.sqrt(sum(np.sum((weights[k] - v) ** 2) for k, v in ref_weights.items())
                                  / sum(np.sum(v ** 2) for v in ref_weights.values())))
        print(f"PARITY {dp} {tp} {int(sp)} {micro} {optimizer} {dtype} {loss_err:.3e} {tensor_err:.3e} "
              f"{model_err:.3e}", flush=True)
    world.barrier()


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if a != "--both-optimizers"])
