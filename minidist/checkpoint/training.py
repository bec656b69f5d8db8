"""The trainer's side of checkpointing: resume, save every N steps, and a crash on purpose to test both.

    ckpts = TrainingCheckpoints(root, mesh, run_identity(cfg, train_tokens), save_every=50, keep=2)
    start, meta = ckpts.resume(state)  # the step to continue from; ResumeRefused if none
    for step in range(start, steps):
        ...one training step...
        ckpts.after_step(step, state, {"seed": seed})

``state`` is the run's model state (parallel/state.py): it says which pieces it saves and loads.
    ckpts.wait()

A checkpoint of step s holds the state AFTER s steps (``data_position`` s: the next batch to read),
so a job killed at any moment continues from the newest complete one with exactly the batches and
learning rates it would have seen (both depend on the step number only). Every checkpoint records
the run's identity (identity.py); resuming refuses a checkpoint of another run, and refuses to
start over when no valid checkpoint is left (:class:`ResumeRefused`: a configuration error, exit
status 2, the same verdict on every rank because every rank reads the same files). Saving sends one
all-reduce and one broadcast of a few integers on the writer's own group (writer.py); resuming reads
files only.
"""
from __future__ import annotations

import os
import signal
import time

from minidist.checkpoint.format import MANIFEST, step_dir
from minidist.checkpoint.identity import identity_differences
from minidist.checkpoint.layout import training_meta
from minidist.checkpoint.reader import latest_checkpoint
from minidist.checkpoint.schema import check_training_meta
from minidist.checkpoint.writer import CheckpointWriter


class ResumeRefused(Exception):
    """``--resume`` cannot continue this run: no valid checkpoint, or the newest one is another
    run's. Found from the files alike on every rank, before anything is loaded or sent."""


class TrainingCheckpoints:
    """Checkpoints of one training run (``identity``: :func:`~minidist.checkpoint.identity.run_identity`)
    under ``root``, every ``save_every`` steps (0: never), the newest ``keep`` kept; ``async_save``
    writes them in the background. Building it is collective over ``mesh.world``; rank 0 prints what
    it resumes from (unless ``quiet``)."""

    def __init__(self, root, mesh, identity: dict, *, save_every: int = 0, keep: int = 2, async_save: bool = False,
                 quiet: bool = False):
        self.root, self.mesh, self.identity, self.quiet = root, mesh, identity, quiet
        self.save_every, self.async_save = save_every, async_save
        self.writer = CheckpointWriter(root, mesh.world, keep)
        for entry in self.writer.leftovers():  # the folder is this run's alone (train/folders.py holds it)
            self.say(f"removed {entry}: a save that a stopped or killed run left unfinished")

    def say(self, line: str) -> None:
        if self.mesh.rank == 0 and not self.quiet:
            print(line, flush=True)

    def resume(self, state) -> tuple[int, dict]:
        """Load the newest valid checkpoint into ``state`` (the model state, parallel/state.py: its
        parameters or masters, optimizer slots and loss scaler, resharded to this layout). Returns (the
        step to continue from, the checkpoint's meta). Newer checkpoints that
        fail verification are skipped, each with a line saying why. :class:`ResumeRefused` when no
        valid checkpoint is left, or when the newest is another run's (each differing field named)."""
        ckpt = latest_checkpoint(self.root, log=self.say, accept=_trainer_meta)  # every file verified once
        if ckpt is None:
            raise ResumeRefused(f"--resume: no valid checkpoint in {self.root} (drop --resume to start "
                                "from scratch)")
        found = ckpt.dir
        differences = identity_differences(ckpt.meta["run"], self.identity)
        if differences:
            raise ResumeRefused(f"--resume: {found} is a checkpoint of another run; it differs in\n    "
                                + "\n    ".join(differences) + "\n  (resume with the same settings, or use a new "
                                "--ckpt-dir)")
        state.load(ckpt, self.mesh)
        saved = ckpt.meta["layout"]
        cp = f"cp {saved['cp']} x " if saved.get("cp", 1) > 1 else ""
        self.say(f"resumed from {found} (step {ckpt.meta['data_position']}, saved by dp {saved['dp']} x "
                 f"pp {saved['pp']} x {cp}tp {saved['tp']} = {ckpt.world_size} ranks)")
        return ckpt.meta["data_position"], ckpt.meta

    def after_step(self, step: int, state, meta: dict) -> str | None:
        """Save checkpoint ``step + 1`` (``state`` after step ``step``: its pieces, parallel/state.py)
        when it is due; ``meta`` adds the trainer's fields to the layout, optimizer step, data position
        and run identity (under mixed precision the loss scaler's state too).
        Returns the line that says so (saved; or, with ``async_save``, being written), None when no
        save was due."""
        if not (self.save_every and (step + 1) % self.save_every == 0):
            return None
        self.writer.save(step + 1, state.pieces(self.mesh),
                         {**training_meta(self.mesh, state, state.scaler), "data_position": step + 1, **meta,
                          "run": self.identity},
                         async_=self.async_save)
        where = step_dir(self.root, step + 1)
        return f"saving {where} in the background" if self.async_save else f"saved {where}"

    def wait(self) -> None:
        """Wait for an asynchronous save in flight (re-raising its error)."""
        self.writer.wait()

    def abandon(self, signum: int = 0) -> None:
        """The run stops before its saves are complete: no unfinished save folder is left (writer.py);
        ``signum``: the stop signal that stopped it, if one did (its peers then stop alike)."""
        self.writer.abandon(signum)


def _trainer_meta(manifest: dict, folder) -> None:
    """CheckpointError unless the manifest's meta is a trainer's (schema.check_training_meta)."""
    check_training_meta(manifest["meta"], manifest["step"], folder / MANIFEST)


def crash_here() -> None:
    """Die at once, as a lost node does: SIGKILL, no clean-up, no message (fault injection)."""
    os.kill(os.getpid(), signal.SIGKILL)


def hang_here() -> None:
    """Hang, as a stuck rank does: sleep, making no MPI call, until something kills this process (fault
    injection; under Open MPI's failure detector the peers declare it dead)."""
    while True:
        time.sleep(60)
