"""Lesson 6: sharded checkpoints that reshard, that know their run, and that trust none of their files.

    python tutorials/06_checkpoint_and_restart.py       (4 ranks as threads; no MPI needed)

A checkpoint stores GLOBAL tensors under single-process names (GPT-2 parameters, ``exp_avg/<name>``
for optimizer state), each rank writing only the boxes of them it holds (minidist/checkpoint/):

    step-000003/rank-00000.safetensors   "transformer.h.0.mlp.c_fc.weight[0:48,0:24]", ...
    step-000003/rank-00000.json          per piece: global name, global shape, dtype, box; sha256
    step-000003/manifest.json            written last by rank 0: every file's size and sha256, the
                                         run's identity, and the sha256 of the manifest itself

Loading into another layout is just asking for other boxes. This script:
  1. trains 3 steps of AdamW at (dp 2, tp 2) and saves; shows the manifest's checksum and identity;
  2. loads that checkpoint at (dp 4) and trains 3 more steps;
  3. checks the result against 6 uninterrupted steps at (dp 4): equal to 1e-10 (float64);
  4. tries to resume it with another seed: refused, naming the field (the layout may change, the run not);
  5. edits one digit of the newest manifest and shows latest_valid() fall back to the previous;
  6. exports one consolidated safetensors file with GPT-2 names.
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
from minidist.checkpoint.identity import run_identity
from minidist.checkpoint.layout import load_training_state, training_meta, training_pieces
from minidist.checkpoint.training import ResumeRefused, TrainingCheckpoints
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
        tokens = load_data(cfg)[0]
        sampler = DistributedSampler(tokens, cfg.batch_size, cfg.block_size, cfg.seed, mesh.dp_rank, cfg.dp)
        for step in range(start, stop):
            train_step(model, optimizer, sampler.batch(step), lr_at(step, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr),
                       cfg.grad_clip, dp=dp, mesh=mesh)
        writer = CheckpointWriter(root, group)
        meta = {**training_meta(mesh, optimizer), "data_position": stop, "run": run_identity(cfg, tokens)}
        writer.save(stop, training_pieces(model, optimizer, mesh), meta)
    minidist.run_local(rank_fn, cfg.dp * cfg.tp)
    return Checkpoint(step_dir(root, stop))


def resume_refusal(cfg, root):
    """What ``--resume`` says when run ``cfg`` (one rank) tries to continue the checkpoints in ``root``."""
    def rank_fn(group):
        mesh = DeviceMesh(group)
        model = build_model(cfg, mesh.tp_group)
        ckpts = TrainingCheckpoints(root, mesh, run_identity(cfg, load_data(cfg)[0]))
        try:
            ckpts.resume(model, build_optimizer(model, cfg))
        except ResumeRefused as e:
            return str(e)
    return minidist.run_local(rank_fn, 1)[0]


def main():
    root = Path(tempfile.mkdtemp(prefix="lesson6-"))
    first = run(CFG, root / "run", 0, 3)
    print(f"1. saved at (dp 2, tp 2): {sorted(p.name for p in first.dir.iterdir())}")
    rank1 = json.loads((first.dir / "rank-00001.json").read_text())["tensors"]
    key = next(k for k in rank1 if "c_attn.weight" in k and "/" not in k)
    print(f"   rank 1 (tp rank 1) holds {key}: box {rank1[key]['box']} of {rank1[key]['global_shape']}")
    identity = first.meta["run"]
    print(f"   manifest sha256 {first.manifest['sha256'][:16]}...; run identity: seed {identity['seed']}, lr "
          f"{identity['lr']}, steps {identity['steps']}, data {identity['data_tokens']:,} tokens sha256 "
          f"{identity['data_sha256'][:12]}..., {len(identity)} fields")

    dp4 = dataclasses.replace(CFG, dp=4, tp=1)
    resumed = run(dp4, root / "run", 3, 6, load=first.dir)
    whole = run(dp4, root / "whole", 0, 6)
    worst = max(np.abs(resumed.read_full(n) - whole.read_full(n)).max() / np.abs(whole.read_full(n)).max()
                for n in whole.names)
    print(f"2-3. resumed at (dp 4) vs uninterrupted (dp 4): {len(whole.names)} tensors, max relative "
          f"difference {worst:.1e}")
    assert worst <= 1e-10

    dp4_identity = resumed.meta["run"]
    print(f"4. identity at (dp 4) == at (dp 2, tp 2): {dp4_identity == identity} (the layout is not part of it)")
    print("   with --seed 1: " + resume_refusal(dataclasses.replace(dp4, seed=1), root / "run").replace("\n", "\n   "))

    manifest = resumed.dir / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"data_position": 6', '"data_position": 9'))
    found = latest_valid(root / "run", log=lambda line: print("5. " + line))
    print(f"   latest valid: {found.name}")
    assert found == first.dir

    state = export_safetensors(whole.dir, root / "model.safetensors")
    loaded = safetensors.numpy.load_file(root / "model.safetensors")
    print(f"6. exported {len(state)} parameters, e.g. transformer.wte.weight {loaded['transformer.wte.weight'].shape}")
    assert all(np.array_equal(loaded[n], whole.read_full(n)) for n in state)


if __name__ == "__main__":
    main()
