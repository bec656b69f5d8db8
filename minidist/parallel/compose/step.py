"""One training step under any layout: the order in which the parallelisms meet.

    zero_grad
    forward + backward over the micro-batches       (a pipeline engine, or the loop below), each
                                                    backward seeded with loss_scale / m (loss_scaling.py),
                                                    MoE balance losses too
    data-parallel gradient average                  (DataParallel.finish; ZeRO reduce-scatters instead)
    sequence-parallel sync of replicated grads      (tp all-reduce of LayerNorm / bias partial sums)
    tied-embedding all-reduce                       (first and last pipeline stage)
    found-inf (mixed precision)                     (one flag over the world: skip everywhere, or none)
    global-norm clip                                (one float all-reduced over tp, pp, and dp under ZeRO)
    optimizer step                                  (ZeRO: own shard, then all-gather the parameters)

Every sync above is linear in the gradients, so their order does not change the numbers; this order
lets data parallelism's all-reduces overlap backward and clips the gradient the optimizer will use.
Under ZeRO the sequence-parallel and tied-embedding sums run on the gradient shards, inside the
optimizer's reduction (zero.py). The reported loss is the mean over micro-batches and dp ranks.
"""
from __future__ import annotations

import contextlib

import numpy as np

from minidist.comm import Trace
from minidist.data import inputs_and_targets
from minidist.device import get_array_module
from minidist.optim import clip_grad_norm
from minidist.parallel.compose.clip import clip_grad_norm_parallel
from minidist.parallel.compose.loss_scaling import backward_micro_batch, seed_aux_losses
from minidist.inspect.spans import ModuleSpans
from minidist.parallel.data.sampler import micro_batches
from minidist.parallel.tensor.tensor_parallel import sync_sequence_parallel_grads
from minidist.parallel.zero.optimizer import ZeroOptimizer


def forward_backward(model, batches, no_sync=contextlib.nullcontext, trace=None, loss_scale: float = 1.0):
    """Forward and backward over ``batches`` (micro-batches of (b, T+1) rows), accumulating
    gradients: each backward is seeded with ``loss_scale / len(batches)`` (loss_scaling.py), so the
    accumulated gradient is that of the mean over all rows, times mixed precision's loss scale. All
    backward passes but the last run inside ``no_sync()`` (data parallelism communicates once, after
    the last). Returns the mean loss. (A pipeline engine's ``forward_backward`` replaces exactly
    this function.)"""
    trace = trace or Trace(enabled=False)
    spans = ModuleSpans(trace)  # embedding, h.0 ... head inside each pass (module_spans.py)
    m, losses = len(batches), []
    for i, batch in enumerate(batches):
        idx, targets = inputs_and_targets(batch)          # (b/m, T), (b/m, T)
        with no_sync() if i < m - 1 else contextlib.nullcontext():
            with trace.record("forward", kind="compute"), spans.forward(model, seq=i) as tape:
                _, loss = model(idx, targets)
                tape.output(loss)
            with trace.record("backward", kind="compute"), spans.backward(tape):
                backward_micro_batch(loss, m, loss_scale)
        losses.append(loss.item())
    return float(np.mean(losses))


def loss_scaler(optimizer, amp=None):
    """The run's mixed-precision loss scaler: a ZeroOptimizer's own, ``amp``'s (a MixedPrecision
    beside plain SGD / AdamW), or None in full precision."""
    return optimizer.scaler if isinstance(optimizer, ZeroOptimizer) else amp.scaler if amp else None


def train_step(model, optimizer, batch, lr, grad_clip, *, dp=None, engine=None, mesh=None, n_micro=1,
               sequence_parallel=False, trace=None, amp=None):
    """One step on this rank's (b, T+1) rows, in the order of the module docstring. Returns
    (loss, grad norm); the norm is measured before clipping, and ``grad_clip <= 0`` measures
    without clipping.

    ``optimizer``: SGD / AdamW over the model's parameters, or a :class:`ZeroOptimizer` (which then
    owns the data-parallel gradient sync, the sequence-parallel and tied sums, and under mixed
    precision the masters and the loss scaler: pass no ``dp`` and no ``amp``). ``dp``: a
    DataParallel averaging the gradients over its group. ``engine``: a PipelineEngine running the
    micro-batches through the pipeline stages. ``mesh``: the loss is averaged over its dp group and
    the norm spans the whole model (tp shards, pp stages). Without ``dp``/``mesh``: one process,
    plain arrays. ``amp``: a MixedPrecision whose float32 masters ``optimizer`` updates. Under mixed
    precision backward runs on the scaled loss, and a step whose gradients overflowed on any rank is
    skipped on every rank (grad norm None)."""
    trace = trace or Trace(enabled=False)
    zero = isinstance(optimizer, ZeroOptimizer)
    scaler = loss_scaler(optimizer, amp)
    loss_scale = scaler.scale if scaler else 1.0
    (dp or optimizer).zero_grad()
    batches = micro_batches(batch, n_micro)
    seed_aux_losses(model, len(batches), loss_scale)
    if engine is not None:
        loss = engine.forward_backward(batches, loss_scale)
    else:
        loss = forward_backward(model, batches, dp.no_sync if dp else contextlib.nullcontext, trace, loss_scale)
    if dp:
        dp.finish()
    if mesh:  # one number, sent in the model's memory (NCCL takes GPU buffers only)
        xp = get_array_module(next(iter(model.parameters())).data)
        loss = float(mesh.dp_group.all_reduce(xp.array([loss]), op="avg")[0])
    if sequence_parallel and not zero:
        sync_sequence_parallel_grads(model, mesh.tp_group)
    if engine is not None and not zero:
        engine.all_reduce_tied_grads()
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    if amp:  # unscale into the masters, clip, update them, cast back (or skip on overflow)
        optimizer.lr = lr
        with trace.record("optimizer", kind="compute"):
            result = amp.step(optimizer, max_norm, mesh)
        return loss, None if result.skipped else result.grad_norm
    if zero:
        if optimizer.found_inf():  # reduces first; mixed precision only
            return loss, None
        grad_norm = optimizer.clip_grad_norm(max_norm)
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
