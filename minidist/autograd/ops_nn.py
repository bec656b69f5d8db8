"""Fused neural-network ops, each one Function with an analytic backward (fewer nodes, fewer
temporaries than composing them from arithmetic): linear, GELU, LayerNorm, embedding, softmax,
cross-entropy.
"""
import math

from minidist.autograd.backend import get_array_module, matmul, sum_last, sum_rows
from minidist.autograd.function import Function

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)  # Python floats keep float32 arrays float32 (NEP 50)
GELU_COEF = 0.044715


class Linear(Function):
    """``y = x @ weight.T + bias`` with PyTorch's layout: weight (out_features, in_features)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        x_2d = x.reshape(-1, x.shape[-1])  # (N, in): one large matmul beats a batch of small ones
        ctx.x_2d, ctx.weight = x_2d, weight
        y = matmul(x_2d, weight.T)  # (N, out)
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], weight.shape[0])  # (..., out)

    @staticmethod
    def backward(ctx, grad):  # grad (..., out)
        x_2d, weight = ctx.x_2d, ctx.weight
        needs = ctx.needs_input_grad
        grad_2d = grad.reshape(-1, grad.shape[-1])  # (N, out)
        grad_x = matmul(grad_2d, weight).reshape(*grad.shape[:-1], weight.shape[1]) if needs[0] else None  # (..., in)
        grad_w = matmul(grad_2d.T, x_2d) if needs[1] else None  # (out, in)
        grad_b = sum_rows(grad_2d) if needs[2] else None  # (out,)
        return grad_x, grad_w, grad_b


def linear(x, weight, bias=None):
    """Affine map of the last axis: (..., in) -> (..., out) with weight (out, in), bias (out,)."""
    return Linear.apply(x, weight, bias)


class GELU(Function):
    """GELU, tanh approximation (GPT-2): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""

    # It runs on the largest activations, (B, T, 4C), where every pass over them costs: constants are
    # folded, the steps are in place, and forward keeps the gate h = 0.5 (1 + tanh u) that both
    # directions need (7 passes and a tanh forward, 9 passes backward, where a step per term took 8 and 12).
    @staticmethod
    def forward(ctx, x):
        h = x * x
        h *= GELU_COEF * SQRT_2_OVER_PI
        h += SQRT_2_OVER_PI
        h *= x  # u = sqrt(2/pi) (x + 0.044715 x^3)
        get_array_module(x).tanh(h, out=h)
        h *= 0.5
        h += 0.5  # h = 0.5 (1 + tanh u)
        ctx.x, ctx.h = x, h
        return x * h

    @staticmethod
    def backward(ctx, grad):
        # dy/dx = h + 0.5 x (1 - tanh^2 u) du/dx = h + 2 du/dx (1 - h) h x,  du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2);
        # the bounded (1 - h) h multiplies x^2 before x does: where x is so large that x^3 overflows, the
        # gate is saturated and the term is 0, not inf * 0 = NaN
        x, h = ctx.x, ctx.h
        dy_dx = x * x
        dy_dx *= 6.0 * GELU_COEF * SQRT_2_OVER_PI
        dy_dx += 2.0 * SQRT_2_OVER_PI  # 2 du/dx
        dy_dx *= 1.0 - h
        dy_dx *= h
        dy_dx *= x
        dy_dx += h
        dy_dx *= grad
        return dy_dx


def gelu(x):
    return GELU.apply(x)


class LayerNorm(Function):
    """Normalise the last axis to zero mean, unit variance (biased), then scale and shift."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        inv_c = 1.0 / x.shape[-1]
        xc = x - sum_last(x) * inv_c  # (..., C), centred
        rstd = 1.0 / get_array_module(x).sqrt(sum_last(xc * xc) * inv_c + eps)  # (..., 1)
        xc *= rstd  # xhat (..., C)
        ctx.xhat, ctx.rstd, ctx.weight = xc, rstd, weight
        y = xc * weight
        if bias is not None:
            y += bias
        return y

    @staticmethod
    def backward(ctx, grad):  # grad (..., C)
        xhat, rstd, weight = ctx.xhat, ctx.rstd, ctx.weight
        needs = ctx.needs_input_grad
        C = grad.shape[-1]
        grad_xhat = grad * xhat  # (..., C): the weight's gradient before the sum over rows, and reused below
        grad_w = sum_rows(grad_xhat.reshape(-1, C)) if needs[1] else None
        grad_b = sum_rows(grad.reshape(-1, C)) if needs[2] else None
        grad_x = None
        if needs[0]:  # rstd * (g - mean(g) - xhat * mean(g * xhat)), g = grad * weight = d loss / d xhat;
            # both means are matrix-vector products with the weight: sum(g) = grad @ w, sum(g xhat) = (grad xhat) @ w
            mean_g = matmul(grad, weight)[..., None] * (1.0 / C)
            mean_g_xhat = matmul(grad_xhat, weight)[..., None] * (1.0 / C)
            del grad_xhat
            grad_x = grad * weight
            grad_x -= mean_g
            grad_x -= xhat * mean_g_xhat
            grad_x *= rstd
        return grad_x, grad_w, grad_b, None


def layer_norm(x, weight, bias=None, eps: float = 1e-5):
    """LayerNorm over the last axis with learned ``weight`` (C,) and optional ``bias`` (C,)."""
    return LayerNorm.apply(x, weight, bias, eps)


class Embedding(Function):
    """Row lookup ``weight[idx]``; backward scatter-adds each output row's gradient into its row."""

    @staticmethod
    def forward(ctx, idx, weight):
        ctx.idx, ctx.weight_shape = idx, weight.shape
        return weight[idx]  # (*idx.shape, C)

    @staticmethod
    def backward(ctx, grad):
        xp = get_array_module(grad)
        V, C = ctx.weight_shape
        grad_w = xp.zeros(V * C, dtype=grad.dtype)
        # repeats add up; add.at is ~6x faster over one flat axis than over rows: every element's
        # flat position in grad_w, (N, C), is its row's start plus its column
        flat = (ctx.idx.reshape(-1, 1) * C + xp.arange(C)).reshape(-1)
        xp.add.at(grad_w, flat, grad.reshape(-1))
        return None, grad_w.reshape(V, C)


