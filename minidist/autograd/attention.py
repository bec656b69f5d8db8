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


QUERY_BLOCK = 32  # causal attention's queries are taken this many at a time (below)


def query_blocks(T: int, S: int, is_causal: bool) -> list[tuple[int, int, int]]:
    """The blocks attention computes, as (first query, end of queries, end of keys): queries t0..t1-1
    score keys 0..e-1. Causal: blocks of :data:`QUERY_BLOCK` queries, each over the keys up to its
    last query (query t sees keys 0..t), so the scores above the diagonal's blocks are never computed
    nor kept, as FlashAttention skips them: at T = 128 the blocks hold 62.5% of the T x T scores.
    Otherwise one block, every query over every key."""
    if not is_causal:
        return [(0, T, S)]
    return [(t0, min(t0 + QUERY_BLOCK, T), min(t0 + QUERY_BLOCK, S)) for t0 in range(0, T, QUERY_BLOCK)]


def kept_probabilities(T: int, S: int, is_causal: bool = True) -> int:
    """How many attention probabilities one head keeps for backward: the blocks' scores (query_blocks)."""
    return sum((t1 - t0) * e for t0, t1, e in query_blocks(T, S, is_causal))


class ScaledDotProductAttention(Function):
    # The scale multiplies q (B, nh, T, hs), and in backward dQ and dK, rather than the scores and dS
    # (B, nh, T, S): S/hs times fewer multiplications. Each query block (query_blocks) is one batched
    # product over the heads, its softmax, and one product with v; P is kept block by block.
    @staticmethod
    def forward(ctx, q, k, v, is_causal, dropout=None):  # q (B, nh, T, hs), k and v (B, nh, S, hs)
        xp = get_array_module(q)
        T, S = q.shape[-2], k.shape[-2]
        scale = 1.0 / math.sqrt(q.shape[-1])
        q_scaled = q * scale
        mask = causal_mask(T, S, like=q) if is_causal else None
        blocks, probabilities, keeps, out = query_blocks(T, S, is_causal), [], [], []
        for t0, t1, e in blocks:
            att = matmul(q_scaled[..., t0:t1, :], k[..., :e, :].swapaxes(-1, -2))  # (B, nh, t1-t0, e): scaled scores
            if mask is not None:  # query t may look at keys 0..t only
                att += mask[t0:t1, :e]
            att -= att.max(axis=-1, keepdims=True)
            xp.exp(att, out=att)
            att *= 1.0 / sum_last(att)  # P, rows sum to 1
            keep = None if dropout is None else dropout.keep(range(t0, t1), range(e), att)  # one byte a probability
            out.append(matmul(att if keep is None else _dropped(att, keep, dropout.scale), v[..., :e, :]))
            probabilities.append(att)
            keeps.append(keep)
        ctx.q, ctx.k, ctx.v, ctx.scale, ctx.dropout = q, k, v, scale, dropout
        ctx.blocks, ctx.att, ctx.keep = blocks, tuple(probabilities), tuple(keeps)  # tuples, which inspect/accounting.py looks into
        return out[0] if len(out) == 1 else xp.concatenate(out, axis=-2)  # (B, nh, T, hs)

    @staticmethod
    def backward(ctx, grad):  # grad (B, nh, T, hs)
        q, k, v, scale = ctx.q, ctx.k, ctx.v, ctx.scale
        grad_q, grad_k, grad_v = [], None, None
        blocks = list(zip(ctx.blocks, ctx.att, ctx.keep))
        for (t0, t1, e), att, keep in reversed(blocks):  # the last block first: it sees every key
            grad_out = grad[..., t0:t1, :]
            dropped = att if keep is None else _dropped(att, keep, ctx.dropout.scale)  # P * D
            block_v = matmul(dropped.swapaxes(-1, -2), grad_out)  # (B, nh, e, hs)
            del dropped
            grad_s = matmul(grad_out, v[..., :e, :].swapaxes(-1, -2))  # dP (B, nh, t1-t0, e)
            if keep is not None:
                grad_s *= keep
                grad_s *= ctx.dropout.scale
            grad_s -= sum_last(grad_s * att)
            grad_s *= att  # dS, the gradient of the scaled scores
            grad_q.append(matmul(grad_s, k[..., :e, :]))  # (B, nh, t1-t0, hs)
            block_k = matmul(grad_s.swapaxes(-1, -2), q[..., t0:t1, :])  # (B, nh, e, hs)
            if grad_k is None:
                grad_k, grad_v = block_k, block_v
            else:
                grad_k[..., :e, :] += block_k
                grad_v[..., :e, :] += block_v
        grad_q = grad_q[0] if len(grad_q) == 1 else get_array_module(grad).concatenate(grad_q[::-1], axis=-2)
        grad_q *= scale
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
