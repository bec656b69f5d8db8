"""Scaled dot-product attention as one Function: softmax(mask(q k^T / sqrt(hs))) @ v.

Forward keeps only q, k, v and the attention probabilities P. Backward, with dY the output gradient:
    dV = P^T dY,   dP = dY V^T,   dS = P * (dP - rowsum(dP * P)),   dQ = dS K / sqrt(hs),   dK = dS^T Q / sqrt(hs)
(the middle one is the softmax Jacobian applied row by row; masked entries have P = 0, so dS = 0 there).
With dropout (D: 0 or 1/(1-p) per probability, minidist/nn/dropout.py) the output is (P * D) @ v, so
dV = (P * D)^T dY and dP = (dY V^T) * D; the rest is unchanged.
"""
import functools
import math

import numpy as np

from minidist.autograd.backend import get_array_module, is_cupy, matmul, sum_last
from minidist.autograd.function import Function


class ScaledDotProductAttention(Function):
    # The scale multiplies q (B, nh, T, hs), and in backward dQ and dK, rather than the scores and dS
    # (B, nh, T, S): S/hs times fewer multiplications.
    @staticmethod
    def forward(ctx, q, k, v, is_causal, dropout=None):  # q (B, nh, T, hs), k and v (B, nh, S, hs)
        xp = get_array_module(q)
        scale = 1.0 / math.sqrt(q.shape[-1])
        att = matmul(q * scale, k.swapaxes(-1, -2))  # (B, nh, T, S), the scaled scores
        if is_causal:  # query t may look at keys 0..t only
            att += causal_mask(*att.shape[-2:], like=att)
        att -= att.max(axis=-1, keepdims=True)
        xp.exp(att, out=att)
        att *= 1.0 / sum_last(att)  # P, rows sum to 1
        ctx.q, ctx.k, ctx.v, ctx.att, ctx.scale = q, k, v, att, scale
        ctx.dropout = dropout  # its keep mask (B, nh, T, S), one byte a probability: saved beside P
        ctx.keep = None if dropout is None else dropout.keep(range(att.shape[-2]), range(att.shape[-1]), att)
        return matmul(att if ctx.keep is None else _dropped(att, ctx.keep, dropout.scale), v)  # (B, nh, T, hs)

    @staticmethod
    def backward(ctx, grad):  # grad (B, nh, T, hs)
        q, k, v, att, scale, keep = ctx.q, ctx.k, ctx.v, ctx.att, ctx.scale, ctx.keep
        dropped = att if keep is None else _dropped(att, keep, ctx.dropout.scale)  # P * D
        grad_v = matmul(dropped.swapaxes(-1, -2), grad)  # (B, nh, S, hs)
        del dropped
        grad_s = matmul(grad, v.swapaxes(-1, -2))  # dP (B, nh, T, S)
        if keep is not None:
            grad_s *= keep
            grad_s *= ctx.dropout.scale
        grad_s -= sum_last(grad_s * att)
        grad_s *= att  # dS, the gradient of the scaled scores
        grad_q = matmul(grad_s, k)  # (B, nh, T, hs)
        grad_q *= scale
        grad_k = matmul(grad_s.swapaxes(-1, -2), q)  # (B, nh, S, hs)
        grad_k *= scale
        return grad_q, grad_k, grad_v, None, None


def _dropped(att, keep, scale: float):
    """P * D: the probabilities ``att`` where ``keep``, times ``scale`` (1/(1-p)), else 0."""
    out = att * keep
    out *= scale
    return out


def causal_mask(T: int, S: int, like):
    """(T, S) in ``like``'s dtype and memory: 0 where query t may see key s (s <= t), -inf above the
    diagonal. On the host it is made once per shape and shared, read-only, by every call."""
    if is_cupy(like):  # on a GPU the kernel is cheap, and a cached array would belong to one device
        xp = get_array_module(like)
        return xp.triu(xp.full((T, S), -xp.inf, dtype=like.dtype), k=1)
    return _host_causal_mask(T, S, like.dtype)


@functools.lru_cache(maxsize=16)
def _host_causal_mask(T: int, S: int, dtype):
    mask = np.triu(np.full((T, S), -np.inf, dtype=dtype), k=1)
    mask.setflags(write=False)
    return mask


def scaled_dot_product_attention(q, k, v, is_causal: bool = False, dropout=None):
    """Attention of queries ``q`` (B, nh, T, hs) over keys ``k`` / values ``v`` (B, nh, S, hs), scaled
    by 1/sqrt(hs); with ``is_causal`` query t sees keys 0..t only. ``dropout`` (an
    :class:`~minidist.nn.dropout.AttentionDropout`, for queries and keys at positions 0..T-1 and
    0..S-1) drops attention probabilities; None: none. Returns (B, nh, T, hs)."""
    return ScaledDotProductAttention.apply(q, k, v, is_causal, dropout)
