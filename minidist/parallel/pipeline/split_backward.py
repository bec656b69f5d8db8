"""Extension: a backward split into B and W, as the zero-bubble schedules (zero_bubble.py) run it.

B runs the stage's backward inside ``weight_grads_later`` (minidist/autograd/engine.py): only the
gradient of the stage's input is computed, what the previous stage waits for; the weight gradients
wait in the micro-batch's record until its W action runs them. The activations stay held until W
has read them. B + W equals one backward, bit for bit, and W is the stage's last backward pass:
data parallelism syncs after the last W (``PipelineExecutor.syncing``). Sends nothing.
"""
from __future__ import annotations

from contextlib import contextmanager

from minidist.autograd import weight_grads_later


class SplitBackward:
    """Registered on ``executor``: each B records its weight-gradient work, the W action runs it."""

    def __init__(self, executor):
        self.executor, self.later = executor, {}  # (stage, micro-batch) -> its weight-gradient work
        executor.run["W"] = self.weight

    @contextmanager
    def around(self, a, step):
        if a.op != "B":
            yield
            return
        with weight_grads_later() as later:
            yield
        self.later[(a.stage, a.microbatch)] = later

    def weight(self, a, step) -> None:
        """W: the weight gradients that micro-batch's B left for later."""
        with self.executor.syncing(a):
            self.later.pop((a.stage, a.microbatch)).run()
