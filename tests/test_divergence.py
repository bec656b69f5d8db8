"""A run that diverges stops, says so, and never becomes the latest checkpoint.

- float32 with a huge learning rate: ``python -m minidist.train`` stops at the first NaN loss or
  gradient norm with exit status 5 and one message (the step, its loss, the newest valid
  checkpoint); ``metrics.jsonl`` is strict JSON (``null`` for NaN); no checkpoint holding NaN or inf
  is written, whether the loss went NaN first or the last finite step's update made the weights inf
  (the writer refuses the save on every rank).
- Every rank stops at the same step, without a collective more (the loss and the norm are the same
  on every rank).
- float16: the loss scaler still skips an overflowing step, but SKIP_WINDOW skips in a row stop the run.
- ``--resume`` never picks a checkpoint holding NaN (one written before the check: planted here with
  valid checksums); the launcher does not restart a diverged job (exit 5, like 2).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save

from minidist import run_local
from minidist.checkpoint import CheckpointError, latest_valid, step_dir, verify
from minidist.checkpoint.training import ResumeRefused
from minidist.checkpoint.format import (MANIFEST, NonFiniteError, manifest_digest, rank_file, rank_meta_file,
                                        sha256_bytes, step_dirs)
from minidist.train import train
from minidist.train.config import TrainConfig
from minidist.train.divergence import SKIP_WINDOW, Diverged, DivergenceWatch
from minidist.train.outputs import metrics_line

TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4, eval_iters=1, eval_every=1000,
            sample_tokens=0, warmup=0)
REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def flags(**settings):
    return [arg for key, value in settings.items() for arg in ("--" + key.replace("_", "-"), str(value))]


def strict_json(line: str):
    """json.loads that refuses NaN, Infinity and -Infinity, as every other JSON parser does."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(line, parse_constant=refuse)


def all_finite(folder) -> bool:
    """Whether every tensor of every rank file in checkpoint ``folder`` is finite (read directly,
    without the reader's checks)."""
    return all(np.isfinite(a).all() for f in Path(folder).glob("rank-*.safetensors") for a in load_file(f).values())


@pytest.mark.parametrize("optimizer, lr, nan_loss_first", [
    ("sgd", 1e3, True),  # the loss goes NaN at some step: that step stops the run
    ("adamw", 1e39, False),  # step 0's loss is finite, but its update makes the weights inf: checkpoint 1 refused
])
def test_a_diverging_float32_run_exits_5_with_strict_metrics_and_no_nan_checkpoint(data_dir, tmp_path, optimizer, lr,
                                                                                 nan_loss_first):
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    args = flags(**TINY, steps=40, lr=lr, optimizer=optimizer, data_dir=data_dir, out=out, ckpt_dir=ckpt,
                 save_every=1, keep=100)
    proc = subprocess.run([sys.executable, "-m", "minidist.train", *args], capture_output=True, text=True,
                          timeout=120, env=ENV, cwd=REPO)
    assert proc.returncode == 5, proc.stderr
    message = [line for line in proc.stderr.splitlines() if line.startswith("python -m minidist.train:")]
    assert len(message) == 1 and "the run diverged" in message[0] and "Traceback" not in proc.stderr
    records = [strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(len(records))) and len(records) < 40  # it stopped
    for folder in step_dirs(ckpt):  # every checkpoint written is finite, and verifies
        assert all_finite(folder), folder
        verify(folder)
    newest, last = latest_valid(ckpt, log=lambda line: None), records[-1]
    if nan_loss_first:  # that step's line is written, with null; the newest checkpoint is the step before it
        assert last["loss"] is None and f"diverged at step {last['step']} (loss nan" in message[0]
        assert newest == step_dir(ckpt, last["step"]) and f"The newest valid checkpoint is {newest}" in message[0]
    else:  # the first checkpoint would have held inf: refused, so there is none
        assert last["step"] == 0 and np.isfinite(last["loss"]) and newest is None
        assert "diverged after step 0" in message[0] and "checkpoint 1 not written" in message[0]
        assert f"No valid checkpoint in {ckpt}" in message[0]


def test_every_rank_stops_at_the_same_step_after_the_same_collectives(data_dir):
    cfg = TrainConfig(**TINY, steps=40, lr=1e3, optimizer="sgd", data_dir=data_dir, dp=2, tp=2)

    def rank_fn(group):
        with pytest.raises(Diverged) as stopped:
            train(cfg, progress=False, world=group)
        return str(stopped.value).split(":")[0], group.seq

    results = run_local(rank_fn, 4)
    assert len({what for what, _ in results}) == 1, results  # the same step, loss and norm on every rank
    assert len({seq for _, seq in results}) == 1, results  # and no rank sent anything more to decide it
    assert "the run diverged at step" in results[0][0]


