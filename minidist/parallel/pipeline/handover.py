"""Extension: two neighbouring stages on one rank hand their tensors over instead of sending them.

In ZB-V's "v" placement rank p-1 holds stages p-1 and p, the bottom of the V (actions.py), and the
schedule has no message between them (schedules.add_communication). After F of stage s, stage s+1
here gets its output as if received; after B of stage s+1, stage s gets the gradient of its input.
Sends nothing.
"""
from __future__ import annotations

from contextlib import contextmanager

from minidist.parallel.pipeline.actions import Action


class HandOver:
    """Registered on ``executor`` whose stage holds two neighbouring stages."""

    def __init__(self, executor):
        self.held = set(executor.stage.stages)

    @contextmanager
    def around(self, a, step):
        yield
        s, i = a.stage, a.microbatch
        if a.op == "F" and s + 1 in self.held:
            step.link.arrived[Action("RECV_F", s + 1, i)] = step.outputs[(s, i)].data  # (mb, T, C)
        elif a.op == "B" and s - 1 in self.held:
            step.link.arrived[Action("RECV_B", s - 1, i)] = step.inputs.pop((s, i)).grad  # (mb, T, C)
