"""The trainer's side of checkpointing: resume, save every N steps, and a crash on purpose to test both.

    ckpts = TrainingCheckpoints(root, mesh, save_every=50, keep=2)    # collective: the writer's group
    start = ckpts.resume(model, optimizer)       # the step to continue from (0: nothing to resume)
    for step in range(start, steps):
        ...one training step...
        ckpts.after_step(step, model, optimizer, {"seed": seed})
    ckpts.wait()

A checkpoint of step s holds the state AFTER s steps (``data_position`` s: the next batch to read),
so a job killed at any moment continues from the newest complete one with exactly the batches and
learning rates it would have seen (both depend on the step number only). Saving sends one barrier
and one broadcast on the writer's own group (writer.py); resuming reads files only.
"""
from __future__ import annotations

import os
import signal

from minidist.checkpoint.layout import load_training_state, training_meta, training_pieces
from minidist.checkpoint.reader import Checkpoint, latest_valid
from minidist.checkpoint.writer import CheckpointWriter


class TrainingCheckpoints:
    """Checkpoints of one training run under ``root``, every ``save_every`` steps (0: never), the
    newest ``keep`` kept; ``async_save`` writes them in the background. Building it is collective
    over ``mesh.world``; rank 0 prints what it resumes from."""

    def __init__(self, root, mesh, *, save_every: int = 0, keep: int = 2, async_save: bool = False):
        self.root, self.mesh = root, mesh
        self.save_every, self.async_save = save_every, async_save
        self.writer = CheckpointWriter(root, mesh.world, keep)

    def say(self, line: str) -> None:
        if self.mesh.rank == 0:
            print(line, flush=True)

    def resume(self, model, optimizer) -> tuple[int, dict]:
        """Load the newest valid checkpoint into ``model`` and ``optimizer`` (resharding it to this
        layout). Returns (the step to continue from, the checkpoint's meta); (0, {}) when there is
        none. Newer checkpoints that fail verification are skipped, each with a line saying why."""
        found = latest_valid(self.root, log=self.say)
        if found is None:
            self.say(f"resume: no valid checkpoint in {self.root}: starting fresh")
            return 0, {}
        ckpt = Checkpoint(found)
        load_training_state(ckpt, model, optimizer, self.mesh)
        saved = ckpt.meta["layout"]
        self.say(f"resumed from {found} (step {ckpt.meta['data_position']}, saved by dp {saved['dp']} x "
                 f"pp {saved['pp']} x tp {saved['tp']} = {ckpt.world_size} ranks)")
        return ckpt.meta["data_position"], ckpt.meta

    def after_step(self, step: int, model, optimizer, meta: dict) -> None:
        """Save checkpoint ``step + 1`` (the state after step ``step``) when it is due; ``meta`` adds
        the trainer's fields to the layout, optimizer step and data position."""
        if self.save_every and (step + 1) % self.save_every == 0:
            self.writer.save(step + 1, training_pieces(model, optimizer, self.mesh),
                             {**training_meta(self.mesh, optimizer), "data_position": step + 1, **meta},
                             async_=self.async_save)

    def wait(self) -> None:
        """Wait for an asynchronous save in flight (re-raising its error)."""
        self.writer.wait()


def crash_here() -> None:
    """Die at once, as a lost node does: SIGKILL, no clean-up, no message (fault injection)."""
    os.kill(os.getpid(), signal.SIGKILL)
