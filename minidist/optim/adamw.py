"""AdamW (Loshchilov & Hutter): one element-wise update on plain arrays, cache-blocked on the host,
and the optimizer that loops it."""
from minidist.device import get_array_module
from minidist.optim.blocks import Scratch, block_length, chunks, rates_array
from minidist.optim.optimizer import Optimizer


def adamw_update(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1=0.9, beta2=0.999, eps=1e-8,
                 weight_decay=0.0):
    """Update ``param``, ``exp_avg`` and ``exp_avg_sq`` in place with PyTorch's AdamW formula.

    ``step`` counts from 1 (this is the step-th update). With t = step:

        param     *= 1 - lr * weight_decay                 (decoupled decay, before the Adam step)
        exp_avg    = beta1 * exp_avg    + (1 - beta1) * grad
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad**2
        param     -= lr / (1 - beta1**t) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2**t) + eps)

    ``weight_decay`` may be a float or an array of per-element rates (mask times rate), so a flat
    shard of several parameters is updated by one call. NumPy arrays longer than
    :data:`~minidist.optim.blocks.BLOCK` are updated in cache-sized blocks, bitwise the whole-array
    result; CuPy arrays whole.
    """
    xp = get_array_module(param)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    denominator_scale, step_size = bias_correction2 ** 0.5, lr / bias_correction1
    arrays = (param, grad, exp_avg, exp_avg_sq, rates_array(weight_decay))
    scratch = Scratch(block_length(*arrays))
    for p, g, m, v, rates in chunks(*arrays):
        n = p.size
        if rates is not None:  # 1 - lr * rate per element, in the rates' dtype
            factor = xp.multiply(lr, rates, out=scratch.out("factor", n, lambda: lr * rates[:0]))
            p *= xp.subtract(1, factor, out=factor)
        elif 1 - lr * weight_decay != 1:  # p * 1.0 is p: a zero rate skips the pass
            p *= 1 - lr * weight_decay
        m *= beta1
        m += xp.multiply(1 - beta1, g, out=scratch.out("grad_term", n, lambda: (1 - beta1) * g[:0]))
        v *= beta2
        work = xp.multiply(g, g, out=scratch.out("work", n, lambda: g[:0] * g[:0]))  # reused below
        work *= 1 - beta2
        v += work
        xp.sqrt(v, out=work)
        work /= denominator_scale
        work += eps  # the denominator
        xp.divide(m, work, out=work)
        work *= step_size
        p -= work


class AdamW(Optimizer):
    """AdamW over named parameters. Decoupled weight decay applies only to parameters with
    ndim >= 2 (matrices, embeddings), never to biases or LayerNorm gains.
    State: ``exp_avg`` and ``exp_avg_sq`` per parameter, and the step count.
    """
    slots = ("exp_avg", "exp_avg_sq")

    def __init__(self, named_parameters, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
        super().__init__(named_parameters, lr, weight_decay)
        self.betas, self.eps = betas, eps

    def apply(self, param, grad, state: dict, weight_decay) -> None:
        """One AdamW update (step ``step_count``) of ``param`` from ``grad`` with its ``state`` slots."""
        adamw_update(param, grad, state["exp_avg"], state["exp_avg_sq"], step=self.step_count, lr=self.lr,
                     beta1=self.betas[0], beta2=self.betas[1], eps=self.eps, weight_decay=weight_decay)
