"""Tensor parallelism (Megatron-LM): each layer's weight matrices are split across the ranks of a
tensor-parallel group, and two conjugate operators join the pieces.

A transformer MLP is ``Y = GELU(X A) B``. Split A by columns and B by rows over n ranks:

    rank r:   Y_r = GELU(X A_r) B_r          (no communication: GELU acts on each column alone)
    all:      Y   = Y_0 + Y_1 + ... + Y_n-1   (one all-reduce)

Attention splits the same way with whole heads per rank (c_attn by columns, c_proj by rows). The two
operators, in Megatron's names:

    f = copy_to_tensor_parallel_region      forward: identity      backward: all-reduce
    g = reduce_from_tensor_parallel_region  forward: all-reduce    backward: identity

f stands before a column-parallel layer (every rank reads the same X, so the gradient of X is the sum
of the ranks' contributions); g stands after a row-parallel layer (the outputs are partial sums). So
each transformer layer costs 2 all-reduces forward (g after attention and MLP) and 2 backward (f).

Sequence parallelism (Korthikanti et al. 2022) also shards what lies between those layers
(LayerNorm, residual adds) along the sequence: each rank keeps T/n of the tokens there. Then
g becomes a reduce-scatter (sum the partial outputs and keep my tokens) and f an all-gather (collect
all tokens before the column-parallel layer); their backwards swap: all-gather <-> reduce-scatter.
An all-reduce *is* a reduce-scatter plus an all-gather, so the bytes sent stay the same while the
activations between layers shrink n times.

Which rank holds what, by GPT-2 parameter name, is the table in :mod:`minidist.parallel.tensor.layout`
(:func:`tp_layout`, :func:`shard_for`, :func:`unshard`, imported here under their old home).
"""
import numpy as np

from minidist import nn
from minidist.autograd import Function, get_array_module, linear
from minidist.parallel.compose.grad_ownership import summed_over_tp
from minidist.parallel.tensor.layout import divide, padded_vocab_size, shard_for, tp_layout, unshard

__all__ = ["CopyToTensorParallelRegion", "ReduceFromTensorParallelRegion", "GatherFromSequenceParallelRegion",
           "ReduceScatterToSequenceParallelRegion", "GatherFromTensorParallelRegion", "ScatterToSequenceParallelRegion",
           "gather_from_tensor_parallel_region", "scatter_to_sequence_parallel_region", "copy_to_tensor_parallel_region",
           "reduce_from_tensor_parallel_region", "gather_from_sequence_parallel_region",
           "reduce_scatter_to_sequence_parallel_region", "enter_tensor_parallel_region", "exit_tensor_parallel_region",
           "ColumnParallelLinear", "RowParallelLinear", "sync_sequence_parallel_grads",
           "tp_layout", "padded_vocab_size", "shard_for", "unshard"]  # the last four: from tp_layout.py

# ---- the communication operators (autograd Functions) ---------------------------------------------


class CopyToTensorParallelRegion(Function):
    """f: identity forward; backward all-reduces (sum) the gradient over the tensor-parallel group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_reduce(grad.copy()), None  # copy: never write into a received gradient


class ReduceFromTensorParallelRegion(Function):
    """g: forward all-reduces (sum) the partial outputs over the group; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return group.all_reduce(x.copy())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _sequence_first(x):
    """(B, T, C) -> contiguous (T, B, C): the collectives split and join along axis 0."""
    return get_array_module(x).ascontiguousarray(x.swapaxes(0, 1))


class GatherFromSequenceParallelRegion(Function):
    """Sequence parallelism's f: forward all-gathers the ranks' token shards (B, T/n, C) into the
    whole sequence (B, T, C); backward reduce-scatters the gradient (sum over ranks, keep my tokens)."""

    @staticmethod
    def forward(ctx, x, group):  # (B, T/n, C)
        ctx.group = group
        return group.all_gather(_sequence_first(x)).swapaxes(0, 1)  # (B, T, C)

    @staticmethod
    def backward(ctx, grad):  # (B, T, C)
        return ctx.group.reduce_scatter(_sequence_first(grad)).swapaxes(0, 1), None  # (B, T/n, C)


