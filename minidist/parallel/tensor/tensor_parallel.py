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
(:func:`tp_layout`, :func:`shard_for`, :func:`unshard`, imported here under their old home);
:func:`~minidist.parallel.tensor.apply.tensor_parallel` cuts a GPT by it and switches its forwards to
the operators and layers here.
"""
from minidist.autograd import Function, get_array_module, linear
from minidist.parallel.tensor.layout import padded_vocab_size, shard_for, tp_layout, unshard

__all__ = ["CopyToTensorParallelRegion", "ReduceFromTensorParallelRegion", "GatherFromSequenceParallelRegion",
           "ReduceScatterToSequenceParallelRegion", "GatherFromTensorParallelRegion", "ScatterToSequenceParallelRegion",
           "gather_from_tensor_parallel_region", "scatter_to_sequence_parallel_region", "copy_to_tensor_parallel_region",
           "reduce_from_tensor_parallel_region", "gather_from_sequence_parallel_region",
           "reduce_scatter_to_sequence_parallel_region", "enter_tensor_parallel_region", "exit_tensor_parallel_region",
           "row_parallel",
           "tp_layout", "padded_vocab_size", "shard_for", "unshard"]  # the last four: from layout.py

# ---- the communication operators (autograd Functions) ---------------------------------------------
# Each takes ``what``, the activation it moves in words, for the label of its calls in the trace
# ("activation: <what>, partial sums added over tp (g)"); the defaults name the layer it stands by.

COLUMN_INPUT, ROW_OUTPUT = "the column-parallel input", "the row-parallel output"


class CopyToTensorParallelRegion(Function):
    """f: identity forward; backward all-reduces (sum) the gradient over the tensor-parallel group.
    ``what`` names the activation in the trace's label (the call site says which)."""

    @staticmethod
    def forward(ctx, x, group, what=COLUMN_INPUT):
        ctx.group, ctx.what = group, what
        return x

    @staticmethod
    def backward(ctx, grad):  # copy: never write into a received gradient
        return ctx.group.all_reduce(grad.copy(), label=f"activation: {ctx.what}'s gradient, summed over tp (f)"), None


class ReduceFromTensorParallelRegion(Function):
    """g: forward all-reduces (sum) the partial outputs over the group; identity backward."""

    @staticmethod
    def forward(ctx, x, group, what=ROW_OUTPUT):
        return group.all_reduce(x.copy(), label=f"activation: {what}, partial sums added over tp (g)")

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
    def forward(ctx, x, group, what=COLUMN_INPUT):  # (B, T/n, C)
        ctx.group, ctx.what = group, what
        label = f"activation: {what}, the whole sequence gathered over tp (SP f)"
        return group.all_gather(_sequence_first(x), label=label).swapaxes(0, 1)  # (B, T, C)

    @staticmethod
    def backward(ctx, grad):  # (B, T, C)
        label = f"activation: {ctx.what}'s gradient, summed over tp, my tokens kept (SP f)"
        return ctx.group.reduce_scatter(_sequence_first(grad), label=label).swapaxes(0, 1), None  # (B, T/n, C)


