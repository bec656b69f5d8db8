"""Scaled dot-product attention as one Function: softmax(mask(q k^T / sqrt(hs))) @ v.

Forward keeps only q, k, v and the attention probabilities P. Backward, with dY the output gradient:
    dV = P^T dY,   dP = dY V^T,   dS = P * (dP - rowsum(dP * P)),   dQ = dS K / sqrt(hs),   dK = dS^T Q / sqrt(hs)
(the middle one is the softmax Jacobian applied row by row; masked entries have P = 0, so dS = 0 there).
"""
import math

from minidist.autograd.backend import get_array_module, matmul
from minidist.autograd.function import Function


class ScaledDotProductAttention(Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal):  # q (B, nh, T, hs), k and v (B, nh, S, hs)
        xp = get_array_module(q)
        scale = 1.0 / math.sqrt(q.shape[-1])
        att = matmul(q, k.swapaxes(-1, -2))  # (B, nh, T, S)
        att *= scale
        if is_causal:  # query t may look at keys 0..t only
            T, S = att.shape[-2:]
            att += xp.triu(xp.full((T, S), -xp.inf, dtype=att.dtype), k=1)
        att -= att.max(axis=-1, keepdims=True)
        xp.exp(att, out=att)
        att /= att.sum(axis=-1, keepdims=True)  # P, rows sum to 1
        ctx.q, ctx.k, ctx.v, ctx.att, ctx.scale = q, k, v, att, scale
        return matmul(att, v)  # (B, nh, T, hs)

    @staticmethod
    def backward(ctx, grad):  # grad (B, nh, T, hs)
        q, k, v, att, scale = ctx.q, ctx.k, ctx.v, ctx.att, ctx.scale
        grad_v = matmul(att.swapaxes(-1, -2), grad)  # (B, nh, S, hs)
        grad_s = matmul(grad, v.swapaxes(-1, -2))  # dP (B, nh, T, S)
        grad_s -= (grad_s * att).sum(axis=-1, keepdims=True)
        grad_s *= att  # dS, the gradient of the scaled scores
        grad_s *= scale
        grad_q = matmul(grad_s, k)  # (B, nh, T, hs)
        grad_k = matmul(grad_s.swapaxes(-1, -2), q)  # (B, nh, S, hs)
        return grad_q, grad_k, grad_v, None


def scaled_dot_product_attention(q, k, v, is_causal: bool = False):
    """Attention of queries ``q`` (B, nh, T, hs) over keys ``k`` / values ``v`` (B, nh, S, hs), scaled
    by 1/sqrt(hs); with ``is_causal`` query t sees keys 0..t only. Returns (B, nh, T, hs)."""
    return ScaledDotProductAttention.apply(q, k, v, is_causal)
