"""Ulysses (DeepSpeed-Ulysses): context parallelism by trading the sequence split for a head split.

Before attention every cp rank holds all of its heads for L = T / n of the tokens. One all-to-all
turns that into all T tokens for nh / n of the heads; each rank then runs ordinary causal attention
on its heads, over the whole sequence, and a second all-to-all turns the result back:

    (B, nh, L, hs) per rank  --all_to_all-->  (B, nh/n, T, hs)  --attention-->  (B, nh/n, T, hs)
                             <--all_to_all--  (B, nh, L, hs)

It needs the heads (those of this tensor-parallel rank) to divide by n; the trainer refuses
otherwise and names ring or zigzag, which cut the sequence instead and have no such limit. Attention
itself runs unchanged (it is the one-process Function), so each head's numbers are the single
process's.

What one call sends, per rank: forward one all-to-all of q, k, v together (3 x B x nh x L x hs
values, (n-1)/n of them to other ranks) and one of the output (B x nh x L x hs); backward the same
two, mirrored. Per token that is constant in n, where the ring's K/V traffic grows with the
sequence each rank attends over.
"""
from __future__ import annotations

from minidist.autograd import Function, get_array_module
from minidist.autograd.attention import ScaledDotProductAttention


def sequence_to_heads(x, group, head_axis: int, what: str):
    """All-to-all: this rank's tokens of every head (..., nh, L, hs) -> every token of its head
    group (..., nh/n, n L, hs), in sequence order. Sends head group j of my tokens to rank j
    (``what``: the arrays, for the trace's label)."""
    n, xp = group.size, get_array_module(x)
    groups = x.reshape(x.shape[:head_axis] + (n, -1) + x.shape[head_axis + 1:])  # (..., n, nh/n, L, hs)
    recv = group.all_to_all(xp.ascontiguousarray(xp.moveaxis(groups, head_axis, 0)),  # recv[i]: rank i's tokens
                            label=f"activation: {what}, my tokens of every head -> every token of my heads")
    joined = xp.moveaxis(recv, 0, -3)  # (..., nh/n, n, L, hs)
    return joined.reshape(joined.shape[:-3] + (-1, joined.shape[-1]))  # (..., nh/n, T, hs)


def heads_to_sequence(y, group, head_axis: int, what: str):
    """The inverse all-to-all: every token of my head group (..., nh/n, T, hs) -> my tokens of
    every head (..., nh, T/n, hs). Sends the j-th sequence slice to rank j (``what``: for the label)."""
    n, xp = group.size, get_array_module(y)
    slices = y.reshape(y.shape[:-2] + (n, -1, y.shape[-1]))  # (..., nh/n, n, L, hs)
    recv = group.all_to_all(xp.ascontiguousarray(xp.moveaxis(slices, -3, 0)),  # recv[i]: head group i, my tokens
                            label=f"activation: {what}, every token of my heads -> my tokens of every head")
    joined = xp.moveaxis(recv, 0, head_axis)  # (..., n, nh/n, L, hs)
    return joined.reshape(joined.shape[:head_axis] + (-1,) + joined.shape[head_axis + 2:])  # (..., nh, L, hs)


class UlyssesAttention(Function):
    """Causal attention of this rank's tokens q, k, v (B, nh, L, hs) over the whole sequence, by two
    all-to-alls around one-process attention on nh / n heads (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, group, dropout=None):
        xp = get_array_module(q)
        qkv = sequence_to_heads(xp.stack([q, k, v]), group, 2, "Ulysses q, k, v")  # (3, B, nh/n, T, hs)
        if dropout is not None:  # this rank's head group of the heads held
            nh = q.shape[1] // group.size
            dropout = dropout.of_heads(slice(group.rank * nh, (group.rank + 1) * nh))
        y = ScaledDotProductAttention.forward(ctx, qkv[0], qkv[1], qkv[2], True, dropout)  # (B, nh/n, T, hs); on ctx
        ctx.group = group
        return heads_to_sequence(y, group, 1, "Ulysses attention output")  # (B, nh, L, hs)

    @staticmethod
    def backward(ctx, grad):  # (B, nh, L, hs)
        group = ctx.group
        dy = sequence_to_heads(grad, group, 1, "Ulysses attention output's gradient")  # (B, nh/n, T, hs)
        dq, dk, dv, _, _ = ScaledDotProductAttention.backward(ctx, dy)
        dqkv = get_array_module(dq).stack([dq, dk, dv])  # (3, B, nh/n, T, hs)
        grads = heads_to_sequence(dqkv, group, 2, "Ulysses dq, dk, dv")  # (3, B, nh, L, hs)
        return grads[0], grads[1], grads[2], None, None


def ulysses_attention(q, k, v, group, dropout=None):
    """Causal attention for this rank's contiguous tokens (q, k, v: (B, nh, L, hs) Tensors) over
    the whole sequence held by ``group``'s ranks; nh must divide by ``group.size``. ``dropout``: an
    :class:`~minidist.nn.dropout.AttentionDropout` of the heads held, or None. Returns
    (B, nh, L, hs). Collective over ``group``: two all-to-alls forward, two backward."""
    return UlyssesAttention.apply(q, k, v, group, dropout)
