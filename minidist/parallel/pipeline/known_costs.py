"""Stages whose costs are known: a GPT whose blocks sleep instead of computing.

A sleeping block multiplies by one weight and sleeps ``seconds`` in forward, as long again for its
input's gradient (B) and as long for its weight's (W): a balanced stage with T_F = T_B = T_W, whose
"compute" holds no CPU. Ranks that share a few cores (or one interpreter) still run their schedule
at full speed, so the executed timeline of such stages shows the schedule, not the machine: lessons
04 and 12 draw it beside the real run's, and the tests check the executor's order on it.
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from minidist import nn
from minidist.autograd import Function
from minidist.model import GPT
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.pipeline.engine import PipelineEngine, split_micro_batches
from minidist.parallel.pipeline.schedules import placement_of
from minidist.parallel.pipeline.stages import PipelineStage
from minidist.parallel.pipeline.timeline import compute_spans, executed_timeline, gather_spans


class Sleep(Function):
    """``x * scale`` whose forward takes ``seconds``, and backward as much again for the input's
    gradient (B) and for the weight's (W)."""

    @staticmethod
    def forward(ctx, x, scale, seconds):
        ctx.x, ctx.scale, ctx.seconds = x, scale, seconds
        time.sleep(seconds)
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        grad_x = grad_scale = None
        if ctx.needs_input_grad[0]:
            time.sleep(ctx.seconds)
            grad_x = grad * ctx.scale
        if ctx.needs_input_grad[1]:
            time.sleep(ctx.seconds)
            grad_scale = (grad * ctx.x).sum(keepdims=True).reshape(1)
        return grad_x, grad_scale, None


class SleepingBlock(nn.Module):
    """A transformer block's stand-in: one scalar weight, ``seconds`` of sleep per F, B and W."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(np.ones(1))

    def forward(self, x, dropout=None):  # (a stand-in drops nothing)
        return Sleep.apply(x, self.scale, self.seconds)


def sleeping_gpt(config, seconds: float, seed: int = 1) -> GPT:
    """A float64 GPT of ``config`` whose blocks are :class:`SleepingBlock` (the embeddings and the
    head compute as usual: next to nothing at small sizes)."""
    model = GPT(config, seed=seed, dtype="float64")
    model.transformer.h = nn.ModuleList([SleepingBlock(seconds) for _ in range(config.n_layer)])
    return model


def run_known_costs(world, config, schedule: str, micro_batches: int, batch, virtual_stages: int = 1,
                    seconds: float = 0.02, steps: int = 2):
    """``steps`` training steps of ``schedule`` over ``world`` (pp = world.size) on a
    :func:`sleeping_gpt` with one block per stage, each stage's forward taking ``seconds`` (B and W as
    much; a chunk of ``virtual_stages`` takes its share). Returns ``(executed, ideal)`` timelines on
    rank 0 (None elsewhere), ``executed`` the step with the smallest bubble: other jobs on the machine
    only ever add idle time. SENDS what the schedule sends (activations and gradients between
    neighbouring stages) and, per step, one gather of every rank's compute spans to rank 0."""
    p, v = world.size, virtual_stages
    mesh = DeviceMesh(world, pp=p)
    model = sleeping_gpt(replace(config, n_layer=p * v), seconds / v)
    stage = PipelineStage(model, mesh.pp_rank, p, v, layers_per_stage=[1] * (p * v),
                          placement=placement_of(schedule))
    engine = PipelineEngine(stage, mesh, schedule, micro_batches, v)
    best = None
    for _ in range(steps):
        world.barrier(label="setup: start the known-cost step together")
        world.trace.clear()
        engine.forward_backward(split_micro_batches(batch, micro_batches))
        spans = gather_spans(world, compute_spans(world.trace))
        if spans is not None:
            executed = executed_timeline(spans)
            best = executed if best is None or executed.bubble() < best.bubble() else best
    return (best, engine.ideal) if best is not None else None
