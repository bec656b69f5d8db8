"""Mixed precision through the trainer's command line: ``--dtype float16`` / ``bfloat16``.

- float16 on 2 data-parallel ranks runs, logs each step's loss scale and whether the step was
  skipped (an overflow backs the dynamic scale off from 2**16), exports the float32 master weights,
  and its loss tracks the float32 run's within the gap tests/test_mixed_precision_training.py states
  (0.06 nats: one steep step of progress).
- Mixed precision composes with ZeRO, tensor and pipeline parallelism and checkpoints (proven in
  tests/test_composition.py and tests/test_train_checkpoint_amp.py); a bad --loss-scale is refused.
"""
import json

import numpy as np
import pytest

from minidist.train.config import ConfigError, TrainConfig, check_config
from tests.mpi.harness import find_mpiexec, run_mpi
from tests.test_mixed_precision_training import GAP

ARGS = ["--n-layer", 2, "--n-head", 4, "--n-embd", 32, "--block-size", 32, "--batch-size", 16, "--steps", 40,
        "--eval-every", 100, "--eval-iters", 1, "--sample-tokens", 0, "--dp", 2]


@pytest.mark.parametrize("loss_scale", ["big", "0", "-1", "inf"])
def test_a_bad_loss_scale_is_refused(loss_scale):
    cfg = TrainConfig(dtype="float16", loss_scale=loss_scale)
    with pytest.raises(ConfigError, match="--loss-scale must be 'dynamic' or a positive, finite number"):
        check_config(cfg, 1)


@pytest.mark.parametrize("changes", [dict(dtype="float16", zero=1, dp=2), dict(dtype="bfloat16", zero=3, dp=2),
                                     dict(dtype="float16", tp=2), dict(dtype="bfloat16", pp=2),
                                     dict(dtype="float16", ckpt_dir="c")])
def test_mixed_precision_composes_with_zero_tensor_and_pipeline_parallelism_and_checkpoints(changes):
    cfg = TrainConfig(**changes)
    check_config(cfg, cfg.dp * cfg.pp * cfg.tp)  # once refused; proven in tests/test_composition.py


@pytest.mark.skipif(find_mpiexec() is None, reason="needs mpiexec")
def test_float16_on_two_ranks_tracks_float32(tmp_path):
    for dtype in ("float32", "float16"):
        run_mpi(2, "-m", "minidist.train", *ARGS, "--dtype", dtype, "--data-dir", tmp_path / "data",
                "--out", tmp_path / dtype, "--export", tmp_path / f"{dtype}.npz", timeout=240)
    rows = {d: [json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("float32", "float16")}
    half = rows["float16"]
    assert half[0]["loss_scale"] == 2.0 ** 16 and "loss_scale" not in rows["float32"][0]
    for before, after in zip(half, half[1:]):  # a skipped step halves the scale, with no grad norm
        assert after["loss_scale"] == before["loss_scale"] / (2 if before["skipped"] else 1)
        assert (before["grad_norm"] is None) == before["skipped"]
    full = np.array([r["loss"] for r in rows["float32"]])
    assert full[-1] < full[0] - 1.0  # float32 learned, so tracking it means something
    assert np.abs(np.array([r["loss"] for r in half]) - full).max() < GAP["float16"]
    weights = np.load(tmp_path / "float16.npz")
    assert {weights[k].dtype for k in weights.files} == {np.dtype(np.float32)}  # the masters