class ReduceScatterToSequenceParallelRegion(Function):
    """Sequence parallelism's g: forward sums the partial outputs (B, T, C) over the ranks and keeps
    this rank's tokens (B, T/n, C) (a reduce-scatter); backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, group):  # (B, T, C)
        ctx.group = group
        return group.reduce_scatter(_sequence_first(x)).swapaxes(0, 1)  # (B, T/n, C)

    @staticmethod
    def backward(ctx, grad):  # (B, T/n, C)
        return ctx.group.all_gather(_sequence_first(grad)).swapaxes(0, 1), None  # (B, T, C)


class GatherFromTensorParallelRegion(Function):
    """Forward all-gathers the ranks' blocks of the last axis (..., E/n) into (..., E), the same on
    every rank; backward keeps this rank's block of the gradient (every rank's is the same)."""

    @staticmethod
    def forward(ctx, x, group):  # (N, E/n)
        ctx.group, ctx.width = group, x.shape[-1]
        xp = get_array_module(x)
        gathered = group.all_gather(xp.ascontiguousarray(x.T))  # (E, N): blocks along axis 0
        return xp.ascontiguousarray(gathered.T)  # (N, E)

    @staticmethod
    def backward(ctx, grad):  # (N, E)
        r, w = ctx.group.rank, ctx.width
        return grad[:, r * w:(r + 1) * w], None  # (N, E/n)


class ScatterToSequenceParallelRegion(Function):
    """Forward keeps this rank's T/n tokens of a (B, T, C) that every rank holds the same; backward
    all-gathers the tokens' gradients (B, T, C), so every rank again holds the same one."""

    @staticmethod
    def forward(ctx, x, group):  # (B, T, C)
        ctx.group = group
        T, n, r = x.shape[1], group.size, group.rank
        return x[:, r * T // n:(r + 1) * T // n]  # (B, T/n, C)

    @staticmethod
    def backward(ctx, grad):  # (B, T/n, C)
        return ctx.group.all_gather(_sequence_first(grad)).swapaxes(0, 1), None  # (B, T, C)


def gather_from_tensor_parallel_region(x, group):
    """All-gather of the last axis forward, this rank's block of the gradient backward."""
    return GatherFromTensorParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x, group):
    """This rank's block of the sequence (axis 1) forward, all-gather of the gradient backward."""
    return ScatterToSequenceParallelRegion.apply(x, group)


def copy_to_tensor_parallel_region(x, group):
    """f: identity forward, all-reduce of the gradient backward."""
    return CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x, group):
    """g: all-reduce forward, identity backward."""
    return ReduceFromTensorParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x, group):
    """All-gather along the sequence (axis 1) forward, reduce-scatter backward."""
    return GatherFromSequenceParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x, group):
    """Reduce-scatter along the sequence (axis 1) forward, all-gather backward."""
    return ReduceScatterToSequenceParallelRegion.apply(x, group)


def enter_tensor_parallel_region(x, group, sequence_parallel: bool):
    """What stands before a column-parallel layer: f, or the all-gather under sequence parallelism.
    Returns the full input (B, T, C), the same on every rank."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group)
    return copy_to_tensor_parallel_region(x, group)


def exit_tensor_parallel_region(x, group, sequence_parallel: bool):
    """What stands after a row-parallel layer: g, or the reduce-scatter under sequence parallelism."""
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(x, group)
    return reduce_from_tensor_parallel_region(x, group)


# ---- the layers ----------------------------------------------------------------------------------


def _shard(p):
    """Tag ``p`` as a tensor-parallel shard (a distinct part on each rank of the group)."""
    p.tensor_parallel = True
    return p


class ColumnParallelLinear(nn.Module):
    """``y_r = x @ A_r.T + b_r``: this rank's block of output features (``out_features / n`` of them).

    weight (out/n, in) and bias (out/n,) are shards (``tensor_parallel = True``). No communication
    here: the input must be the same on every rank, so the model passes it through
    :func:`enter_tensor_parallel_region` (f, or the sequence all-gather) first; the output stays split.
    """

    def __init__(self, in_features: int, out_features: int, tp_group, bias: bool = True, dtype="float32"):
        super().__init__()
        self.in_features = in_features
        self.out_features = divide(out_features, tp_group.size, "out_features")  # local width
        self.weight = _shard(nn.Parameter(np.zeros((self.out_features, in_features), dtype=dtype)))
        self.bias = _shard(nn.Parameter(np.zeros(self.out_features, dtype=dtype))) if bias else None

    def forward(self, x):  # (B, T, in) -> (B, T, out/n)
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum_r x_r @ B_r.T + b``: this rank multiplies its block of input features and the ranks
    sum the partial outputs with g (all-reduce), or under sequence parallelism reduce-scatter them
    along the sequence. weight (out, in/n) is a shard; the bias is replicated and added once, after
    the sum."""

    def __init__(self, in_features: int, out_features: int, tp_group, bias: bool = True, dtype="float32",
                 sequence_parallel: bool = False):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.in_features = divide(in_features, tp_group.size, "in_features")  # local width
        self.out_features = out_features
        self.weight = _shard(nn.Parameter(np.zeros((out_features, self.in_features), dtype=dtype)))
        self.bias = nn.Parameter(np.zeros(out_features, dtype=dtype)) if bias else None  # replicated

    def forward(self, x):  # (B, T, in/n) -> (B, T, out), or (B, T/n, out) under sequence parallelism
        y = exit_tensor_parallel_region(linear(x, self.weight), self.tp_group, self.sequence_parallel)
        return y + self.bias if self.bias is not None else y


def sync_sequence_parallel_grads(model, tp_group) -> None:
    """Under sequence parallelism a replicated parameter (LayerNorm, row-parallel bias, position
    embedding: marked ``sequence_parallel = True``) sees only this rank's tokens, so its gradient is a
    partial sum: add them over the tensor-parallel group, all in ONE all-reduce of a flat buffer.
    Call after backward, before clipping. A no-op (nothing sent) without sequence parallelism."""
    grads = [p.grad for p in model.parameters() if summed_over_tp(p) and p.grad is not None]
    if not grads:
        return
    flat = get_array_module(grads[0]).concatenate([g.reshape(-1) for g in grads])  # (sum of sizes,)
    tp_group.all_reduce(flat)
    offset = 0
    for g in grads:
        g[...] = flat[offset:offset + g.size].reshape(g.shape)
        offset += g.size
