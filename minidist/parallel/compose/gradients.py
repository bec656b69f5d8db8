"""The gradient pipeline: what happens to a step's gradients after backward, for every layout.

Written once, in this order (:func:`apply_gradients`):

    1 reduce     over the data replicas      DDP's buckets all-reduced, or ZeRO's units reduce-scattered
    2 complete   over the other axes         sequence-parallel partial sums over tp, tied embedding
                                             copies over the embedding group (complete.py)
    3 unscale    mixed precision             found-inf agreed over the whole world (skip the step on
                                             every rank, or on none); the gradients divided by the
                                             loss scale, where the update will run
    4 clip       one global norm             each element's square counted once (grad_ownership.py,
                                             clip.py), summed over tp, pp, ep and ZeRO's shards
    5 update     where the state lives       whole tensors, flat shards, host memory or files
    6 publish    the new parameters          cast to the compute dtype; ZeRO all-gathers them

A layout does not write its own copy of this order. It supplies where its gradients and optimizer
state live, an object with the methods the steps call (``reduce``, ``complete``, ``reduced_grads``,
``unscale``, ``clip``, ``update``, ``skip``): :class:`WholeGradients` (every replica holds whole
tensors: plain data parallelism, tensor, pipeline, context and expert parallelism) or
:class:`~minidist.parallel.zero.optimizer.ZeroOptimizer` (sharded over the replicas). Every sync is
linear in the gradients, so the order of 1, 2 and 4 does not change the numbers; this order lets
data parallelism's all-reduces overlap backward and clips the gradient the optimizer will use.
"""
from __future__ import annotations

import contextlib
import math

from minidist.amp import unscale
from minidist.optim import clip_grad_norm
from minidist.parallel.compose.clip import clip_grad_norm_parallel
from minidist.parallel.compose.complete import complete_whole


def apply_gradients(grads, lr: float, max_norm: float = math.inf, scaler=None, *, mesh=None, tied_group=None,
                    trace=None) -> float | None:
    """Steps 1-6 on ``grads`` (a :class:`WholeGradients` or a ZeroOptimizer), after backward: returns
    the gradient norm before clipping, or None when mixed precision's ``scaler`` found an overflow on
    some rank (the step is then skipped on every rank and the scale lowered). ``mesh``: the norm spans
    its tp shards, pp stages and ep groups, and sequence-parallel sums go over its tp group;
    ``tied_group``: a pipeline's embedding group. Sends what each step's docstring says."""
    tp_group = mesh.tp_group if mesh is not None else None
    grads.reduce()                                          # 1
    grads.complete(tp_group, tied_group)                    # 2
    if scaler is not None:                                  # 3
        if scaler.found_inf(grads.reduced_grads()):
            scaler.update(found_inf=True)
            grads.skip()
            return None
    grads.unscale(scaler.scale if scaler is not None else 1.0)
    norm = grads.clip(max_norm, mesh)                       # 4
    with trace.record("optimizer", kind="compute") if trace is not None else contextlib.nullcontext():
        grads.update(lr)                                    # 5, 6
    if scaler is not None:
        scaler.update(found_inf=False)
    return norm


def flatten_on_buckets(optimizer, dp) -> None:
    """Lay ``optimizer``'s parameters (the model's, or mixed precision's masters: named alike) and
    state out in one flat buffer per bucket of ``dp``, in the bucket's order, so that
    :class:`WholeGradients` updates each bucket with one call per run of equal weight decay
    (Optimizer.flatten). Sends nothing."""
    optimizer.flatten([b.names for b in dp.buckets])


class WholeGradients:
    """Gradients and optimizer state as whole tensors on every replica.

    ``model``: this rank's model (or its tensor-parallel shard, or its pipeline stage); ``optimizer``:
    SGD / AdamW over its parameters, or under mixed precision over ``amp``'s float32 masters
    (:class:`~minidist.amp.MixedPrecision`); ``dp``: the :class:`~minidist.parallel.data.data_parallel.DataParallel`
    whose buckets hold the gradients (None: one replica, nothing to reduce). When the optimizer was
    laid out on the buckets (:func:`flatten_on_buckets`), the update runs once per bucket."""

    def __init__(self, model, optimizer, dp=None, amp=None):
        self.model, self.optimizer, self.dp, self.amp = model, optimizer, dp, amp
        self.flat = dp is not None and getattr(optimizer, "flat_groups", None) is not None
        self.flat_grads = [b.buffer for b in dp.buckets] if self.flat else None  # the update's input

    def zero_grad(self) -> None:
        (self.dp or self.optimizer).zero_grad()

    def reduce(self) -> None:
        """Step 1: wait for every bucket's all-reduce (launched during backward, DataParallel.finish)."""
        if self.dp is not None:
            self.dp.finish()

    def complete(self, tp_group, tied_group) -> None:
        """Step 2 on whole tensors (:func:`~minidist.parallel.compose.complete.complete_whole`)."""
        complete_whole(self.model, tp_group, tied_group)

    def reduced_grads(self) -> list:
        return [p.grad for p in self.model.parameters()]

    def unscale(self, scale: float) -> None:
        """Step 3: under mixed precision each master's gradient is float32(grad) / ``scale``."""
        if self.amp is None:
            return
        if self.flat:  # one float32 buffer per bucket; each master's .grad a view of it
            self.flat_grads = [unscale(b.buffer, scale, self.amp.dtype) for b in self.dp.buckets]
            masters = dict(self.amp.master_parameters())
            for b, flat in zip(self.dp.buckets, self.flat_grads):
                for name, p, lo in zip(b.names, b.params, b.offsets):
                    masters[name].grad = flat[lo:lo + p.data.size].reshape(p.data.shape)
            return
        for (_, p), master in zip(self.amp.pairs, self.amp.masters):
            master.grad = None if p.grad is None else unscale(p.grad, scale, self.amp.dtype)

    def clip(self, max_norm: float, mesh) -> float:
        """Step 4 over the parameters the optimizer updates (the masters under mixed precision)."""
        params = self.amp.masters if self.amp is not None else list(self.model.parameters())
        return clip_grad_norm_parallel(params, max_norm, mesh) if mesh is not None else clip_grad_norm(params, max_norm)

    def update(self, lr: float) -> None:
        """Steps 5 and 6: one SGD / AdamW step per tensor; under mixed precision the masters are then
        rounded into the model's parameters."""
        self.optimizer.lr = lr
        if self.flat:
            self.optimizer.step_flat(self.flat_grads)
        else:
            self.optimizer.step()
        if self.amp is not None:
            self.amp.cast_to_model()

    def skip(self) -> None:
        """Nothing to undo: no state changed."""
