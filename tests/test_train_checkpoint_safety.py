"""--resume continues THIS run, from a checkpoint it can trust, or refuses (exit status 2).

- Every checkpoint records the run's identity (minidist/checkpoint/identity.py): resuming a
  checkpoint written with another seed, learning rate, model, data, optimizer or number of steps
  is refused on every rank, naming each field that differs with its saved and current value.
- What is only layout (dp, tp, pp, ZeRO, micro-batches) may change: that is resharding, and the
  loaded state is bitwise the saved one.
- A tampered manifest (a digit of data_position edited, with or without a forged checksum) is
  skipped for the previous checkpoint, with one line saying why.
- No valid checkpoint left: --resume refuses rather than silently starting over.
"""
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from minidist import run_local
from minidist.checkpoint import Checkpoint, step_dir
from minidist.checkpoint.format import MANIFEST, manifest_digest
from minidist.checkpoint.training import ResumeRefused
from minidist.train import train
from minidist.train.build import load_data
from minidist.train.config import TrainConfig

TINY = dict(n_layer=2, n_head=4, n_embd=16, block_size=16, batch_size=8, steps=6, eval_every=100, eval_iters=1,
            dtype="float64", sample_tokens=0, warmup=2, lr=1e-2, grad_clip=0.5, bucket_mb=0.01)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished run of 6 steps (checkpoints 4 and 6) and its config."""
    path = tmp_path_factory.mktemp("run")
    cfg = TrainConfig(**TINY, data_dir=str(path / "data"), ckpt_dir=str(path / "ckpt"), save_every=2,
                      export=str(path / "w.npz"))
    load_data(cfg)
    run_local(lambda group: train(cfg, progress=False, world=group), 1)
    return cfg


def copy_of(cfg, tmp_path):
    """``cfg`` resuming from its own copy of the run's checkpoints."""
    shutil.copytree(cfg.ckpt_dir, tmp_path / "ckpt")
    return dataclasses.replace(cfg, ckpt_dir=str(tmp_path / "ckpt"), resume=True, export=str(tmp_path / "w.npz"))


def each_rank(cfg):
    """Run ``cfg`` on its dp * pp * tp thread ranks; what each rank raised (or None)."""
    def rank_fn(group):
        try:
            train(cfg, progress=False, world=group)
        except ResumeRefused as e:
            return str(e)
    return run_local(rank_fn, cfg.dp * cfg.pp * cfg.tp)


@pytest.mark.parametrize("changes, named", [
    (dict(seed=1), ["seed: saved 0, now 1"]),
    (dict(lr=2e-2, min_lr=1e-4), ["lr: saved 0.01, now 0.02", "min_lr: saved 0.0003, now 0.0001"]),
    (dict(n_head=2, n_embd=32), ["n_embd: saved 16, now 32", "n_head: saved 4, now 2"]),
    (dict(steps=8), ["steps: saved 6, now 8"]),  # the cosine schedule ends elsewhere
    (dict(optimizer="sgd"), ["momentum: saved '(absent)', now 0.9", "optimizer: saved 'adamw', now 'sgd'"]),
    (dict(data="other"), ["data_sha256: saved '", "data_tokens: saved "]),  # the tokens, not the file name
])
def test_resuming_another_runs_checkpoint_is_refused_on_every_rank_naming_each_field(run, tmp_path, changes, named):
    if changes.get("data") == "other":
        (tmp_path / "other.txt").write_text("a different corpus. " * 100)
        changes = dict(data=str(tmp_path / "other.txt"))
    messages = each_rank(dataclasses.replace(run, **changes, dp=2, resume=True, export=None, save_every=0))
    assert len(set(messages)) == 1 and messages[0] is not None  # the same verdict on both ranks
    assert f"{step_dir(run.ckpt_dir, 6)} is a checkpoint of another run" in messages[0]
    lines = messages[0].splitlines()
    assert len(lines) == 2 + len(named)  # nothing else is said to differ
    for start, line in zip(named, lines[1:]):
        assert line.strip().startswith(start), line


def test_a_layout_change_is_resharding_and_resumes_bitwise(run, tmp_path):
    # dp 2 x tp 2, ZeRO-1, 2 micro-batches: nothing of the run's identity; the run is complete at step 6,
    # so the export is the checkpoint as loaded into this layout
    cfg = dataclasses.replace(copy_of(run, tmp_path), dp=2, tp=2, zero=1, micro_batches=2, save_every=0)
    assert each_rank(cfg) == [None] * 4
    saved, loaded = Checkpoint(step_dir(run.ckpt_dir, 6)), dict(np.load(cfg.export))
    params = {n for n in saved.names if "/" not in n}  # the export adds lm_head.weight, tied to wte
    assert params <= loaded.keys() and all(np.array_equal(loaded[n], saved.read_full(n)) for n in params)


@pytest.mark.parametrize("forge", [False, True])
def test_a_tampered_manifest_is_skipped_for_the_previous_checkpoint(run, tmp_path, capsys, forge):
    cfg = copy_of(run, tmp_path)
    path = step_dir(cfg.ckpt_dir, 6) / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["meta"]["data_position"] = 5  # one step silently skipped, were it believed
    if forge:
        manifest["sha256"] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest))
    assert each_rank(dataclasses.replace(cfg, save_every=0)) == [None]
    out = capsys.readouterr().out
    why = "meta.data_position 5 is not the checkpoint's step 6" if forge else "checksum mismatch"
    assert f"checkpoint step-000006 skipped: {path}: {why}" in out
    assert f"resumed from {step_dir(cfg.ckpt_dir, 4)} (step 4," in out


def cli(*args):
    return subprocess.run([sys.executable, "-m", "minidist.train", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_resume_refusals_exit_with_status_2_and_say_why(run, tmp_path):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()] + ["--data-dir", run.data_dir]
    (tmp_path / "corrupt" / "step-000002").mkdir(parents=True)
    (tmp_path / "corrupt" / "step-000002" / MANIFEST).write_text("{")
    for ckpt_dir, why in ((tmp_path / "empty", "no valid checkpoint in"),
                          (tmp_path / "corrupt", "no valid checkpoint in"),
                          (run.ckpt_dir, "differs in\n    seed: saved 0, now 1")):
        done = cli(*flags, "--seed", 1, "--ckpt-dir", ckpt_dir, "--resume")
        assert done.returncode == 2, done.stdout + done.stderr
        assert why in done.stderr and "Traceback" not in done.stderr and "step " not in done.stdout
