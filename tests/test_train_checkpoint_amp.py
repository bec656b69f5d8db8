"""Checkpoints under mixed precision (float16 with its dynamic loss scale, bfloat16): what a
checkpoint keeps is the float32 master weights, the optimizer's float32 moments and the loss
scaler's state (scale, clean steps, skipped steps), never the model's 16-bit copy, which is the
masters rounded. So

- resumed in the same layout, the run is bitwise the uninterrupted one: every loss, every loss scale,
  every skipped step, every exported master;
- loaded into another layout (any dp / tp / pp / ZeRO stage) and saved again, the checkpoint is
  bitwise the same: resharding loses nothing, the 16-bit model is rebuilt from the masters.
"""
import dataclasses
import json

import numpy as np
import pytest

from minidist import run_local
from minidist.checkpoint import Checkpoint, step_dir
from minidist.train import train
from minidist.train.config import TrainConfig
from tests.test_train_checkpoint import assert_same_checkpoint, crash_before_the_last_save, resave

TINY = dict(n_layer=2, n_head=4, n_embd=16, block_size=16, batch_size=8, steps=6, eval_every=100, eval_iters=1,
            sample_tokens=0, warmup=2, lr=1e-2, grad_clip=0.5, bucket_mb=0.01, loss_scale_window=2)


def fit(cfg):
    """(history rows of global rank 0, exported masters) of ``cfg`` on dp * pp * tp thread ranks."""
    histories = run_local(lambda group: train(cfg, progress=False, world=group)[1], cfg.dp * cfg.pp * cfg.tp)
    return histories[0], dict(np.load(cfg.export))


LAYOUTS = [dict(dtype="float16", dp=2), dict(dtype="float16", dp=2, zero=1), dict(dtype="bfloat16", dp=2, zero=2),
           dict(dtype="float16", dp=2, zero=3, optimizer="sgd"), dict(dtype="bfloat16", tp=2, zero=0),
           dict(dtype="float16", pp=2, micro_batches=2, schedule="1f1b"),
           dict(dtype="bfloat16", dp=2, pp=2, zero=3, micro_batches=2)]


@pytest.mark.parametrize("changes", LAYOUTS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_resumed_in_the_same_layout_is_bitwise_the_uninterrupted_run(data_dir, tmp_path, changes):
    cfg = TrainConfig(**TINY, data_dir=data_dir, **changes, ckpt_dir=str(tmp_path / "ckpt"), save_every=3,
                      export=str(tmp_path / "a.npz"))
    whole, whole_weights = fit(dataclasses.replace(cfg, ckpt_dir=None, save_every=0, export=str(tmp_path / "w.npz")))
    assert any(r["loss_scale"] != whole[0]["loss_scale"] for r in whole) or cfg.dtype == "bfloat16"  # it moved
    fit(cfg)
    crash_before_the_last_save(cfg.ckpt_dir, 6)
    scaler = Checkpoint(step_dir(cfg.ckpt_dir, 3)).meta["loss_scaler"]
    assert scaler["scale"] == whole[3]["loss_scale"]  # the scale step 3 uses was saved after step 2
    resumed, weights = fit(dataclasses.replace(cfg, resume=True))
    for key in ("loss", "loss_scale", "skipped", "grad_norm"):
        assert [r[key] for r in resumed] == [r[key] for r in whole[3:]], key
    for k, v in whole_weights.items():
        assert v.dtype == np.float32 and np.array_equal(weights[k], v), k


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("changes", [dict(dp=4, zero=3), dict(dp=2, zero=2), dict(tp=2), dict(dp=2, pp=2, zero=1,
                                                                                               micro_batches=2)],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_a_mixed_precision_checkpoint_loads_identically_into_another_layout(data_dir, tmp_path, changes, dtype):
    cfg = TrainConfig(**{**TINY, "steps": 3}, dtype=dtype, data_dir=data_dir, dp=2, tp=2, zero=1,
                      ckpt_dir=str(tmp_path / "a"), save_every=3, export=str(tmp_path / "a.npz"))
    fit(cfg)
    saved = Checkpoint(step_dir(cfg.ckpt_dir, 3))
    assert {saved.dtype(n) for n in saved.names} == {np.dtype(np.float32)}  # masters and moments
    other = dataclasses.replace(cfg, **{"dp": 1, "tp": 1, "zero": 0, **changes})
    again = resave(other, saved.dir, tmp_path / "b")
    assert_same_checkpoint(again, saved)
    assert again.meta["loss_scaler"] == saved.meta["loss_scaler"]
    assert json.dumps(saved.meta["loss_scaler"])  # plain JSON numbers
