"""The trainer's checkpoints, in-process (ranks as threads): the rules of --ckpt-dir / --resume.

- A checkpoint of step s is the state after s steps; --resume continues from the newest valid one,
  in ANY layout, ZeRO stages included: each ZeRO rank writes its flat shard as Flat regions of the
  global tensors, and a new layout reads back whichever boxes and flat ranges it holds.
- Loading into another layout and saving again gives the same checkpoint, bitwise.
- Resumed in the same layout the run is bitwise the uninterrupted one; in another layout it equals
  that layout's uninterrupted run to 1e-10 (float64), as the layouts agree anyway (contract 4).
- metrics.jsonl reads as one run: the rows after the resumed step are written once.
- Bad checkpoint flags are refused before anything is sent; --resume with no valid checkpoint is
  refused rather than silently starting over (tests/test_train_checkpoint_safety.py: the rest of
  what --resume refuses).
"""
import dataclasses
import json
import shutil

import numpy as np
import pytest

from minidist import run_local
from minidist.checkpoint import Checkpoint, CheckpointWriter, Flat, step_dir
from minidist.checkpoint.layout import training_meta, zero_regions
from minidist.checkpoint.training import ResumeRefused
from minidist.parallel.mesh import DeviceMesh
from minidist.train import train
from minidist.train.build import build_parallel
from minidist.train.config import ConfigError, TrainConfig, check_config

TINY = dict(n_layer=2, n_head=4, n_embd=16, block_size=16, batch_size=8, steps=6, eval_every=100, eval_iters=1,
            dtype="float64", sample_tokens=0, warmup=2, lr=1e-2, grad_clip=0.5, bucket_mb=0.01)


def fit(cfg):
    """Train ``cfg`` on dp * pp * cp * tp thread ranks; (losses of the steps run, exported weights)."""
    histories = run_local(lambda group: train(cfg, progress=False, world=group)[1], cfg.dp * cfg.pp * cfg.cp * cfg.tp)
    return np.array([r["loss"] for r in histories[0]]), dict(np.load(cfg.export))


def resave(cfg, load, root):
    """Build ``cfg``'s layout, load checkpoint ``load`` into it (mixed precision's masters and loss
    scaler too), save it again as step 0 under ``root``."""
    def rank_fn(group):
        mesh = DeviceMesh(group, dp=cfg.dp, pp=cfg.pp, tp=cfg.tp, cp=cfg.cp)
        _, state, _ = build_parallel(cfg, mesh)
        ckpt = Checkpoint(load)
        state.load(ckpt, mesh)
        meta = {**training_meta(mesh, state, state.scaler), "data_position": 0, "run": ckpt.meta["run"]}
        CheckpointWriter(root, group).save(0, state.pieces(mesh), meta)
    run_local(rank_fn, cfg.dp * cfg.pp * cfg.cp * cfg.tp)
    return Checkpoint(step_dir(root, 0))


def crash_before_the_last_save(root, step):
    """As if the run had died before saving checkpoint ``step``: remove it (the run's own LR schedule
    is kept, which stopping early with fewer --steps would change)."""
    shutil.rmtree(step_dir(root, step))


def assert_same_checkpoint(a, b):
    assert a.names == b.names
    for name in a.names:
        assert np.array_equal(a.read_full(name), b.read_full(name)), name


def assert_close(weights, reference, rtol):
    assert weights.keys() == reference.keys()
    for k, v in reference.items():
        assert np.abs(weights[k] - v).max() <= rtol * np.abs(v).max(), k


def test_a_zero_shard_is_flat_ranges_of_the_global_tensors(data_dir):
    # block 0 of a 16-wide GPT is one unit of 3,280 elements (ln_1 32, c_attn 768 + 48, c_proj 256 + 16,
    # ln_2 32, c_fc 1024 + 64, ...); on 4 dp ranks rank 1 holds elements 820:1640, which start 20
    # elements into c_attn.bias and end 488 elements (30.5 rows) into c_fc.weight
    cfg = TrainConfig(**TINY, data_dir=data_dir, dp=4, zero=1)

    def rank_fn(group):
        mesh = DeviceMesh(group, dp=4)
        model, state, _ = build_parallel(cfg, mesh)
        unit = next(s.unit for s in state.shards if s.unit.name == "transformer.h.0")
        return (unit.lo, unit.hi), [(name, a, b, flat) for name, _, _, a, b, flat
                                    in zero_regions(unit, model.config, mesh)]
    bounds, stretches = run_local(rank_fn, 4)[1]
    assert bounds == (820, 1640)
    block = "transformer.h.0."
    assert stretches == [
        (block + "attn.c_attn.bias", 0, 28, Flat(((0, 48),), 20, 48)),
        (block + "attn.c_proj.weight", 28, 284, Flat(((0, 16), (0, 16)), 0, 256)),
        (block + "attn.c_proj.bias", 284, 300, Flat(((0, 16),), 0, 16)),
        (block + "ln_2.weight", 300, 316, Flat(((0, 16),), 0, 16)),
        (block + "ln_2.bias", 316, 332, Flat(((0, 16),), 0, 16)),
        (block + "mlp.c_fc.weight", 332, 820, Flat(((0, 64), (0, 16)), 0, 488))]


