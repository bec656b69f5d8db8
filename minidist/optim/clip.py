"""Gradient clipping by global norm: if the norm of ALL gradients together exceeds ``max_norm``,
scale every gradient by the same factor so that it equals ``max_norm``.

Split in two so that parallel code can insert one all-reduce: each rank sums the squares of the
gradient elements it owns (:func:`grad_norm_sq`), the sums are added across ranks, and every rank
scales its own gradients by :func:`clip_coef` of the square root.
"""
import numpy as np

LEAF = 1 << 16  # elements squared at once: 256 KiB of float32, a chunk that stays in cache


def grad_norm_sq(grads):
    """Sum of squares of all elements of all ``grads`` (arrays; None entries are skipped), as a float.
    Each gradient's sum is added in float64 where the gradient lives (on the GPU for CuPy arrays);
    only the total crosses to the host: one synchronisation, not one per gradient."""
    total = 0.0
    for g in grads:
        if g is not None:
            total = total + square_sum(g).astype("float64")
    return float(total)


def square_sum(g):
    """``(g * g).sum()``, bitwise, without the whole-array ``g * g`` temporary (154 MB for GPT-2's
    embedding gradient, fresh pages on every step). NumPy sums a contiguous float array pairwise:
    it splits n elements at n/2 rounded down to a multiple of 8 and adds the two halves' sums. Split
    the same way down to chunks of :data:`LEAF` and square one chunk at a time: the same additions
    in the same order. Other arrays (CuPy, float16, strided) take the one-line path."""
    if not (isinstance(g, np.ndarray) and g.dtype in (np.float32, np.float64) and g.flags.c_contiguous):
        return (g * g).sum()
    return _pairwise_square_sum(g.reshape(-1))


def _pairwise_square_sum(flat):
    n = flat.size
    if n <= LEAF:
        return (flat * flat).sum()
    half = n // 2
    half -= half % 8
    return _pairwise_square_sum(flat[:half]) + _pairwise_square_sum(flat[half:])


def clip_coef(total_norm, max_norm, eps=1e-6):
    """The factor every gradient is multiplied by: ``max_norm / (total_norm + eps)``, capped at 1
    (PyTorch's clip_grad_norm_ formula)."""
    return min(1.0, max_norm / (total_norm + eps))


def clip_grad_norm(params, max_norm):
    """Scale the gradients of ``params`` in place so their global L2 norm is at most ``max_norm``.
    Returns the norm BEFORE clipping (log it: spikes show instability)."""
    grads = [p.grad for p in params if p.grad is not None]
    total_norm = grad_norm_sq(grads) ** 0.5
    coef = clip_coef(total_norm, max_norm)
    if coef < 1.0:
        for g in grads:
            g *= coef
    return total_norm
