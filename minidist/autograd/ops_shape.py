"""Ops that move data around without arithmetic: reshape, permute, indexing, split, concatenate, and
attention's heads cut out of the fused q|k|v and put side by side again.

Their backward moves the gradient back the same way: reshape it back, permute by the inverse
permutation, scatter it into zeros at the indexed places, concatenate the pieces, split the whole.
"""
import numpy as np

from minidist.autograd.backend import get_array_module
from minidist.autograd.function import Function
from minidist.autograd.tensor import Tensor


class Reshape(Function):
    @staticmethod
    def forward(ctx, a, shape):
        ctx.shape = a.shape
        return a.reshape(shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.reshape(ctx.shape), None


class Permute(Function):
    """Reorder axes: output axis i is input axis ``axes[i]``."""

    @staticmethod
    def forward(ctx, a, axes):
        ctx.axes = axes
        return a.transpose(axes)

    @staticmethod
    def backward(ctx, grad):
        return grad.transpose(tuple(np.argsort(ctx.axes))), None


def index_to_arrays(index):
    """An index with any Tensors in it replaced by their arrays."""
    if isinstance(index, tuple):
        return tuple(i.data if isinstance(i, Tensor) else i for i in index)
    return index.data if isinstance(index, Tensor) else index


def _is_basic(index) -> bool:
    """True for indices made only of ints, slices, None and Ellipsis (each element picked once)."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is None or p is Ellipsis or isinstance(p, (int, slice, np.integer)) for p in parts)


class GetItem(Function):
    """``a[index]`` with ints, slices, integer/boolean arrays; repeated picks add up in backward."""

    @staticmethod
    def forward(ctx, a, index):
        ctx.shape, ctx.index = a.shape, index
        return a[index]

    @staticmethod
    def backward(ctx, grad):
        xp = get_array_module(grad)
        grad_a = xp.zeros(ctx.shape, dtype=grad.dtype)
        if _is_basic(ctx.index):
            grad_a[ctx.index] = grad
        else:
            xp.add.at(grad_a, ctx.index, grad)
        return grad_a, None


class Split(Function):
    """Cut ``a`` along ``axis`` into pieces of the given sizes (one output per piece)."""

    @staticmethod
    def forward(ctx, a, sizes, axis):
        ctx.axis = axis
        pieces = get_array_module(a).split(a, np.cumsum(sizes)[:-1].tolist(), axis=axis)
        ctx.shapes = [p.shape for p in pieces]
        return tuple(pieces)

    @staticmethod
    def backward(ctx, *grads):
        some = next(g for g in grads if g is not None)
        xp = get_array_module(some)
        full = [xp.zeros(s, dtype=some.dtype) if g is None else g for g, s in zip(grads, ctx.shapes)]
        return xp.concatenate(full, axis=ctx.axis), None, None


def split(a: Tensor, split_size_or_sections, axis: int = 0):
    """Like ``torch.split``: an int cuts pieces of that size (the last may be smaller), a list gives
    each piece's size. Returns a tuple of Tensors."""
    n = a.shape[axis]
    if isinstance(split_size_or_sections, int):
        size = split_size_or_sections
        sizes = [min(size, n - start) for start in range(0, n, size)]
    else:
        sizes = list(split_size_or_sections)
        if sum(sizes) != n:
            raise ValueError(f"split sizes {sizes} do not add up to {n} along axis {axis}")
    return Split.apply(a, sizes, axis)


def head_views(qkv, n_head: int):
    """q, k, v (B, nh, T, hs): views of ``qkv`` (B, T, 3 nh hs), laid out q | k | v with the heads
    side by side in each (C-contiguous); writing into them writes into ``qkv``."""
    B, T, width = qkv.shape
    parts = qkv.reshape(B, T, 3, n_head, width // (3 * n_head))
    return tuple(parts[:, :, i].transpose(0, 2, 1, 3) for i in range(3))


def heads_of(y, n_head: int):
    """(B, nh, T, hs): a view of ``y`` (B, T, nh hs), the heads side by side."""
    B, T, width = y.shape
    return y.reshape(B, T, n_head, width // n_head).transpose(0, 2, 1, 3)


class SplitHeads(Function):
    """The fused projection (B, T, 3 nh hs), laid out q | k | v with heads side by side in each, as
    q, k, v (B, nh, T, hs): three views, no copy. Backward writes the three gradients into one
    (B, T, 3, nh, hs) array: one copy each, where split, reshape and transpose as separate ops copied
    twice (the heads back side by side, then the three pieces concatenated)."""

    @staticmethod
    def forward(ctx, qkv, n_head: int):
        ctx.shape, ctx.n_head = qkv.shape, n_head
        return head_views(qkv, n_head)

    @staticmethod
    def backward(ctx, *grads):  # 3 x (B, nh, T, hs), or None
        some = next(g for g in grads if g is not None)
        out = get_array_module(some).empty(ctx.shape, dtype=some.dtype)
        for view, g in zip(head_views(out, ctx.n_head), grads):
            view[...] = 0 if g is None else g
        return out, None


def split_heads(qkv: Tensor, n_head: int):
    """q, k, v (B, nh, T, hs) of attention's fused projection ``qkv`` (B, T, 3 nh hs), laid out q | k | v."""
    return SplitHeads.apply(qkv, n_head)


class MergeHeads(Function):
    """Attention's output (B, nh, T, hs) with its heads side by side, (B, T, nh hs): forward copies
    once, backward is a view."""

    @staticmethod
    def forward(ctx, y):
        B, n_head, T, hs = ctx.shape = y.shape
        return y.transpose(0, 2, 1, 3).reshape(B, T, n_head * hs)

    @staticmethod
    def backward(ctx, grad):  # (B, T, nh hs)
        return heads_of(grad, ctx.shape[1])


def merge_heads(y: Tensor) -> Tensor:
    """(B, nh, T, hs) -> (B, T, nh hs): the heads side by side."""
    return MergeHeads.apply(y)


class Cat(Function):
    """Concatenate all positional inputs along ``axis``."""

    @staticmethod
    def forward(ctx, *arrays, axis):
        ctx.axis = axis
        ctx.sizes = [a.shape[axis] for a in arrays]
        return get_array_module(arrays[0]).concatenate(arrays, axis=axis)

    @staticmethod
    def backward(ctx, grad):
        xp = get_array_module(grad)
        return tuple(xp.split(grad, np.cumsum(ctx.sizes)[:-1].tolist(), axis=ctx.axis))


def cat(tensors, axis: int = 0) -> Tensor:
    """Concatenate a sequence of Tensors along ``axis`` (``torch.cat``)."""
    return Cat.apply(*tensors, axis=axis)
