"""The behaviour snapshot: what a refactoring must leave bitwise unchanged.

24 layouts that together hold every value of every axis of the support matrix (dp, tp, pp, cp and
its three algorithms, ZeRO 0-3, sequence parallelism, the five schedules, recompute, the three
precisions, checkpoints, experts on every rank and split over ep, both offloads), AdamW as well as
SGD. Each trains the composition test's 4-block GPT for 4 steps on threads and records:

- per step: the loss and the gradient norm, as exact float hex strings;
- the final weights: the SHA-256 of each exported tensor's bytes;
- per rank: the bytes and the count of every collective call, by operation and group name.

``python -m tests.behaviour --write`` records ``tests/golden/behaviour.json`` (done once, before
the architecture change); tests/test_behaviour.py asserts that every layout still gives exactly it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from minidist import run_local
from minidist.checkpoint import step_dir
from minidist.train.support_matrix import Cell, config_for
from minidist.train import train

GOLDEN = Path(__file__).parent / "golden" / "behaviour.json"
SIZES = dict(n_layer=4, n_head=4, n_embd=16, block_size=16, batch_size=8)
TRAIN = dict(steps=4, eval_every=100, eval_iters=1, sample_tokens=0, warmup=1, lr=1e-2, grad_clip=0.5,
             momentum=0.9, bucket_mb=0.01, loss_scale_window=2)


def _cell(dp=1, tp=1, pp=1, cp=1, cp_algorithm="ring", zero=0, sp=False, schedule="1f1b", recompute="none",
          dtype="float32", checkpoint=False, moe="none", offload="none") -> Cell:
    return Cell(dp=dp, tp=tp, pp=pp, cp=cp, cp_algorithm=cp_algorithm, zero=zero, sequence_parallel=sp,
                schedule=schedule, recompute=recompute, dtype=dtype, checkpoint=checkpoint, moe=moe, offload=offload)


LAYOUTS = [  # (cell, optimizer)
    (_cell(), "sgd"),
    (_cell(), "adamw"),
    (_cell(dtype="float16"), "adamw"),
    (_cell(dp=2), "sgd"),
    (_cell(dp=2, zero=1), "adamw"),
    (_cell(dp=2, zero=2, dtype="bfloat16"), "sgd"),
    (_cell(dp=2, zero=3, recompute="full"), "adamw"),
    (_cell(tp=2), "adamw"),
    (_cell(tp=2, sp=True, dp=2, zero=2), "sgd"),
    (_cell(pp=2, schedule="gpipe"), "sgd"),
    (_cell(pp=2, schedule="1f1b", dp=2, zero=1, dtype="float16"), "adamw"),
    (_cell(pp=2, schedule="interleaved", tp=2, sp=True), "adamw"),
    (_cell(pp=2, schedule="zb-h1", dp=2), "sgd"),
    (_cell(pp=2, schedule="zbv", dp=2, zero=3), "adamw"),
    (_cell(cp=2, cp_algorithm="ring"), "sgd"),
    (_cell(cp=2, cp_algorithm="zigzag", dp=2, zero=2), "adamw"),
    (_cell(cp=2, cp_algorithm="ulysses", tp=2, sp=True, dtype="bfloat16"), "sgd"),
    (_cell(dp=2, tp=2, pp=2, zero=1, sp=True, schedule="1f1b"), "adamw"),
    (_cell(dp=2, zero=2, checkpoint=True), "adamw"),
    (_cell(pp=2, tp=2, zero=3, checkpoint=True, dtype="float16", schedule="interleaved"), "sgd"),
    (_cell(moe="ep1", dp=2), "adamw"),
    (_cell(moe="ep2", dp=2, zero=1, tp=2), "sgd"),
    (_cell(offload="optimizer", dp=2, zero=2), "adamw"),
    (_cell(offload="optimizer,params", dp=2, zero=3, dtype="bfloat16"), "adamw"),
    (_cell(offload="optimizer", pp=2, zero=0, schedule="zbv"), "sgd"),
]


def key(cell: Cell, optimizer: str) -> str:
    return f"{cell}-{optimizer}"


def config(cell: Cell, optimizer: str, data_dir: str, tmp: Path):
    """The trainer's config of one snapshot layout: the composition test's sizes and steps, float64
    for the float32 cells, 4 experts (top 2 in float64, all 4 in 16 bits) for the MoE cells."""
    cfg = config_for(cell, **SIZES)
    moe = dict(n_experts=4, moe_every=2, top_k=2 if cell.dtype == "float32" else 4) if cell.moe != "none" else {}
    return dataclasses.replace(cfg, **TRAIN, **moe, optimizer=optimizer,
                               dtype="float64" if cell.dtype == "float32" else cell.dtype, data_dir=data_dir,
                               export=str(tmp / "w.npz"), ckpt_dir=str(tmp / "ckpt") if cell.checkpoint else None,
                               offload_dir=str(tmp / "offload") if cfg.offload_dir else None)


def _fit(cfg) -> tuple[list, list]:
    """Train ``cfg`` on threads: (rank 0's history, every rank's collective bytes and counts)."""
    def rank(group):
        with group.trace.capture() as events:
            history = train(cfg, progress=False, world=group)[1]
        calls = Counter()
        for e in events:
            if e.kind == "collective":
                calls[f"{e.op} {e.group} bytes"] += e.nbytes
                calls[f"{e.op} {e.group} calls"] += 1
        return history, dict(sorted(calls.items()))
    results = run_local(rank, cfg.dp * cfg.tp * cfg.pp * cfg.cp)
    return results[0][0], [calls for _, calls in results]


def snapshot(cell: Cell, optimizer: str, data_dir: str) -> dict:
    """The record of one layout (a checkpointing cell: saves at steps 2 and 4, loses the second and
    resumes from the first; the resumed run's steps and calls are recorded)."""
    tmp = Path(tempfile.mkdtemp(prefix="minidist-behaviour-"))
    try:
        cfg = config(cell, optimizer, data_dir, tmp)
        history, calls = _fit(cfg)
        if cell.checkpoint:
            shutil.rmtree(step_dir(cfg.ckpt_dir, 4))
            history, calls = _fit(dataclasses.replace(cfg, resume=True))
        weights = dict(np.load(cfg.export))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    hexed = lambda x: None if x is None else float(x).hex()  # noqa: E731
    return {
        "steps": [{"step": r["step"], "loss": hexed(r["loss"]), "grad_norm": hexed(r["grad_norm"])} for r in history],
        "weights": {name: hashlib.sha256(np.ascontiguousarray(w).tobytes()).hexdigest()
                    for name, w in sorted(weights.items())},
        "calls": calls,
    }


def data_folder() -> str:
    from minidist.train.build import load_data
    from minidist.train.config import TrainConfig
    path = tempfile.mkdtemp(prefix="minidist-behaviour-data-")
    load_data(TrainConfig(data_dir=path))
    return path


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.behaviour --write   (records tests/golden/behaviour.json)")
    data = data_folder()
    record = {}
    for cell, opt in LAYOUTS:
        record[key(cell, opt)] = snapshot(cell, opt, data)
        print(key(cell, opt), flush=True)
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