def test_a_float16_run_that_skips_every_step_for_the_window_stops(data_dir, tmp_path):
    cfg = TrainConfig(**TINY, steps=200, lr=1e6, optimizer="sgd", dtype="float16", data_dir=data_dir,
                      out=str(tmp_path))
    with pytest.raises(Diverged, match=f"{SKIP_WINDOW} steps in a row skipped by the loss scaler"):
        train(cfg, progress=False)
    records = [strict_json(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) < 200 and all(r["skipped"] for r in records[-SKIP_WINDOW:])
    assert not records[-SKIP_WINDOW - 1]["skipped"]  # stopped at the first full window
    assert all(r["grad_norm"] is None for r in records[-SKIP_WINDOW:])


def test_the_watch_counts_skips_in_a_row_and_a_clean_step_resets_it():
    watch = DivergenceWatch(mixed_precision=True, window=3)
    for step, norm in enumerate([None, None, 1.0, None, None]):  # a scaler finding its scale: never 3 in a row
        watch.after_step(step, float("nan") if norm is None else 2.0, norm)
    with pytest.raises(Diverged, match="diverged at step 5 .* 3 steps in a row"):
        watch.after_step(5, float("inf"), None)
    full = DivergenceWatch(mixed_precision=False)
    full.after_step(0, 2.0, 1.0)
    with pytest.raises(Diverged, match=r"step 1 \(loss 2.0, grad norm inf\)"):
        full.after_step(1, 2.0, float("inf"))


def test_metrics_lines_are_strict_json_with_null_for_non_finite_values():
    record = {"step": 3, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3, "load": [1.0, -float("inf")],
              "skipped": False}
    line = metrics_line(record)
    assert line.endswith("\n") and "NaN" not in line and "Infinity" not in line
    assert strict_json(line) == {"step": 3, "loss": None, "grad_norm": None, "lr": 1e-3, "load": [1.0, None],
                                 "skipped": False}
    finite = {"step": 1, "loss": 2.5, "tokens_per_s": 1e4}
    assert metrics_line(finite) == json.dumps(finite) + "\n"  # finite runs: the same bytes as before


def plant_nan(folder, rank=0):
    """Put one NaN into rank ``rank``'s first float tensor of checkpoint ``folder`` and re-sign
    everything (rank file size and sha256, its JSON, the manifest), as a checkpoint written before
    the writer's check would be: only the values can tell."""
    folder = Path(folder)
    tensors = load_file(folder / rank_file(rank))
    key = next(k for k, v in tensors.items() if v.dtype.kind == "f" and v.size)
    tensors[key].reshape(-1)[0] = np.nan
    data = save(tensors)
    (folder / rank_file(rank)).write_bytes(data)
    info_path = folder / rank_meta_file(rank)
    info = json.loads(info_path.read_text())
    info.update(bytes=len(data), sha256=sha256_bytes(data))
    raw = json.dumps(info).encode()
    info_path.write_bytes(raw)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["ranks"][rank].update(bytes=len(data), sha256=sha256_bytes(data), meta_bytes=len(raw),
                                   meta_sha256=sha256_bytes(raw))
    manifest["sha256"] = manifest_digest(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return key


def test_resume_skips_a_checkpoint_holding_nan_for_the_previous_one(data_dir, tmp_path):
    cfg = TrainConfig(**TINY, steps=4, data_dir=data_dir, ckpt_dir=str(tmp_path), save_every=2, keep=5)
    train(cfg, progress=False)
    key = plant_nan(step_dir(tmp_path, 4))
    with pytest.raises(NonFiniteError, match=f"{key[:20]}.* holds 1 NaN or inf values"):
        verify(step_dir(tmp_path, 4))
    lines = []
    assert latest_valid(tmp_path, log=lines.append) == step_dir(tmp_path, 2)
    assert len(lines) == 1 and lines[0].startswith("checkpoint step-000004 skipped:") and "NaN" in lines[0]
    _, history = train(TrainConfig(**{**cfg.__dict__, "resume": True}), progress=False)
    assert [r["step"] for r in history] == [2, 3]  # continued from step 2, not from the NaN one


def test_resume_with_only_nan_checkpoints_left_refuses(data_dir, tmp_path):
    cfg = TrainConfig(**TINY, steps=2, data_dir=data_dir, ckpt_dir=str(tmp_path), save_every=2)
    train(cfg, progress=False)
    plant_nan(step_dir(tmp_path, 2))
    with pytest.raises(ResumeRefused, match="no valid checkpoint"):
        train(TrainConfig(**{**cfg.__dict__, "resume": True}), progress=False)
    with pytest.raises(CheckpointError):
        verify(step_dir(tmp_path, 2))


def test_the_launcher_does_not_restart_a_diverged_job(data_dir, tmp_path):
    args = flags(**TINY, steps=40, lr=1e3, optimizer="sgd", data_dir=data_dir, ckpt_dir=tmp_path / "ckpt",
                 save_every=2, dp=2)
    proc = subprocess.run([sys.executable, "-m", "minidist.run", "-n", "2", "--max-restarts", "2", "--",
                           "-m", "minidist.train", *args], capture_output=True, text=True, timeout=180, env=ENV,
                          cwd=REPO)
    assert proc.returncode == 5, proc.stderr
    assert "attempt 1 exited with code 5: the run diverged" in proc.stderr
    assert "not restarting: the run diverged" in proc.stderr and "attempt 2" not in proc.stderr
    assert proc.stderr.count("python -m minidist.train: the run diverged") == 1  # rank 0 says it, once
