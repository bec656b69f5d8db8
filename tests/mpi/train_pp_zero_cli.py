"""Rank script: trainer command lines (ZeRO, pipeline, recomputation), one mpiexec launch for all.

Each argument after DATA_DIR and OUT_DIR is one layout's flags, e.g. ``"--dp 4 --zero 3 --optimizer
sgd"``, added to the tiny float64 run below and parsed by the CLI's own ``parse_args``. The world is
split into a sub-world of dp * pp * tp ranks for it (the others sit it out), which trains 10 steps and
exports the consolidated weights; rank 0 trains the same flags with no parallelism at all (one
process, full batch, plain optimizer) and prints ``PARITY <flags> | loss_err weight_err``: the
largest relative loss error over the steps, and the largest error of a weight tensor relative to its
largest element.

    mpiexec -n 4 python tests/mpi/train_pp_zero_cli.py DATA_DIR OUT_DIR "--dp 4 --zero 1" ...
"""
import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for `tests.`

import minidist  # noqa: E402
from minidist.train.cli import parse_args  # noqa: E402
from tests.mpi.train_parity import TINY, losses_and_weights  # noqa: E402

COMMON = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()] + ["--dtype", "float64"]
ONE_PROCESS = dict(dp=1, pp=1, tp=1, micro_batches=1, schedule="1f1b", virtual_stages=1, zero=0,
                   recompute="none", sequence_parallel=False)


def main(data_dir, out_dir, *layouts):
    world = minidist.init(timeout=60.0)
    references = {}
    for i, flags in enumerate(layouts):
        cfg = parse_args(COMMON + flags.split() + ["--data-dir", data_dir, "--export", f"{out_dir}/{i}.npz"])
        n = cfg.dp * cfg.pp * cfg.tp
        sub = world.split(0 if world.rank < n else -1, name=f"layout{i}")
        result = losses_and_weights(cfg, sub) if sub is not None else None
        if world.rank != 0:
            continue
        one = dataclasses.replace(cfg, **ONE_PROCESS, export=f"{out_dir}/ref{i}.npz")
        key = repr(dataclasses.replace(one, export=None))
        if key not in references:
            references[key] = losses_and_weights(one)
        (ref_losses, ref_weights), (losses, weights) = references[key], result
        assert weights.keys() == ref_weights.keys(), sorted(weights.keys() ^ ref_weights.keys())
        loss_err = float(np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)))
        weight_err = max(float(np.max(np.abs(weights[k] - v)) / np.max(np.abs(v))) for k, v in ref_weights.items())
        print(f"PARITY {flags} | {loss_err:.3e} {weight_err:.3e}", flush=True)
    world.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
