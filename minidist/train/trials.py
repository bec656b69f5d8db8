"""How a search runs one trial (train/search.py), behind one small interface:

    run = start_trial(cfg, trial, group)     trial ``trial.index`` on the sub-group ``group``
    run.advance(to_step) -> val_loss         train on from where it is to ``to_step`` (NaN: it diverged)
    run.close()                              nothing is left running

For now a trial is advanced as a population member is (train/pbt.py): each ``advance`` re-enters the
trainer (train/loop.py: ``train(..., stop_at=to_step)``) on the group, resuming from the trial's own
checkpoints under ``--ckpt-dir``/trial-<n>, saved at each segment's end, so a trial's steps are the
steps of the same layout run alone with the trial's hyper-parameters, bitwise. Its metrics go to
``--out``/trial-<n>/metrics.jsonl. The trial's last segment writes its final model for ``--export``
and ``--export-hf`` in its checkpoint folder (``final.npz``, ``final-hf/``...), which the search copies
from the best trial's.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from minidist.train.divergence import Diverged
from minidist.train.loop import train


def trial_folder(root, index: int) -> str | None:
    """Trial ``index``'s folder under ``root`` (None: none)."""
    return str(Path(root) / f"trial-{index}") if root is not None else None


def final_exports(cfg, index: int) -> dict:
    """Where trial ``index``'s last segment writes its final model for ``--export`` / ``--export-hf``:
    in its checkpoint folder, in the format the asked path names ({TrainConfig field: path})."""
    folder = Path(trial_folder(cfg.ckpt_dir, index))
    found = {}
    if cfg.export is not None:
        found["export"] = str(folder / ("final.safetensors" if cfg.export.endswith(".safetensors") else "final.npz"))
    if cfg.export_hf is not None:
        found["export_hf"] = str(folder / "final-hf")
    return found


def trial_config(cfg, index: int, hparams: dict, segment: int):
    """Trial ``index``'s own run: the search's flags with its hyper-parameters, its folders, a save
    every ``segment`` steps (each segment's end)."""
    floor = {} if "min_lr" in hparams else {"min_lr": min(cfg.min_lr, hparams.get("lr", cfg.lr))}
    return dataclasses.replace(cfg, mode="collective", **{**floor, **hparams}, ckpt_dir=trial_folder(cfg.ckpt_dir, index),
                               out=trial_folder(cfg.out, index), trace=trial_folder(cfg.trace, index),
                               offload_dir=trial_folder(cfg.offload_dir, index), save_every=segment,
                               keep=max(cfg.keep, 2), async_save=False, sample_tokens=0, export=None, export_hf=None,
                               warmup_range=None, grad_clip_range=None)  # (the search's alone)


class TrialRun:
    """One trial's run on its sub-group (module docstring). Sends what its trainer sends, over
    ``group`` only."""

    def __init__(self, cfg, index: int, hparams: dict, step: int, segment: int, group, memory_bytes=None,
                 stopping=None):
        self.search, self.index, self.step, self.group = cfg, index, step, group
        self.cfg = trial_config(cfg, index, hparams, segment)
        self.memory_bytes, self.stopping = memory_bytes, stopping

    def advance(self, to_step: int) -> float:
        """Train from the trial's step to ``to_step`` (its checkpoint of its step, if past 0): the
        validation loss after it, NaN when the run diverged (every rank of the group at once)."""
        last = final_exports(self.search, self.index) if to_step == self.cfg.steps else {}
        segment = dataclasses.replace(self.cfg, resume=self.step > 0, explain=False, **last)
        try:
            rows = train(segment, progress=False, world=self.group, keep_history=False,
                         memory_bytes=self.memory_bytes, stopping=self.stopping, stop_at=to_step, quiet=True)[1]
            loss = float(rows[-1]["val_loss"])
        except Diverged:
            loss = float("nan")
        self.step = to_step
        return loss

    def close(self) -> None:
        """Nothing to end: each segment's trainer left nothing running."""


def start_trial(cfg, index: int, hparams: dict, step: int, segment: int, group, memory_bytes=None, stopping=None):
    """Trial ``index`` with ``hparams``, at ``step`` (0, or the step of its newest checkpoint on
    ``--resume``), on ``group``: a :class:`TrialRun`. The one place a search starts a trial."""
    return TrialRun(cfg, index, hparams, step, segment, group, memory_bytes, stopping)
