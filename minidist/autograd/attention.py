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

from minidist.autograd.backend import get_array_module, is_cupy, matmul, matmul_into, sum_last
from minidist.autograd.function import Function
from minidist.autograd.ops_shape import head_views, heads_of


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
    """Attention of q (B, nh, T, hs) over k, v (B, nh, S, hs), each array its own: :func:`attend`
    and :func:`attend_backward` with the output and the gradients in arrays of their own."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal, dropout=None):
        out = get_array_module(q).empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)  # (B, nh, T, hs)
        attend(ctx, q, k, v, is_causal, dropout, out)
        return out

    @staticmethod
    def backward(ctx, grad):  # grad (B, nh, T, hs)
        xp = get_array_module(grad)
        grads = tuple(xp.empty(a.shape, dtype=a.dtype) for a in (ctx.q, ctx.k, ctx.v))
        attend_backward(ctx, grad, *grads)
        return grads + (None, None)


class SelfAttention(Function):
    """Causal attention of a fused projection ``qkv`` (B, T, 3 nh hs), laid out q | k | v with the
    heads side by side in each, to (B, T, nh hs), the heads side by side: q, k, v are views of qkv,
    the output is written straight into its (B, T, nh, hs) layout, and the gradients straight into one
    (B, T, 3, nh, hs) array: no copy to cut the heads out or to put them back together."""

    @staticmethod
    def forward(ctx, qkv, n_head: int, dropout=None):
        B, T, width = qkv.shape
        out = get_array_module(qkv).empty((B, T, width // 3), dtype=qkv.dtype)  # (B, T, nh hs)
        attend(ctx, *head_views(qkv, n_head), True, dropout, heads_of(out, n_head))
        return out

    @staticmethod
    def backward(ctx, grad):  # grad (B, T, nh hs)
        n_head = ctx.q.shape[1]
        grads = get_array_module(grad).empty(grad.shape[:-1] + (3 * grad.shape[-1],), dtype=grad.dtype)
        attend_backward(ctx, heads_of(grad, n_head), *head_views(grads, n_head))
        return grads, None, None


def attend(ctx, q, k, v, is_causal: bool, dropout, out) -> None:
    """Attention's forward, written into ``out`` (B, nh, T, hs), an array or a view; what backward
    needs is kept on ``ctx``: q, k, v (the arrays given: views stay views) and P block by block.
    Each query block (query_blocks) is one batched product over the heads, its softmax, and one
    product with v. The scale multiplies q (B, nh, T, hs), not the scores: S/hs times fewer
    multiplications."""
    xp = get_array_module(q)
    T, S = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    q_scaled = q * scale
    mask = causal_mask(T, S, like=q) if is_causal else None
    blocks, probabilities, keeps = query_blocks(T, S, is_causal), [], []
    for t0, t1, e in blocks:
        att = matmul(q_scaled[..., t0:t1, :], k[..., :e, :].swapaxes(-1, -2))  # (B, nh, t1-t0, e): scaled scores
        if mask is not None:  # query t may look at keys 0..t only
            att += mask[t0:t1, :e]
        att -= att.max(axis=-1, keepdims=True)
        xp.exp(att, out=att)
        att *= 1.0 / sum_last(att)  # P, rows sum to 1
        keep = None if dropout is None else dropout.keep(range(t0, t1), range(e), att)  # one byte a probability
        matmul_into(att if keep is None else _dropped(att, keep, dropout.scale), v[..., :e, :], out[..., t0:t1, :])
        probabilities.append(att)
        keeps.append(keep)
    ctx.q, ctx.k, ctx.v, ctx.scale, ctx.dropout = q, k, v, scale, dropout
    ctx.blocks, ctx.att, ctx.keep = blocks, tuple(probabilities), tuple(keeps)  # tuples: inspect/accounting.py counts them


def attend_backward(ctx, grad, grad_q, grad_k, grad_v) -> None:
    """Attention's backward for output gradient ``grad`` (B, nh, T, hs), written into ``grad_q``,
    ``grad_k`` and ``grad_v`` (arrays or views). The last block first: it sees the most keys, so it
    writes their dK and dV and the earlier blocks add to their first keys (keys no query sees, past
    T under a causal mask, get 0). The scale multiplies dS once, for both dQ and dK."""
    q, k, v = ctx.q, ctx.k, ctx.v
    seen = ctx.blocks[-1][2]
    grad_k[..., seen:, :] = 0
    grad_v[..., seen:, :] = 0
    for n, ((t0, t1, e), att, keep) in enumerate(reversed(list(zip(ctx.blocks, ctx.att, ctx.keep)))):
        grad_out = grad[..., t0:t1, :]
        dropped = att if keep is None else _dropped(att, keep, ctx.dropout.scale)  # P * D
        if n == 0:
            matmul_into(dropped.swapaxes(-1, -2), grad_out, grad_v[..., :e, :])  # (B, nh, e, hs)
        else:
            grad_v[..., :e, :] += matmul(dropped.swapaxes(-1, -2), grad_out)
        del dropped
        grad_s = matmul(grad_out, v[..., :e, :].swapaxes(-1, -2))  # dP (B, nh, t1-t0, e)
        if keep is not None:
            grad_s *= keep
            grad_s *= ctx.dropout.scale
        grad_s -= sum_last(grad_s * att)
        grad_s *= att  # dS, the gradient of the scaled scores
        grad_s *= ctx.scale  # ... and of the unscaled ones
        matmul_into(grad_s, k[..., :e, :], grad_q[..., t0:t1, :])
        if n == 0:
            matmul_into(grad_s.swapaxes(-1, -2), q[..., t0:t1, :], grad_k[..., :e, :])
        else:
            grad_k[..., :e, :] += matmul(grad_s.swapaxes(-1, -2), q[..., t0:t1, :])


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


def self_attention(qkv, n_head: int, dropout=None):
    """Causal attention of the fused projection ``qkv`` (B, T, 3 nh hs: q | k | v, each with its
    ``n_head`` heads side by side) to (B, T, nh hs), the heads side by side; ``dropout`` as for
    :func:`scaled_dot_product_attention`."""
    return SelfAttention.apply(qkv, n_head, dropout)


def scaled_dot_product_attention(q, k, v, is_causal: bool = False, dropout=None):
    """Attention of queries ``q`` (B, nh, T, hs) over keys ``k`` / values ``v`` (B, nh, S, hs), scaled
    by 1/sqrt(hs); with ``is_causal`` query t sees keys 0..t only. ``dropout`` (an
    :class:`~minidist.nn.dropout.AttentionDropout`, for queries and keys at positions 0..T-1 and
    0..S-1) drops attention probabilities; None: none. Returns (B, nh, T, hs)."""
    return ScaledDotProductAttention.apply(q, k, v, is_causal, dropout)
