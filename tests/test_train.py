"""The training CLI: it runs end to end, writes its metrics, is deterministic, and learns."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minidist.train import train
from minidist.train.config import TrainConfig
from minidist.train.cli import parse_args

TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4)


def test_cli_end_to_end_writes_metrics_jsonl(data_dir, tmp_path):
    out = tmp_path / "run"
    args = ["--steps", "4", "--eval-every", "2", "--eval-iters", "2", "--sample-tokens", "20",
            "--data-dir", data_dir, "--out", str(out)]
    for key, value in TINY.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "minidist.train", *args], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "sample:\nThe " in proc.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records:
        assert {"step", "loss", "lr", "tokens_per_s"} <= r.keys()
        assert np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) and r["tokens_per_s"] > 0
    assert [("val_loss" in r) for r in records] == [True, False, True, True]   # every 2 steps + the last


def test_flags_map_onto_the_config():
    cfg = parse_args(["--optimizer", "sgd", "--momentum", "0.8", "--dtype", "float64", "--n-layer", "3"])
    assert cfg == TrainConfig(optimizer="sgd", momentum=0.8, dtype="float64", n_layer=3)
    with pytest.raises(SystemExit):
        parse_args(["--dtype", "int8"])  # float16 / bfloat16 are mixed precision: tests/test_train_amp.py


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_same_seed_same_run_bit_for_bit(data_dir, optimizer):
    cfg = TrainConfig(steps=3, eval_iters=1, data_dir=data_dir, optimizer=optimizer, dtype="float64", **TINY)
    (model_a, hist_a), (model_b, hist_b) = train(cfg, progress=False), train(cfg, progress=False)
    assert [r["loss"] for r in hist_a] == [r["loss"] for r in hist_b]
    for (name, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_training_on_the_default_corpus_lowers_validation_loss(data_dir):
    # An untrained byte-level model is near ln(256) = 5.55; within 150 steps it must learn the
    # letters and most of the spelling of the generated grammar's words.
    cfg = TrainConfig(steps=150, eval_every=149, data_dir=data_dir, sample_tokens=0)
    _, history = train(cfg, progress=False)
    first, last = history[0]["val_loss"], history[-1]["val_loss"]
    assert 5.0 < first < 6.0
    assert last < 2.0, f"val loss {first:.3f} -> {last:.3f}"
