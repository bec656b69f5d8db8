"""The vocabulary split over a tensor-parallel group: embedding and cross-entropy without ever
building the full (B, T, V) logits on one rank.

The vocabulary V is padded to a multiple of the group size n (``padded_vocab_size``) and rank r holds
rows ``[r * V_pad/n, (r+1) * V_pad/n)`` of the token embedding (and of the LM head, tied or not): the
"vocab" row of the table in tensor/layout.py.
Padded rows start at zero; their logits are masked out of the softmax, so they get no gradient.
"""
from minidist.autograd import Function, embedding, get_array_module
from minidist.parallel.tensor.tensor_parallel import exit_tensor_parallel_region
from minidist.parallel.tensor.layout import padded_vocab_size


def vocab_range(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, end) of the (padded) vocabulary rows that rank ``tp_rank`` holds."""
    per_rank = padded_vocab_size(vocab_size, tp_size) // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def vocab_parallel_embedding(layer, vocab_size: int, tp_group, sequence_parallel: bool = False) -> None:
    """Make the Embedding ``layer``, whose weight (V_pad/n, C) holds this rank's rows of the token
    table (:func:`vocab_range`), vocab-parallel: each rank looks up the tokens that fall in its rows
    and writes zeros for the others; summing over the ranks (g: all-reduce, or under sequence
    parallelism a reduce-scatter along the sequence, keeping this rank's T/n tokens) completes every
    row. Installs the forward on ``layer`` (an instance attribute, as recompute does)."""
    start, end = vocab_range(vocab_size, tp_group.rank, tp_group.size)

    def forward(idx):  # (B, T) ints -> (B, T, C), or (B, T/n, C) under sequence parallelism
        T, n = idx.shape[1], tp_group.size
        if sequence_parallel and T % n:
            raise ValueError(f"sequence parallelism splits the sequence: T = {T} is not divisible by tp = {n}")
        mine = (idx >= start) & (idx < end)  # (B, T)
        local_idx = get_array_module(idx).where(mine, idx - start, 0)  # others look up row 0, then get zeroed
        partial = embedding(local_idx, layer.weight) * mine[..., None].astype(layer.weight.dtype)  # (B, T, C)
        what = "the vocab-parallel embedding lookup"
        return exit_tensor_parallel_region(partial, tp_group, sequence_parallel, what)
    layer.forward = forward


CROSS_ENTROPY = ("cross-entropy 1/3, each token's largest logit over the vocabulary shards",
                 "cross-entropy 2/3, each token's softmax denominator summed over the vocabulary shards",
                 "cross-entropy 3/3, each token's target logit from the rank holding it")  # the labels of its calls


class VocabParallelCrossEntropy(Function):
    """Mean cross-entropy over tokens from vocab-sharded logits, in exactly 3 all-reduces of one
    number per token (N values, never N x V):

        1. max      m_i   = max over all ranks of my row maxima        (numerical stability)
        2. sum      s_i   = sum over ranks of sum_j exp(z_ij - m_i)    (the softmax denominator)
        3. sum      t_i   = z_i,target - m_i from the rank holding the target, 0 elsewhere

    loss = mean_i (log s_i - t_i). Backward needs no communication: d loss / d z_ij =
    (softmax_ij - [j == target_i]) / N on this rank's columns. Float16 logits are computed in
    float32, as the one-process cross-entropy does (the loss is float32: mixed precision's loss
    scale, 2**16, is no float16 number), and their gradient is float16 again."""

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_size):
        xp = get_array_module(logits)
        per_rank = logits.shape[-1]
        start = group.rank * per_rank
        z = logits.reshape(-1, per_rank).astype(xp.promote_types(logits.dtype, xp.float32), copy=False)  # (N, V/n)
        real = (start + xp.arange(per_rank)) < vocab_size  # (V/n,) False on padded columns
        z = xp.where(real, z, -xp.inf)  # padded logits masked out (a copy: logits stay untouched)
        row_max = z.max(axis=-1)  # (N,)
        group.all_reduce(row_max, op="max", label=f"activation: {CROSS_ENTROPY[0]}")  # 1
        z -= row_max[:, None]
        exp = xp.exp(z)  # (N, V/n)
        sum_exp = exp.sum(axis=-1)  # (N,)
        group.all_reduce(sum_exp, label=f"activation: {CROSS_ENTROPY[1]}")  # 2
        t = targets.reshape(-1) - start  # (N,) target column on this rank, if it is here
        here = (t >= 0) & (t < per_rank)
        rows = xp.arange(len(t))
        target_logit = xp.where(here, z[rows, xp.where(here, t, 0)], 0.0)  # (N,)
        group.all_reduce(target_logit, label=f"activation: {CROSS_ENTROPY[2]}")  # 3
        ctx.probs, ctx.t, ctx.here, ctx.shape, ctx.dtype = exp / sum_exp[:, None], t, here, logits.shape, logits.dtype
        return (xp.log(sum_exp) - target_logit).mean()

    @staticmethod
    def backward(ctx, grad):
        n = len(ctx.t)
        grad_z = ctx.probs * (grad / n)  # (N, V/n)
        rows = get_array_module(grad_z).arange(n)[ctx.here]
        grad_z[rows, ctx.t[ctx.here]] -= grad / n
        return grad_z.reshape(ctx.shape).astype(ctx.dtype, copy=False), None, None, None


def vocab_parallel_cross_entropy(logits, targets, tp_group, vocab_size: int):
    """Mean cross-entropy of this rank's vocabulary slice of the logits (..., V_pad/n) against the
    integer ``targets`` (...), whose ids lie in [0, vocab_size). Returns a scalar Tensor, the same on
    every rank of ``tp_group``."""
    return VocabParallelCrossEntropy.apply(logits, targets, tp_group, vocab_size)
