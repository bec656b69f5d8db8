"""AdamW (Loshchilov & Hutter): one element-wise update on plain arrays, and the optimizer that loops it."""
from minidist.device import get_array_module
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
    shard of several parameters is updated by one call. Works on NumPy or CuPy arrays.
    """
    param *= 1 - lr * weight_decay
    exp_avg *= beta1
    exp_avg += (1 - beta1) * grad
    exp_avg_sq *= beta2
    work = grad * grad  # one scratch array, reused for each full-size intermediate below
    work *= 1 - beta2
    exp_avg_sq += work
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    xp = get_array_module(param)
    xp.sqrt(exp_avg_sq, out=work)
    work /= bias_correction2 ** 0.5
    work += eps  # the denominator
    xp.divide(exp_avg, work, out=work)
    work *= lr / bias_correction1
    param -= work


class AdamW(Optimizer):
    """AdamW over named parameters. Decoupled weight decay applies only to parameters with
    ndim >= 2 (matrices, embeddings), never to biases or LayerNorm gains.
    State: ``exp_avg`` and ``exp_avg_sq`` per parameter, and the step count.
    """
    slots = ("exp_avg", "exp_avg_sq")

    def __init__(self, named_parameters, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
        super().__init__(named_parameters, lr, weight_decay)
        self.betas, self.eps = betas, eps

    def step(self):
        """Apply one AdamW update to every parameter that has a gradient."""
        self.step_count += 1
        beta1, beta2 = self.betas
        for name, p in self.params.items():
            if p.grad is not None:
                adamw_update(p.data, p.grad, self.state["exp_avg"][name], self.state["exp_avg_sq"][name],
                             step=self.step_count, lr=self.lr, beta1=beta1, beta2=beta2, eps=self.eps,
                             weight_decay=self.weight_decay_for(name))
