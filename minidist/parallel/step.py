"""One training step under any layout: forward and backward over the micro-batches, then the one
gradient pipeline (compose/gradients.py).

    zero_grad
    forward + backward over the micro-batches       (a pipeline engine, or the loop below), each
                                                    backward seeded with loss_scale / m (compose/loss_scaling.py),
                                                    MoE balance losses too; data parallelism's
                                                    all-reduces (or ZeRO-2/3's reduce-scatters) start
                                                    inside backward, after the last micro-batch
    the loss averaged over the dp ranks             (one float, for the report)
    apply_gradients                                 reduce -> complete -> unscale and found-inf -> clip
                                                    -> update -> publish (compose/gradients.py)

There is one path for every layout: what differs is where the gradients live, the model's state
(parallel/state.py): whole tensors (DDP buckets, SGD / AdamW, mixed precision's masters) or ZeRO's
flat shards.
The reported loss is the mean over micro-batches and dp ranks.
"""
from __future__ import annotations

import contextlib

import numpy as np

from minidist.comm import Trace
from minidist.data import inputs_and_targets
from minidist.device import get_array_module
from minidist.inspect.spans import ModuleSpans
from minidist.parallel.compose.gradients import apply_gradients
from minidist.parallel.compose.loss_scaling import backward_micro_batch, seed_aux_losses
from minidist.parallel.data.sampler import micro_batches


def forward_backward(model, batches, no_sync=contextlib.nullcontext, trace=None, loss_scale: float = 1.0,
                     dropouts=None):
    """Forward and backward over ``batches`` (micro-batches of (b, T+1) rows), accumulating
    gradients: each backward is seeded with ``loss_scale / len(batches)`` (compose/loss_scaling.py), so the
    accumulated gradient is that of the mean over all rows, times mixed precision's loss scale. All
    backward passes but the last run inside ``no_sync()`` (data parallelism communicates once, after
    the last). ``dropouts``: each micro-batch's DropoutKey, or None. Returns the mean loss. (A
    pipeline engine's ``forward_backward`` replaces exactly this function.)"""
    trace = trace or Trace(enabled=False)
    spans = ModuleSpans(trace)  # embedding, h.0 ... head inside each pass (inspect/spans.py)
    m, losses = len(batches), []
    dropouts = dropouts or [None] * m
    for i, batch in enumerate(batches):
        idx, targets = inputs_and_targets(batch)          # (b/m, T), (b/m, T)
        with no_sync() if i < m - 1 else contextlib.nullcontext():
            with trace.record("forward", kind="compute"), spans.forward(model, seq=i) as tape:
                _, loss = model(idx, targets, dropouts[i])
                tape.output(loss)
            with trace.record("backward", kind="compute"), spans.backward(tape):
                backward_micro_batch(loss, m, loss_scale)
        losses.append(loss.item())
    return float(np.mean(losses))


def train_step(model, state, batch, lr, grad_clip, *, engine=None, mesh=None, n_micro=1, trace=None, dropout=None):
    """One step on this rank's (b, T+1) rows, in the order of the module docstring. Returns
    (loss, grad norm); the norm is measured before clipping, and ``grad_clip <= 0`` measures
    without clipping.

    ``state``: the model's state (parallel/state.py), which the gradient pipeline drives: a
    :class:`~minidist.parallel.state.WholeState` (SGD / AdamW over the parameters or mixed precision's
    masters, gradients averaged by its DataParallel) or a ZeRO optimizer (flat shards, which then hold
    the gradients, the masters and the loss scaler). ``engine``: a PipelineEngine running the
    micro-batches through the pipeline stages. ``mesh``: the loss is averaged over its dp group, the
    norm spans the whole model (tp shards, pp stages) and sequence-parallel sums go over its tp group.
    Without ``mesh``: one process, plain arrays. Under mixed precision backward runs on the scaled
    loss, and a step whose gradients overflowed on any rank is skipped on every rank (grad norm None).
    ``dropout``: the DropoutKey of this rank's rows (minidist/nn/dropout.py), cut with the batch into
    the micro-batches' keys; None: nothing dropped."""
    trace = trace or Trace(enabled=False)
    scaler = state.scaler
    loss_scale = scaler.scale if scaler else 1.0
    state.zero_grad()
    batches = micro_batches(batch, n_micro)
    dropouts = dropout.split(n_micro) if dropout is not None else None
    seed_aux_losses(model, len(batches), loss_scale)
    if engine is not None:
        loss = engine.forward_backward(batches, loss_scale, dropouts)
    else:
        loss = forward_backward(model, batches, state.between_micro_batches, trace, loss_scale, dropouts)
    if mesh:  # one number, sent in the model's memory (NCCL takes GPU buffers only)
        xp = get_array_module(next(iter(model.parameters())).data)
        loss = float(mesh.dp_group.all_reduce(xp.array([loss]), op="avg", label="metric: mean loss over dp")[0])
    grad_norm = apply_gradients(state, lr, grad_clip if grad_clip > 0 else float("inf"), scaler, mesh=mesh,
                                tied_group=engine.embedding_group if engine is not None else None, trace=trace)
    return loss, grad_norm
