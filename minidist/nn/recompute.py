"""Activation recomputation (gradient checkpointing): trade compute for activation memory.

A transformer block normally keeps a dozen activations alive from its forward until its backward
(LayerNorm outputs, q/k/v, the attention probabilities (about half of (B, nh, T, T): the causal
blocks), the MLP's (B, T, 4C) ...).
Through :func:`checkpoint`, the block runs its forward under ``no_grad`` (nothing is saved) and
keeps only its INPUT (B, T, C). When backward reaches it, it runs the block's forward again, this
time building the graph, and back-propagates through that: the same operations on the same values,
so the gradients are identical, for the price of one more forward per block.

    recompute_blocks(model)      # every transformer block of a GPT now recomputes in backward

Recompute is its own choice: ZeRO-3 (``zero/stage3.py``) does not need it, because it gets its freed
weights back for backward through saved-tensor hooks; with both, the block's forward re-runs inside
ZeRO-3's gathered call.
"""
from __future__ import annotations

from minidist.autograd import Function, Tensor, is_grad_enabled, no_grad


def run_without_graph(fn, args, is_tensor):
    """The arrays of ``fn(*args)`` (one Tensor or a tuple of Tensors) run under ``no_grad``, the
    arguments flagged in ``is_tensor`` wrapped as Tensors: one array, or a tuple of arrays."""
    with no_grad():
        out = fn(*[Tensor(a) if t else a for a, t in zip(args, is_tensor)])
    return tuple(o.data for o in out) if isinstance(out, tuple) else out.data


def rerun_backward(fn, args, is_tensor, needs_grad, grads):
    """Run ``fn(*args)`` again WITH a graph, send ``grads`` (one per output; None for an output
    that got none) back through it, and return the gradient of each argument (None unless
    ``needs_grad``). Parameters used inside ``fn`` receive theirs in ``.grad``, as in any backward."""
    if not is_grad_enabled():
        raise RuntimeError("recomputation needs grad mode: call backward() outside no_grad()")
    leaves = [Tensor(a, requires_grad=n) if t else a for a, t, n in zip(args, is_tensor, needs_grad)]
    out = fn(*leaves)
    roots = [(o, g) for o, g in zip(out if isinstance(out, tuple) else (out,), grads) if g is not None]
    for k, (root, g) in enumerate(roots):
        root.backward(g, retain_graph=k < len(roots) - 1)  # keep the graph for the next root
    return tuple(leaf.grad if n else None for leaf, n in zip(leaves, needs_grad))


class Recompute(Function):
    """``fn(*args)`` that saves only its arguments and re-runs ``fn`` in backward.
    Apply as ``Recompute.apply(fn, is_tensor, *args)``; :func:`checkpoint` does it for you."""

    @staticmethod
    def forward(ctx, fn, is_tensor, *args):
        ctx.fn, ctx.is_tensor, ctx.args = fn, is_tensor, args  # the inputs: the only activations kept
        return run_without_graph(fn, args, is_tensor)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *rerun_backward(ctx.fn, ctx.args, ctx.is_tensor, ctx.needs_input_grad[2:], grads))


def checkpoint(fn, *args):
    """``fn(*args)`` (one Tensor or a tuple of Tensors), keeping only ``args`` for backward, which
    re-runs ``fn``. The gradients are exactly those of calling ``fn(*args)`` directly."""
    return Recompute.apply(fn, tuple(isinstance(a, Tensor) for a in args), *args)


def recompute_blocks(model) -> None:
    """Make every transformer block of ``model`` (``model.transformer.h``) run through
    :func:`checkpoint`: its activations are recomputed in backward instead of kept. The block's other
    arguments (its dropout) are kept with its input, so the recomputed forward drops the same elements."""
    for block in model.transformer.h:
        forward = block.forward  # the block's own bound method
        object.__setattr__(block, "forward", lambda x, *rest, forward=forward: checkpoint(forward, x, *rest))