@pytest.mark.parametrize("changes", [dict(dp=4, zero=3), dict(dp=2, zero=2), dict(tp=2), dict(dp=2, pp=2, zero=1,
                                                                                               micro_batches=2),
                                     dict(dp=2, cp=2, zero=3), dict(cp=4, cp_algorithm="zigzag", zero=2),
                                     dict(cp=2, cp_algorithm="ulysses", tp=2)])
def test_a_zero_checkpoint_loads_identically_into_another_layout(data_dir, tmp_path, changes):
    cfg = TrainConfig(**{**TINY, "steps": 2}, data_dir=data_dir, dp=2, tp=2, zero=1, ckpt_dir=str(tmp_path / "a"),
                      save_every=2, export=str(tmp_path / "a.npz"))
    fit(cfg)
    saved = Checkpoint(step_dir(cfg.ckpt_dir, 2))
    other = dataclasses.replace(cfg, **{"dp": 1, "tp": 1, "zero": 0, **changes})
    assert_same_checkpoint(resave(other, saved.dir, tmp_path / "b"), saved)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_resumed_in_another_zero_layout_equals_its_uninterrupted_run(data_dir, tmp_path, optimizer):
    first = TrainConfig(**TINY, data_dir=data_dir, optimizer=optimizer, dp=2, tp=2, zero=1,
                        ckpt_dir=str(tmp_path / "ckpt"), save_every=3, export=str(tmp_path / "first.npz"))
    fit(first)
    crash_before_the_last_save(first.ckpt_dir, 6)
    then = dataclasses.replace(first, dp=4, tp=1, zero=3, save_every=0, export=str(tmp_path / "resumed.npz"))
    losses, weights = fit(dataclasses.replace(then, resume=True))
    ref_losses, reference = fit(dataclasses.replace(then, ckpt_dir=None, export=str(tmp_path / "whole.npz")))
    assert len(losses) == 3 and np.abs(losses - ref_losses[3:]).max() <= 1e-10 * np.abs(ref_losses).max()
    assert_close(weights, reference, 1e-10)


def test_resumed_across_context_parallel_sizes_equals_the_uninterrupted_run(data_dir, tmp_path):
    """Saved by dp 2 x cp 2 (ring, ZeRO-2: shards over the 4 ranks of dp x cp), resumed by cp 4
    (zig-zag, ZeRO-3) and by one process: both continue as their uninterrupted runs."""
    first = TrainConfig(**TINY, data_dir=data_dir, dp=2, cp=2, zero=2, ckpt_dir=str(tmp_path / "ckpt"), save_every=3,
                        export=str(tmp_path / "first.npz"))
    fit(first)
    crash_before_the_last_save(first.ckpt_dir, 6)
    for then in (dataclasses.replace(first, dp=1, cp=4, cp_algorithm="zigzag", zero=3),
                 dataclasses.replace(first, dp=1, cp=1, zero=0)):
        then = dataclasses.replace(then, save_every=0, export=str(tmp_path / "resumed.npz"))
        losses, weights = fit(dataclasses.replace(then, resume=True))
        ref_losses, reference = fit(dataclasses.replace(then, ckpt_dir=None, export=str(tmp_path / "whole.npz")))
        assert len(losses) == 3 and np.abs(losses - ref_losses[3:]).max() <= 1e-10 * np.abs(ref_losses).max()
        assert_close(weights, reference, 1e-10)


def test_resumed_in_the_same_zero_layout_is_bitwise_the_uninterrupted_run(data_dir, tmp_path):
    cfg = TrainConfig(**{**TINY, "dtype": "float32"}, data_dir=data_dir, dp=2, zero=2, out=str(tmp_path / "run"),
                      ckpt_dir=str(tmp_path / "ckpt"), save_every=3, export=str(tmp_path / "a.npz"))
    whole_losses, whole = fit(dataclasses.replace(cfg, ckpt_dir=None, save_every=0, out=None, export=str(tmp_path / "w.npz")))
    fit(cfg)
    crash_before_the_last_save(cfg.ckpt_dir, 6)  # metrics.jsonl holds steps 0..5, the checkpoints step 3
    losses, weights = fit(dataclasses.replace(cfg, resume=True))
    assert np.array_equal(losses, whole_losses[3:])
    for k, v in whole.items():
        assert np.array_equal(weights[k], v), k
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))
    assert [r["loss"] for r in rows] == list(whole_losses)


def test_resume_with_no_checkpoint_is_refused_not_started_fresh(data_dir, tmp_path):
    cfg = TrainConfig(**{**TINY, "steps": 2}, data_dir=data_dir, ckpt_dir=str(tmp_path / "none"), resume=True,
                      export=str(tmp_path / "w.npz"))
    with pytest.raises(ResumeRefused, match=f"--resume: no valid checkpoint in {tmp_path / 'none'}"):
        fit(cfg)
    assert not (tmp_path / "w.npz").exists()


@pytest.mark.parametrize("changes, message", [
    (dict(save_every=2), "--save-every and --resume need --ckpt-dir"),
    (dict(resume=True), "--save-every and --resume need --ckpt-dir"),
    (dict(ckpt_dir="c", keep=0), "--keep must be >= 1"),
    (dict(fail_at_step=3, fail_rank=2), "--fail-rank 2 is not a rank of the 2-rank world"),
])
def test_bad_checkpoint_flags_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        check_config(TrainConfig(dp=2, **changes), 2)