def embedding(idx, weight):
    """Look up rows of ``weight`` (num_embeddings, C) at integer array ``idx`` -> (*idx.shape, C)."""
    return Embedding.apply(idx, weight)


class Softmax(Function):
    """Softmax over the last axis. Float16 inputs are computed in float32 (the exponentials would
    lose digits) and returned in float16, as the gradient is."""

    @staticmethod
    def forward(ctx, x):
        xp = get_array_module(x)
        y = x.astype(xp.promote_types(x.dtype, xp.float32))  # a copy
        y -= y.max(axis=-1, keepdims=True)
        xp.exp(y, out=y)
        y *= 1.0 / sum_last(y)
        ctx.y = y
        return y.astype(x.dtype, copy=False)

    @staticmethod
    def backward(ctx, grad):  # dx = y * (g - sum(g * y))
        y = ctx.y
        g = grad.astype(y.dtype)
        return (y * (g - sum_last(g * y))).astype(grad.dtype, copy=False)


def softmax(x):
    """Softmax over the last axis of ``x``."""
    return Softmax.apply(x)


class CrossEntropy(Function):
    """Softmax + negative log-likelihood in one numerically stable step (logits shifted by their max).

    Targets equal to ``ignore_index`` contribute nothing; "mean" divides by the number of the others
    (NaN when there are none, as in PyTorch), "sum" does not divide. Float16 logits are computed in
    float32 (as PyTorch's autocast does): the loss is float32, the logits' gradient float16.
    """

    @staticmethod
    def forward(ctx, logits, targets, ignore_index, reduction):
        xp = get_array_module(logits)
        V = logits.shape[-1]
        z = logits.reshape(-1, V).astype(xp.promote_types(logits.dtype, xp.float32), copy=False)  # (N, V)
        t = targets.reshape(-1)  # (N,)
        valid = t != ignore_index  # (N,)
        t = xp.where(valid, t, 0)
        rows = xp.arange(len(t))
        probs = z - z.max(axis=-1, keepdims=True)  # shifted logits, soon probabilities
        target_logit = probs[rows, t]  # (N,)
        xp.exp(probs, out=probs)
        total = sum_last(probs)[:, 0]  # (N,)
        probs *= (1.0 / total)[:, None]
        nll = (xp.log(total) - target_logit) * valid  # (N,)
        n_valid = int(valid.sum())
        scale = 1.0 if reduction == "sum" else 1.0 / n_valid if n_valid else math.nan
        ctx.probs, ctx.t, ctx.valid, ctx.scale, ctx.shape, ctx.dtype = probs, t, valid, scale, logits.shape, logits.dtype
        return nll.sum() * scale

    @staticmethod
    def backward(ctx, grad):
        probs, t, valid = ctx.probs, ctx.t, ctx.valid
        weight = (grad * ctx.scale) * valid.astype(probs.dtype)  # (N,) d loss / d nll_i
        grad_z = probs * weight[:, None]  # (N, V)
        grad_z[get_array_module(probs).arange(len(t)), t] -= weight
        return grad_z.reshape(ctx.shape).astype(ctx.dtype, copy=False), None, None, None


def cross_entropy(logits, targets, ignore_index: int = -1, reduction: str = "mean"):
    """Cross-entropy of ``logits`` (..., V) against integer ``targets`` (...) -> a scalar Tensor."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    return CrossEntropy.apply(logits, targets, ignore_index, reduction)
