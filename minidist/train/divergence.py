"""A run that diverged stops, with a message and an exit status of its own (5), instead of training on NaN.

    full precision     a NaN or inf loss or gradient norm stops the run at that step
    mixed precision    a step whose gradients overflow is skipped (the loss scaler's job: the scale is
                       lowered and the next step tries again); a run that skips SKIP_WINDOW steps in a
                       row stops (the scaler can no longer help: see SKIP_WINDOW)
    checkpoints        a checkpoint holding NaN or inf is never written (checkpoint/writer.py: the
                       update of the last good step may have made the weights inf while its loss was
                       still finite), so the newest valid checkpoint is the last one before the
                       divergence, and the launcher does not restart: it would diverge again

Every rank stops at the same step without sending anything more: the loss a step reports is already
the same on every rank (averaged over dp by an all-reduce, broadcast from a pipeline's last stage, and
the tp ranks compute the same vocabulary-parallel cross-entropy), so is the gradient norm (one
all-reduce over the whole model) and so is the skip (found-inf is agreed over the world). A writer's
refusal is agreed by its own all-reduce of failure codes (writer.py).
"""
from __future__ import annotations

import contextlib
import math

from minidist.checkpoint.format import CheckpointError, NonFiniteError
from minidist.checkpoint.reader import latest_valid

SKIP_WINDOW = 50
"""Skipped steps in a row after which a mixed-precision run counts as diverged. A healthy float16 run
never gets near it: the dynamic scale starts at 2**16 and halves at each skip, so the start-up search
for a scale at which no gradient overflows takes at most about 16 skips in a row (by a scale of 1 the
gradients of a mean loss fit float16 unless they themselves are huge), and later each growth of the
scale (every ``--loss-scale-window`` clean steps) costs one skip. After 50 in a row the scale is
2**-34, ten binades below float16's smallest subnormal (2**-24): every gradient would round to zero,
so the overflow is in the values themselves (inf weights, a NaN loss) and no scale can cure it. A
fixed scale (bfloat16, ``--loss-scale S``) skips only where the values overflow, so 50 in a row is
the same verdict."""


class Diverged(Exception):
    """The run diverged: the message says at which step, its loss and gradient norm, why, and the
    newest valid checkpoint (:meth:`DivergenceWatch.stops`)."""


class DivergenceWatch:
    """Watches each step's (loss, grad norm). ``mixed_precision``: a loss scaler skips overflowing
    steps (grad norm None), and only ``window`` of them in a row stop the run; else the first NaN or
    inf loss or gradient norm does. Sends nothing."""

    def __init__(self, mixed_precision: bool, window: int = SKIP_WINDOW):
        self.mixed_precision, self.window, self.skipped_in_a_row = mixed_precision, window, 0
        self.last = "before its first step"  # the last step watched, in words

    def after_step(self, step: int, loss: float, grad_norm) -> None:
        """Raise :class:`Diverged` if the run has diverged with this step."""
        self.last = f"step {step} (loss {loss}, grad norm {grad_norm})"
        finite = math.isfinite(loss) and grad_norm is not None and math.isfinite(grad_norm)
        if not self.mixed_precision:
            if not finite:
                raise Diverged(f"the run diverged at {self.last}: a NaN or inf loss or gradient norm in full "
                               "precision")
            return
        self.skipped_in_a_row = 0 if finite else self.skipped_in_a_row + 1
        if self.skipped_in_a_row >= self.window:
            raise Diverged(f"the run diverged at {self.last}: {self.window} steps in a row skipped by the loss "
                           "scaler (their gradients overflowed at every scale it tried)")

    @contextlib.contextmanager
    def stops(self, ckpts=None):
        """Inside: :class:`Diverged`, or a checkpoint refused for holding NaN or inf (the update of the
        last step watched made the weights non-finite), stops the run: a save in flight is waited for,
        and :class:`Diverged` raised with the newest valid checkpoint of ``ckpts`` (a
        TrainingCheckpoints) named, on its rank 0. Sends nothing more than the save in flight."""
        try:
            yield
        except (Diverged, NonFiniteError) as e:
            why = str(e) if isinstance(e, Diverged) else f"the run diverged after {self.last}: {e}"
            if ckpts is not None:
                with contextlib.suppress(CheckpointError):  # the save in flight may be the one refused
                    ckpts.wait()
            raise Diverged(why + _newest_checkpoint(ckpts)) from e


def _newest_checkpoint(ckpts) -> str:
    """A sentence naming the newest valid checkpoint of ``ckpts`` (read on its rank 0 only; '' elsewhere)."""
    if ckpts is None:
        return ". No --ckpt-dir: nothing to resume from (lower --lr, or add --warmup or --grad-clip)"
    if ckpts.mesh.rank != 0:
        return ""
    found = latest_valid(ckpts.root, log=lambda line: None)
    if found is None:
        return f". No valid checkpoint in {ckpts.root} (lower --lr, or add --warmup or --grad-clip, and start over)"
    return (f". The newest valid checkpoint is {found}, from before the divergence: --resume continues from it "
            "(with a lower --lr, or --warmup or --grad-clip, it may not diverge again)")
