"""One training step under any layout: the order in which the parallelisms meet.

    zero_grad
    forward + backward over the micro-batches       (a pipeline engine, or the loop below)
    data-parallel gradient average                  (DataParallel.finish; ZeRO reduce-scatters instead)
    sequence-parallel sync of replicated grads      (tp all-reduce of LayerNorm / bias partial sums)
    tied-embedding all-reduce                       (first and last pipeline stage)
    global-norm clip                                (one float all-reduced over tp, pp, and dp under ZeRO)
    optimizer step                                  (ZeRO: own shard, then all-gather the parameters)

Every sync above is linear in the gradients, so their order does not change the numbers; this order
lets data parallelism's all-reduces overlap backward and clips the gradient the optimizer will use.
The loss follows contract 1: each micro-batch's mean loss is scaled by 1/m before backward, and the
reported loss is the mean over micro-batches and dp ranks.
"""
from __future__ import annotations

import contextlib

import numpy as np

from minidist.comm import Trace
from minidist.data import inputs_and_targets
from minidist.device import get_array_module
from minidist.optim import clip_grad_norm
from minidist.parallel.clip import clip_grad_norm_parallel
from minidist.parallel.sampler import micro_batches
from minidist.parallel.tensor_parallel import sync_sequence_parallel_grads
from minidist.parallel.zero import ZeroOptimizer


def forward_backward(model, batches, no_sync=contextlib.nullcontext, trace=None, loss_scale: float = 1.0):
    """Forward and backward over ``batches`` (micro-batches of (b, T+1) rows), accumulating
    gradients. Each micro-batch's mean loss is scaled by 1/len(batches) before backward, so the
    accumulated gradient is that of the mean over all rows (times ``loss_scale``: mixed precision's
    loss scaling keeps float16 gradients out of the underflow zone). All backward passes but the last run
    inside ``no_sync()`` (data parallelism communicates once, after the last). Returns the mean
    loss. (A pipeline engine's ``forward_backward`` replaces exactly this function.)"""
    trace = trace or Trace(enabled=False)
    m, losses = len(batches), []
    for i, batch in enumerate(batches):
        idx, targets = inputs_and_targets(batch)          # (b/m, T), (b/m, T)
        with no_sync() if i < m - 1 else contextlib.nullcontext():
            with trace.record("forward", kind="compute"):
                _, loss = model(idx, targets)
            with trace.record("backward", kind="compute"):
                loss.backward(get_array_module(loss.data).full_like(loss.data, loss_scale / m))
        losses.append(loss.item())
    return float(np.mean(losses))


def train_step(model, optimizer, batch, lr, grad_clip, *, dp=None, engine=None, mesh=None, n_micro=1,
               sequence_parallel=False, trace=None, amp=None):
    """One step on this rank's (b, T+1) rows, in the order of the module docstring. Returns
    (loss, grad norm); the norm is measured before clipping, and ``grad_clip <= 0`` measures
    without clipping.

    ``optimizer``: SGD / AdamW over the model's parameters, or a :class:`ZeroOptimizer` (which then
    owns the data-parallel gradient sync: pass no ``dp``). ``dp``: a DataParallel averaging the
    gradients over its group. ``engine``: a PipelineEngine running the micro-batches through the
    pipeline stages. ``mesh``: the loss is averaged over its dp group and the norm spans the whole
    model (tp shards, pp stages). Without ``dp``/``mesh``: one process, plain arrays. ``amp``: a
    MixedPrecision whose float32 masters ``optimizer`` updates; backward runs on the scaled loss, and
    a step whose gradients overflowed on any rank is skipped (grad norm None)."""
    trace = trace or Trace(enabled=False)
    zero = isinstance(optimizer, ZeroOptimizer)
    (dp or optimizer).zero_grad()
    batches = micro_batches(batch, n_micro)
    if engine is not None:
        loss = engine.forward_backward(batches)
    else:
        loss = forward_backward(model, batches, dp.no_sync if dp else contextlib.nullcontext, trace,
                                loss_scale=amp.scaler.scale if amp else 1.0)
    if dp:
        dp.finish()
    if mesh:  # one number, sent in the model's memory (NCCL takes GPU buffers only)
        xp = get_array_module(next(iter(model.parameters())).data)
        loss = float(mesh.dp_group.all_reduce(xp.array([loss]), op="avg")[0])
    if sequence_parallel:
        sync_sequence_parallel_grads(model, mesh.tp_group)
    if engine is not None:
        engine.all_reduce_tied_grads()
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    if amp:  # unscale into the masters, clip, update them, cast back (or skip on overflow)
        optimizer.lr = lr
        with trace.record("optimizer", kind="compute"):
            result = amp.step(optimizer, max_norm, mesh)
        return loss, None if result.skipped else result.grad_norm
    if zero:
        grad_norm = optimizer.clip_grad_norm(max_norm)  # reduce-scatters first (stages 0, 1)
    elif mesh:
        grad_norm = clip_grad_norm_parallel(model.parameters(), max_norm, mesh)
    else:
        grad_norm = clip_grad_norm(model.parameters(), max_norm)
    with trace.record("optimizer", kind="compute"):
        if zero:
            optimizer.step(lr)
        else:
            optimizer.lr = lr
            optimizer.step()
    return loss, grad_norm
