"""Extension: how many micro-batches' activations a rank holds at most during a training step.

A (stage, micro-batch) is held from its F until the backward pass that frees its activations: B,
or W in a split backward (W still reads the layer inputs). 1F1B holds min(p - r, m) on rank r,
GPipe m (tests/test_pipeline_engine.py); the simulator predicts the same (``Timeline.peak_in_flight``).
Counts training steps only (evaluation keeps no graph). Sends nothing.
"""
from __future__ import annotations

from contextlib import contextmanager

from minidist.autograd import is_grad_enabled


class PeakInFlight:
    """Registered on ``executor``; ``peak`` is the most held at once during the last training step."""

    def __init__(self, executor):
        self.release = "W" if any(a.op == "W" for a in executor.schedule[executor.group.rank]) else "B"
        self.step, self.held, self.peak = None, 0, 0

    @contextmanager
    def around(self, a, step):
        yield
        if not is_grad_enabled():
            return
        if step is not self.step:  # a new step
            self.step, self.held, self.peak = step, 0, 0
        self.held += {"F": 1, self.release: -1}.get(a.op, 0)
        self.peak = max(self.peak, self.held)
