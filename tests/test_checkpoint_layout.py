"""Checkpoints of the trainer's model and optimizer, in-process: the layout rules.

- A checkpoint holds GLOBAL tensors (parameters and optimizer state under single-process names), so
  loading it into ANY layout and saving again gives the same checkpoint, bitwise: saved at (dp 2,
  tp 2), loaded at (dp 4), (tp 3: vocabulary padded), (tp 2, pp 2) and one process.
- In the same layout, training resumed from a checkpoint is bitwise the uninterrupted run.
- In another layout, it equals the uninterrupted run of that layout to 1e-10 (float64): the layouts
  agree to that precision anyway (contract 4), with SGD+momentum and with AdamW.
"""
import dataclasses

import numpy as np
import pytest

from minidist import run_local
from minidist.checkpoint import Checkpoint, CheckpointWriter, step_dir
from minidist.checkpoint.layout import load_whole, tp_regions, training_meta, whole_pieces
from minidist.optim import lr_at
from minidist.parallel.data.data_parallel import DataParallel
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.pipeline.stages import PipelineStage
from minidist.parallel.data.sampler import DistributedSampler
from minidist.parallel.state import WholeState
from minidist.parallel.step import train_step
from minidist.train.build import build_model, build_optimizer, load_data
from minidist.train.config import TrainConfig

TINY = dict(n_layer=2, n_head=6, n_embd=24, block_size=16, batch_size=8, steps=6, eval_every=100, eval_iters=1,
            dtype="float64", sample_tokens=0, warmup=2, lr=1e-2)


def run(cfg, root, start, stop, load=None, pp=1):
    """Train steps start..stop on dp * pp * tp in-process ranks (resuming from checkpoint ``load``
    if given), then save checkpoint ``stop`` under ``root``. (pp > 1: load and save only.)"""
    def rank_fn(group):
        mesh = DeviceMesh(group, dp=cfg.dp, pp=pp, tp=cfg.tp)
        model = build_model(cfg, mesh.tp_group)
        if pp > 1:
            model = PipelineStage(model, mesh.pp_rank, pp)
        optimizer = build_optimizer(model, cfg)
        if load is not None:
            load_whole(Checkpoint(load), model, optimizer, mesh)
        if stop > start:
            dp = DataParallel(model, mesh.dp_group)
            sampler = DistributedSampler(load_data(cfg)[1].train, cfg.batch_size, cfg.block_size, cfg.seed,
                                         mesh.dp_rank, cfg.dp)
            for step in range(start, stop):
                train_step(model, WholeState(model, optimizer, dp), sampler.batch(step),
                           lr_at(step, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr), cfg.grad_clip, mesh=mesh)
        CheckpointWriter(root, group).save(stop, whole_pieces(model, optimizer, mesh), training_meta(mesh, optimizer))
    run_local(rank_fn, cfg.dp * cfg.tp * pp)
    return Checkpoint(step_dir(root, stop))


def assert_same(a, b, rtol=0.0):
    assert a.names == b.names
    assert len([n for n in a.names if "/" not in n]) == 12 * 2 + 4  # 12 per block, wte, wpe, ln_f (lm_head tied)
    for name in a.names:
        x, y = a.read_full(name), b.read_full(name)
        if rtol == 0.0:
            assert np.array_equal(x, y), name
        else:
            assert np.abs(x - y).max() <= rtol * np.abs(y).max(), name


def test_qkv_and_padded_vocab_regions():
    # c_attn (3C, C) with C = 4 on rank 1 of 2: local rows [q_1; k_1; v_1]
    assert tp_regions("transformer.h.0.attn.c_attn.weight", (12, 4), 1, 2) == [
        (0, 2, ((2, 4), (0, 4))), (2, 4, ((6, 8), (0, 4))), (4, 6, ((10, 12), (0, 4)))]
    # vocab 256 on tp 3: 86 rows per rank, the last rank's 2 padding rows are not stored
    assert tp_regions("transformer.wte.weight", (256, 8), 2, 3) == [(0, 84, ((172, 256), (0, 8)))]
    assert tp_regions("transformer.h.1.mlp.c_proj.weight", (8, 32), 1, 2) == [(0, 8, ((0, 8), (16, 32)))]
    assert tp_regions("transformer.h.1.mlp.c_proj.weight", (8, 32), 0, 1) == [(0, 8, ((0, 8), (0, 32)))]


@pytest.mark.parametrize("dp, tp, pp", [(4, 1, 1), (1, 3, 1), (1, 2, 2), (1, 1, 1)])
def test_saved_at_dp2_tp2_loads_identically_into_another_layout(tmp_path, data_dir, dp, tp, pp):
    cfg = TrainConfig(**TINY, data_dir=data_dir, dp=2, tp=2)
    saved = run(cfg, tmp_path / "a", 0, 2)
    again = run(dataclasses.replace(cfg, dp=dp, tp=tp), tmp_path / "b", 2, 2, load=saved.dir, pp=pp)
    assert again.meta == {"layout": {"dp": dp, "pp": pp, "cp": 1, "tp": tp, "ep": 1}, "optimizer_step": 2}
    assert_same(again, saved)


def test_resumed_in_the_same_layout_is_bitwise_the_uninterrupted_run(tmp_path, data_dir):
    cfg = TrainConfig(**TINY, data_dir=data_dir, dp=2, tp=2)
    whole = run(cfg, tmp_path / "whole", 0, 6)
    half = run(cfg, tmp_path / "half", 0, 3)
    assert_same(run(cfg, tmp_path / "half", 3, 6, load=half.dir), whole)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_resumed_in_another_layout_equals_that_layouts_uninterrupted_run(tmp_path, data_dir, optimizer):
    cfg = TrainConfig(**TINY, data_dir=data_dir, optimizer=optimizer, dp=2, tp=2)
    first = run(cfg, tmp_path / "a", 0, 3)
    dp4 = dataclasses.replace(cfg, dp=4, tp=1)
    assert_same(run(dp4, tmp_path / "a", 3, 6, load=first.dir), run(dp4, tmp_path / "b", 0, 6), rtol=1e-10)
