"""Dynamic loss scaling (Micikevicius et al., 2018, "Mixed Precision Training"; PyTorch's GradScaler).

float16 has a narrow range: the smallest normal number is 6.1e-5 (subnormals reach 6e-8 with fewer
bits), the largest 65504. Gradients of a mean loss over a few thousand tokens are mostly far below
6e-5: in float16 they would round to zero. So the loss is multiplied by a large ``scale`` before
backward (every gradient is then ``scale`` times larger, by the chain rule) and the gradients are
divided by it again, in float32, before the optimizer uses them.

Too large a scale overflows: some gradient becomes inf or NaN. The scale is found at run time:

    start at 2**16
    a step whose gradients hold an inf/NaN anywhere:  skip the update, scale *= 0.5
    after ``growth_interval`` clean steps in a row:   scale *= 2 (try a larger scale again)

Powers of two, so scaling and unscaling are exact (only the exponent changes).

Every rank must take the same decision, or the replicas diverge (one rank updates, another skips).
With tensor or pipeline parallelism each rank sees different gradients, so each rank's found-inf
flag is combined by ONE all-reduce (op "max", 8 bytes) over the world group, before anything is
applied.
"""
from __future__ import annotations

import numpy as np

from minidist.device import get_array_module

DEFAULT_GROWTH_INTERVAL = 2000  # PyTorch GradScaler's default: a scale that survived 2000 steps may grow


class DynamicLossScaler:
    """The loss scale and its state machine.

    ``scale`` multiplies the loss's backward seed; :meth:`found_inf` says (the same on every rank of
    ``group``) whether a step's gradients overflowed; :meth:`update` moves the state machine.
    ``backoff_factor=1`` and ``growth_factor=1`` give a static scale (see :meth:`static`), which
    still skips overflowing steps. ``group`` None: a single process, no communication.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = DEFAULT_GROWTH_INTERVAL, group=None):
        if not init_scale > 0 or not np.isfinite(init_scale):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale!r}")
        if growth_factor < 1 or not 0 < backoff_factor <= 1:
            raise ValueError(f"need growth_factor >= 1 and 0 < backoff_factor <= 1, got {growth_factor}, {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.group = group
        self.clean_steps = 0  # consecutive steps without overflow since the last change of scale
        self.skipped_steps = 0  # total

    @classmethod
    def static(cls, scale: float, group=None) -> DynamicLossScaler:
        """A fixed loss scale: never grows nor backs off, but overflowing steps are still skipped."""
        return cls(scale, growth_factor=1.0, backoff_factor=1.0, group=group)

    def found_inf(self, grads) -> bool:
        """True if any element of any of ``grads`` (arrays; None skipped) on ANY rank of ``group`` is
        inf or NaN. Sends one all-reduce (op "max") of a one-element flag over ``group``, in the
        gradients' memory (host or GPU); one number crosses to the host, at the end."""
        grads = [g for g in grads if g is not None]
        xp = get_array_module(grads[0]) if grads else np
        flag = xp.zeros(1)  # (1,) how many gradients here hold an inf or NaN
        for g in grads:
            flag += ~xp.isfinite(g).all()
        if self.group is not None:
            self.group.all_reduce(flag, op="max", label="metric: found-inf over the world")
        return bool(flag[0])

    def update(self, found_inf: bool) -> None:
        """After a step: back off (and count a skip) if it overflowed, else count a clean step and grow
        the scale after ``growth_interval`` of them."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        """The scaler's state as NumPy scalars (for checkpoints: no pickle)."""
        return {"scale": np.array(self.scale), "clean_steps": np.array(self.clean_steps, dtype=np.int64),
                "skipped_steps": np.array(self.skipped_steps, dtype=np.int64)}

    def load_state_dict(self, sd: dict) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.scale = float(sd["scale"])
        self.clean_steps, self.skipped_steps = int(sd["clean_steps"]), int(sd["skipped_steps"])