class ReduceScatterToSequenceParallelRegion(Function):
    """Sequence parallelism's g: forward sums the partial outputs (B, T, C) over the ranks and keeps
    this rank's tokens (B, T/n, C) (a reduce-scatter); backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, group, what=ROW_OUTPUT):  # (B, T, C)
        ctx.group, ctx.what = group, what
        label = f"activation: {what}, partial sums added over tp, my tokens kept (SP g)"
        return group.reduce_scatter(_sequence_first(x), label=label).swapaxes(0, 1)  # (B, T/n, C)

    @staticmethod
    def backward(ctx, grad):  # (B, T/n, C)
        label = f"activation: {ctx.what}'s gradient, the whole sequence gathered over tp (SP g)"
        return ctx.group.all_gather(_sequence_first(grad), label=label).swapaxes(0, 1), None  # (B, T, C)


class GatherFromTensorParallelRegion(Function):
    """Forward all-gathers the ranks' blocks of the last axis (..., E/n) into (..., E), the same on
    every rank; backward keeps this rank's block of the gradient (every rank's is the same)."""

    @staticmethod
    def forward(ctx, x, group, what="the column-parallel output"):  # (N, E/n)
        ctx.group, ctx.width = group, x.shape[-1]
        xp = get_array_module(x)
        label = f"activation: {what}, every rank's columns gathered over tp"
        gathered = group.all_gather(xp.ascontiguousarray(x.T), label=label)  # (E, N): blocks along axis 0
        return xp.ascontiguousarray(gathered.T)  # (N, E)

    @staticmethod
    def backward(ctx, grad):  # (N, E)
        r, w = ctx.group.rank, ctx.width
        return grad[:, r * w:(r + 1) * w], None  # (N, E/n)


class ScatterToSequenceParallelRegion(Function):
    """Forward keeps this rank's T/n tokens of a (B, T, C) that every rank holds the same; backward
    all-gathers the tokens' gradients (B, T, C), so every rank again holds the same one."""

    @staticmethod
    def forward(ctx, x, group, what="the block's output"):  # (B, T, C)
        ctx.group, ctx.what = group, what
        T, n, r = x.shape[1], group.size, group.rank
        return x[:, r * T // n:(r + 1) * T // n]  # (B, T/n, C)

    @staticmethod
    def backward(ctx, grad):  # (B, T/n, C)
        label = f"activation: {ctx.what}'s gradient, the whole sequence gathered over tp"
        return ctx.group.all_gather(_sequence_first(grad), label=label).swapaxes(0, 1), None  # (B, T, C)


def gather_from_tensor_parallel_region(x, group, what="the column-parallel output"):
    """All-gather of the last axis forward, this rank's block of the gradient backward."""
    return GatherFromTensorParallelRegion.apply(x, group, what=what)


def scatter_to_sequence_parallel_region(x, group, what="the block's output"):
    """This rank's block of the sequence (axis 1) forward, all-gather of the gradient backward."""
    return ScatterToSequenceParallelRegion.apply(x, group, what=what)


def copy_to_tensor_parallel_region(x, group, what=COLUMN_INPUT):
    """f: identity forward, all-reduce of the gradient backward."""
    return CopyToTensorParallelRegion.apply(x, group, what=what)


def reduce_from_tensor_parallel_region(x, group, what=ROW_OUTPUT):
    """g: all-reduce forward, identity backward."""
    return ReduceFromTensorParallelRegion.apply(x, group, what=what)


def gather_from_sequence_parallel_region(x, group, what=COLUMN_INPUT):
    """All-gather along the sequence (axis 1) forward, reduce-scatter backward."""
    return GatherFromSequenceParallelRegion.apply(x, group, what=what)


def reduce_scatter_to_sequence_parallel_region(x, group, what=ROW_OUTPUT):
    """Reduce-scatter along the sequence (axis 1) forward, all-gather backward."""
    return ReduceScatterToSequenceParallelRegion.apply(x, group, what=what)


def enter_tensor_parallel_region(x, group, sequence_parallel: bool, what=COLUMN_INPUT):
    """What stands before a column-parallel layer: f, or the all-gather under sequence parallelism.
    Returns the full input (B, T, C), the same on every rank. ``what`` names ``x`` in the labels of
    the calls (f's backward all-reduce; the all-gather and its backward reduce-scatter)."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group, what)
    return copy_to_tensor_parallel_region(x, group, what)


def exit_tensor_parallel_region(x, group, sequence_parallel: bool, what=ROW_OUTPUT):
    """What stands after a row-parallel layer: g, or the reduce-scatter under sequence parallelism.
    ``what`` names ``x`` in the labels of the calls."""
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(x, group, what)
    return reduce_from_tensor_parallel_region(x, group, what)


# ---- the layers: a Linear holding this rank's block of its weight ---------------------------------
# Column-parallel (c_attn, c_fc, the LM head): weight (out/n, in) and bias (out/n,) are this rank's
# block of output features, and the one-process Linear's forward runs unchanged, y_r = x @ A_r.T + b_r.
# No communication there: its input must be the same on every rank, so it is passed through
# enter_tensor_parallel_region (f, or the sequence all-gather) first; its output stays split.


def row_parallel(layer, tp_group, sequence_parallel: bool = False, what: str = ROW_OUTPUT) -> None:
    """Make the Linear ``layer`` row-parallel: its weight (out, in/n) is this rank's block of input
    features, its bias replicated, and ``y = sum_r x_r @ B_r.T + b``: this rank multiplies its
    block, the ranks sum the partial outputs with g (all-reduce), or under sequence parallelism
    reduce-scatter them along the sequence, and the bias is added once, after the sum. Installs the
    forward on ``layer`` (an instance attribute, as recompute does); ``what`` names its output in the
    labels of the calls."""
    def forward(x):  # (B, T, in/n) -> (B, T, out), or (B, T/n, out) under sequence parallelism
        y = exit_tensor_parallel_region(linear(x, layer.weight), tp_group, sequence_parallel, what)
        return y + layer.bias if layer.bias is not None else y
    layer.forward = forward
