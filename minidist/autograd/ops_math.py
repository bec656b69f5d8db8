"""Elementwise arithmetic with broadcasting, matmul, and reductions.

Broadcasting in forward means summing in backward: a gradient shaped like the broadcast result is
reduced back to each input's shape by :func:`unbroadcast`. Python scalars and plain arrays may appear
on either side of an operator; they get no gradient.
"""
import numpy as np

from minidist.autograd.backend import get_array_module, matmul
from minidist.autograd.function import Function


def unbroadcast(grad, shape):
    """Sum ``grad`` over the axes that broadcasting added or stretched, so it has ``shape``."""
    if grad.shape == shape:
        return grad
    n_extra = grad.ndim - len(shape)
    if n_extra:
        grad = grad.sum(axis=tuple(range(n_extra)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if stretched:
        grad = grad.sum(axis=stretched, keepdims=True)
    return grad


class Add(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.a_shape, ctx.b_shape = np.shape(a), np.shape(b)
        return a + b

    @staticmethod
    def backward(ctx, grad):
        return unbroadcast(grad, ctx.a_shape), unbroadcast(grad, ctx.b_shape)


class Sub(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.a_shape, ctx.b_shape = np.shape(a), np.shape(b)
        return a - b

    @staticmethod
    def backward(ctx, grad):
        grad_b = unbroadcast(-grad, ctx.b_shape) if ctx.needs_input_grad[1] else None
        return unbroadcast(grad, ctx.a_shape), grad_b


class Mul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.a, ctx.b = a, b
        return a * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.a, ctx.b
        grad_a = unbroadcast(grad * b, np.shape(a)) if ctx.needs_input_grad[0] else None
        grad_b = unbroadcast(grad * a, np.shape(b)) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


class Div(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.a, ctx.b = a, b
        return a / b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.a, ctx.b
        grad_a = unbroadcast(grad / b, np.shape(a)) if ctx.needs_input_grad[0] else None
        grad_b = unbroadcast(-grad * a / (b * b), np.shape(b)) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


class Neg(Function):
    @staticmethod
    def forward(ctx, a):
        return -a

    @staticmethod
    def backward(ctx, grad):
        return -grad


class Pow(Function):
    """``a ** p`` for a constant Python number ``p``."""

    @staticmethod
    def forward(ctx, a, p):
        ctx.a, ctx.p = a, p
        return a ** p

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.p * ctx.a ** (ctx.p - 1), None


class MatMul(Function):
    """``a @ b`` for operands of rank >= 2; leading (batch) axes broadcast as in ``numpy.matmul``."""

    @staticmethod
    def forward(ctx, a, b):
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(f"matmul needs operands of rank >= 2, got shapes {a.shape} and {b.shape}")
        ctx.a, ctx.b = a, b
        return matmul(a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.a, ctx.b
        grad_a = unbroadcast(matmul(grad, b.swapaxes(-1, -2)), a.shape) if ctx.needs_input_grad[0] else None
        grad_b = unbroadcast(matmul(a.swapaxes(-1, -2), grad), b.shape) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


class Sum(Function):
    @staticmethod
    def forward(ctx, a, axis, keepdims):
        ctx.shape = a.shape
        ctx.axis = None if axis is None or keepdims else axis
        return a.sum(axis=axis, keepdims=keepdims)

    @staticmethod
    def backward(ctx, grad):
        xp = get_array_module(grad)
        if ctx.axis is not None:
            grad = xp.expand_dims(grad, ctx.axis)
        return xp.broadcast_to(grad, ctx.shape), None, None


def mean(a, axis=None, keepdims=False):
    """Mean over ``axis`` (an int, a tuple, or None for all): a sum scaled by 1/count."""
    shape = a.shape
    axes = range(len(shape)) if axis is None else (axis,) if isinstance(axis, int) else axis
    count = 1
    for ax in axes:
        count *= shape[ax]
    return Sum.apply(a, axis, keepdims) * (1.0 / count)
