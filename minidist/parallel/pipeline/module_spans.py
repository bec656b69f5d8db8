"""Extension: per-module spans (minidist/inspect/spans.py) inside the pipeline's forwards and backwards.

Inside each F the stage's modules (embedding on the first stage, its blocks, the head on the last)
record their forward spans, inside each B their backward spans, so a timeline shows which block a
rank computed and what it held; nothing is recorded unless the trace is watched. Sends nothing.
"""
from __future__ import annotations

from contextlib import contextmanager

from minidist.inspect.spans import ModuleSpans


class PipelineSpans:
    """Registered on ``executor``: one ModuleSpans per step, one tape per forward until its backward."""

    def __init__(self, executor):
        self.executor, self.step = executor, None

    @contextmanager
    def around(self, a, step):
        if step is not self.step:  # a new step
            self.step, self.spans, self.tapes = step, ModuleSpans(self.executor.trace), {}
        key, stage = (a.stage, a.microbatch), self.executor.stage
        if a.op == "F":
            with self.spans.forward(stage, a.microbatch, a.stage == 0, a.stage == stage.n_stages - 1) as tape:
                yield
                tape.output(step.outputs[key])
            self.tapes[key] = tape
        elif a.op == "B":
            with self.spans.backward(self.tapes.pop(key)):
                yield
        else:
            yield
