"""Lesson 6: sharded checkpoints that reshard, and restarting a job that lost a rank.

    python tutorials/06_checkpoint_and_restart.py       (4 ranks as threads; no MPI needed)

A checkpoint stores GLOBAL tensors under single-process names (GPT-2 parameters, ``exp_avg/<name>``
for optimizer state), each rank writing only the boxes of them it holds (minidist/checkpoint/):

    step-000003/rank-00000.safetensors   "transformer.h.0.mlp.c_fc.weight[0:48,0:24]", ...
    step-000003/rank-00000.json          per piece: global name, global shape, dtype, box; sha256
    step-000003/manifest.json            written last by rank 0: the checkpoint counts from here on

Loading into another layout is just asking for other boxes. This script:
  1. trains 3 steps of AdamW at (dp 2, tp 2) and saves;
  2. loads that checkpoint at (dp 4) and trains 3 more steps;
  3. checks the result against 6 uninterrupted steps at (dp 4): equal to 1e-10 (float64);
  4. corrupts one byte of the newest checkpoint and shows latest_valid() fall back to the previous;
  5. exports one consolidated safetensors file with GPT-2 names.
For the launcher that restarts a job after a rank dies (``python -m minidist.run -n N
--max-restarts K -- script ...``) see tests/test_run_launcher.py.
"""
import dataclasses
import json
import tempfile
from pathlib import Path

import numpy as np
import safetensors.numpy

import minidist
from minidist.checkpoint import Checkpoint, CheckpointWriter, export_safetensors, latest_valid, step_dir
from minidist.checkpoint.layout import load_training_state, training_meta, training_pieces
from minidist.optim import lr_at
from minidist.parallel.data_parallel import DataParallel
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.sampler import DistributedSampler
from minidist.parallel.step import train_step
from minidist.train_build import build_model, build_optimizer, load_data
from minidist.train_config import TrainConfig

CFG = TrainConfig(n_layer=2, n_head=6, n_embd=24, block_size=16, batch_size=8, steps=6, warmup=2, lr=1e-2,
                  dtype="float64", dp=2, tp=2)


def run(cfg, root, start, stop, load=None):
    """Train steps start..stop on dp * tp ranks (first loading checkpoint ``load``), save step ``stop``."""
    def rank_fn(group):
        mesh = DeviceMesh(group, dp=cfg.dp, tp=cfg.tp)
        model = build_model(cfg, mesh.tp_group)
        optimizer = build_optimizer(model, cfg)
        if load is not None:
            load_training_state(Checkpoint(load), model, optimizer, mesh)  # this rank's boxes, from any layout
        dp = DataParallel(model, mesh.dp_group)
        sampler = DistributedSampler(load_data(cfg)[0], cfg.batch_size, cfg.block_size, cfg.seed, mesh.dp_rank, cfg.dp)
        for step in range(start, stop):
            train_step(model, optimizer, sampler.batch(step), lr_at(step, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr),
                       cfg.grad_clip, dp=dp, mesh=mesh)
        writer = CheckpointWriter(root, group)
        writer.save(stop, training_pieces(model, optimizer, mesh), training_meta(mesh, optimizer))
    minidist.run_local(rank_fn, cfg.dp * cfg.tp)
    return Checkpoint(step_dir(root, stop))


def main():
    root = Path(tempfile.mkdtemp(prefix="lesson6-"))
    first = run(CFG, root / "run", 0, 3)
    print(f"1. saved at (dp 2, tp 2): {sorted(p.name for p in first.dir.iterdir())}")
    rank1 = json.loads((first.dir / "rank-00001.json").read_text())["tensors"]
    key = next(k for k in rank1 if "c_attn.weight" in k and "/" not in k)
    print(f"   rank 1 (tp rank 1) holds {key}: box {rank1[key]['box']} of {rank1[key]['global_shape']}")

    dp4 = dataclasses.replace(CFG, dp=4, tp=1)
    resumed = run(dp4, root / "run", 3, 6, load=first.dir)
    whole = run(dp4, root / "whole", 0, 6)
    worst = max(np.abs(resumed.read_full(n) - whole.read_full(n)).max() / np.abs(whole.read_full(n)).max()
                for n in whole.names)
    print(f"2-3. resumed at (dp 4) vs uninterrupted (dp 4): {len(whole.names)} tensors, max relative "
          f"difference {worst:.1e}")
    assert worst <= 1e-10

    bad = resumed.dir / "rank-00000.safetensors"
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    found = latest_valid(root / "run", log=lambda line: print("4. " + line))
    print(f"   latest valid: {found.name}")
    assert found == first.dir

    state = export_safetensors(whole.dir, root / "model.safetensors")
    loaded = safetensors.numpy.load_file(root / "model.safetensors")
    print(f"5. exported {len(state)} parameters, e.g. transformer.wte.weight {loaded['transformer.wte.weight'].shape}")
    assert all(np.array_equal(loaded[n], whole.read_full(n)) for n in state)


if __name__ == "__main__":
    main()
