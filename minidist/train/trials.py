"""How a search runs one trial (train/search.py), behind one small interface:

    run = start_trial(cfg, trial, group)     trial ``trial.index`` on the sub-group ``group``
    run.advance(to_step) -> val_loss         train on from where it is to ``to_step`` (NaN: it diverged)
    run.close()                              nothing is left running

A trial is one run (train/life.py: ``Run``) on its sub-group, as a population member is (train/pbt.py):
made once when the trial starts (resuming from the trial's own checkpoints under
``--ckpt-dir``/trial-<n> on ``--resume``), advanced segment by segment, saving at each segment's end,
and closed when the trial ends, so a trial's steps are the steps of the same layout run alone with the
trial's hyper-parameters, bitwise. Its metrics go to
``--out``/trial-<n>/metrics.jsonl. The trial's last segment writes its final model for ``--export``
and ``--export-hf`` in its checkpoint folder (``final.npz``, ``final-hf/``...), which the search copies
from the best trial's.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from minidist.train.divergence import Diverged
from minidist.train.life import Run
from minidist.train.outputs import final_exports


def trial_folder(root, index: int) -> str | None:
    """Trial ``index``'s folder under ``root`` (None: none)."""
    return str(Path(root) / f"trial-{index}") if root is not None else None


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
    """One trial's run on its sub-group (module docstring). Sends what its run sends, over ``group``
    only: its start-up's splits and checks when it is made, its steps' collectives as it advances."""

    def __init__(self, cfg, index: int, hparams: dict, step: int, segment: int, group, machines=None,
                 memory_bytes=None, stopping=None):
        self.search, self.index = cfg, index
        mine = dataclasses.replace(trial_config(cfg, index, hparams, segment), resume=step > 0)
        self.run = Run(mine, group, machines=machines, memory_bytes=memory_bytes, stopping=stopping, quiet=True,
                       progress=False, keep_history=False)

    def advance(self, to_step: int) -> float:
        """Train from the trial's step to ``to_step``: the validation loss after it, NaN when the run
        diverged (every rank of the group at once; the trial then fails and ends)."""
        try:
            loss = float(self.run.advance(to_step)[-1]["val_loss"])
            if to_step == self.run.cfg.steps:
                self.run.finish(**final_exports(self.search, trial_folder(self.search.ckpt_dir, self.index)))  # its final model, when asked for
            return loss
        except Diverged:
            return float("nan")

    def close(self) -> None:
        """The trial's run stopped (train/life.py): its offload files, locks and open files closed."""
        self.run.close()


def start_trial(cfg, index: int, hparams: dict, step: int, segment: int, group, machines=None, memory_bytes=None,
                stopping=None):
    """Trial ``index`` with ``hparams``, at ``step`` (0, or the step of its newest checkpoint on
    ``--resume``), on ``group`` (``machines``: its ranks' machines): a :class:`TrialRun`. The one place a
    search starts a trial."""
    return TrialRun(cfg, index, hparams, step, segment, group, machines, memory_bytes, stopping)
