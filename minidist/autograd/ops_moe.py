"""The mixture of experts' fused ops (minidist/moe.py): taking rows (the dispatch's gather and the
permutations, with a backward that scatters instead of adding at repeated indices), a grouped
linear layer and a grouped bias, where consecutive rows go through different weights, and the
weighted combine of each token's expert outputs."""
from minidist.autograd.backend import get_array_module, matmul
from minidist.autograd.function import Function


def group_bounds(counts) -> list[tuple[int, int]]:
    """(start, stop) of each group of ``counts`` consecutive rows."""
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + int(c)))
        start += int(c)
    return bounds


class TakeRows(Function):
    """``out[i] = x[index[i] // k]``: rows of ``x`` (R, ...), each of them ``k`` times over (the
    dispatch: row n's k choices are slots n k .. n k + k - 1), ``index`` holding DISTINCT slots in
    [0, R k) (a permutation, or with k > 1 the kept choices). Backward puts each gradient row in its
    slot and adds a row's k slots in slot order: no scatter-add, the same sums in every layout."""

    @staticmethod
    def forward(ctx, x, index, k):
        ctx.index, ctx.k, ctx.shape = index, k, x.shape
        return x[index // k] if k > 1 else x[index]

    @staticmethod
    def backward(ctx, grad):
        xp = get_array_module(grad)
        slots = xp.zeros((ctx.shape[0] * ctx.k,) + ctx.shape[1:], dtype=grad.dtype)  # (R k, ...)
        slots[ctx.index] = grad  # distinct slots: a plain assignment
        if ctx.k == 1:
            return slots, None, None
        return slots.reshape(ctx.shape[0], ctx.k, *ctx.shape[1:]).sum(axis=1), None, None


def take_rows(x, index, k: int = 1):
    """Rows ``x[index // k]`` (distinct slots ``index`` of x's rows repeated k times each)."""
    return TakeRows.apply(x, index, k)


class GroupedBias(Function):
    """``y[rows of g] + bias[g]``: consecutive groups of ``counts[g]`` rows of ``y`` (M, out), each
    with its own bias (out,) of ``bias`` (G, out). Backward: each group's gradient rows summed."""

    @staticmethod
    def forward(ctx, y, bias, counts):
        ctx.bounds = group_bounds(counts)
        out = y.copy()
        for g, (lo, hi) in enumerate(ctx.bounds):
            out[lo:hi] += bias[g]
        return out

    @staticmethod
    def backward(ctx, grad):
        xp = get_array_module(grad)
        needs = ctx.needs_input_grad
        grad_b = xp.stack([grad[lo:hi].sum(axis=0) for lo, hi in ctx.bounds]) if needs[1] else None  # (G, out)
        return grad if needs[0] else None, grad_b, None


def grouped_bias(y, bias, counts):
    """(M, out): row group g of ``y`` plus ``bias[g]``."""
    return GroupedBias.apply(y, bias, counts)


class GroupedLinear(Function):
    """``y[rows of g] = x[rows of g] @ weight[g].T + bias[g]``: the rows of ``x`` (M, in) come in
    G consecutive groups of ``counts[g]`` rows (sum M), group g through its own weight (out, in) of
    ``weight`` (G, out, in) and bias (out,) of ``bias`` (G, out) (or None). One matmul per group: the
    experts' MLP layers, each expert's tokens side by side (MegaBlocks' grouped GEMM, unfused)."""

    @staticmethod
    def forward(ctx, x, weight, bias, counts):
        ctx.x, ctx.weight, ctx.bounds = x, weight, group_bounds(counts)
        if ctx.bounds and ctx.bounds[-1][1] != x.shape[0]:
            raise ValueError(f"grouped linear: counts sum to {ctx.bounds[-1][1]}, x has {x.shape[0]} rows")
        y = get_array_module(x).empty((x.shape[0], weight.shape[1]), dtype=x.dtype)  # (M, out)
        for g, (lo, hi) in enumerate(ctx.bounds):
            if hi > lo:
                y[lo:hi] = matmul(x[lo:hi], weight[g].T)
                if bias is not None:
                    y[lo:hi] += bias[g]
        return y

    @staticmethod
    def backward(ctx, grad):  # grad (M, out)
        x, weight = ctx.x, ctx.weight
        xp = get_array_module(grad)
        needs = ctx.needs_input_grad
        grad_x = xp.empty(x.shape, dtype=grad.dtype) if needs[0] else None  # (M, in)
        grad_w = xp.zeros(weight.shape, dtype=weight.dtype) if needs[1] else None  # (G, out, in)
        grad_b = xp.zeros(weight.shape[:2], dtype=weight.dtype) if needs[2] else None  # (G, out)
        for g, (lo, hi) in enumerate(ctx.bounds):
            if hi == lo:
                continue
            if needs[0]:
                grad_x[lo:hi] = matmul(grad[lo:hi], weight[g])
            if needs[1]:
                grad_w[g] = matmul(grad[lo:hi].T, x[lo:hi])
            if needs[2]:
                grad_b[g] = grad[lo:hi].sum(axis=0)
        return grad_x, grad_w, grad_b, None


def grouped_linear(x, weight, bias, counts):
    """(M, in) -> (M, out): consecutive groups of ``counts`` rows through their own weight (G, out,
    in) and bias (G, out) (or None)."""
    return GroupedLinear.apply(x, weight, bias, counts)


class Combine(Function):
    """``out[n] = sum_j weights[n, j] * y[slot[n, j]]``: each token's k expert outputs, weighted by
    its gate weights (N, k) and added in slot order j = 0..k-1; ``y`` (M, C) holds the expert
    outputs, row ``slot[n, j]`` (an int array (N, k)) for token n's j-th choice, -1 for a dropped
    choice (it adds nothing). Every row of ``y`` is one choice's output (slots are distinct)."""

    @staticmethod
    def forward(ctx, y, weights, slot):
        xp = get_array_module(y)
        kept = slot >= 0  # (N, k)
        if kept.all():  # dropless: no padding copy
            picked = y[slot]  # (N, k, C)
        else:
            padded = xp.concatenate([y, xp.zeros((1,) + y.shape[1:], dtype=y.dtype)])  # row M: a dropped choice's 0
            picked = padded[xp.where(kept, slot, len(y))]  # (N, k, C)
        ctx.picked, ctx.weights, ctx.slot, ctx.kept, ctx.y_shape = picked, weights, slot, kept, y.shape
        out = picked[:, 0] * weights[:, :1]  # (N, C)
        for j in range(1, slot.shape[1]):
            out += picked[:, j] * weights[:, j:j + 1]
        return out

    @staticmethod
    def backward(ctx, grad):  # grad (N, C)
        xp = get_array_module(grad)
        needs = ctx.needs_input_grad
        grad_y = grad_w = None
        if needs[0]:
            grad_y = xp.zeros(ctx.y_shape, dtype=grad.dtype)  # (M, C)
            contrib = grad[:, None, :] * ctx.weights[..., None]  # (N, k, C)
            grad_y[ctx.slot[ctx.kept]] = contrib[ctx.kept]  # distinct rows: a plain assignment
        if needs[1]:
            grad_w = (ctx.picked * grad[:, None, :]).sum(axis=-1).astype(ctx.weights.dtype)  # (N, k)
        return grad_y, grad_w, None


def combine(y, weights, slot):
    """(N, C): token n's expert outputs ``y[slot[n, j]]`` weighted by ``weights[n, j]`` and summed."""
    return Combine.apply(y, weights, slot)
