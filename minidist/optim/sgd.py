"""SGD with momentum: one element-wise update on plain arrays, and the optimizer that loops it."""
from minidist.optim.optimizer import Optimizer


def sgd_update(param, grad, momentum_buf, *, lr, momentum=0.0, weight_decay=0.0):
    """Update ``param`` (and ``momentum_buf``) in place with PyTorch's SGD rule (dampening 0):

        g      = grad + weight_decay * param
        buf    = momentum * buf + g        (buf starts at zero, so step 1 gives buf = g)
        param -= lr * buf                  (momentum == 0: param -= lr * g, buf is not touched)

    ``weight_decay`` may be a float or an array of per-element rates (a 0/1 mask times the rate):
    that is how a flat shard mixing decayed and non-decayed parameters is updated. Any array type
    with NumPy's operators works (NumPy, CuPy).
    """
    g = grad if _is_zero(weight_decay) else grad + weight_decay * param
    if momentum:
        momentum_buf *= momentum
        momentum_buf += g
        g = momentum_buf
    param -= lr * g


def _is_zero(rate):
    """True for a scalar rate of 0 (an array of rates is always applied)."""
    return isinstance(rate, (int, float)) and rate == 0


class SGD(Optimizer):
    """SGD with momentum over named parameters (PyTorch semantics, dampening 0, no Nesterov).

    ``weight_decay`` (L2, added to the gradient) applies only to parameters with ndim >= 2.
    State: one ``momentum_buf`` per parameter.
    """
    slots = ("momentum_buf",)

    def __init__(self, named_parameters, lr, momentum=0.0, weight_decay=0.0):
        super().__init__(named_parameters, lr, weight_decay)
        self.momentum = momentum

    def step(self):
        """Apply one SGD update to every parameter that has a gradient."""
        self.step_count += 1
        for name, p in self.params.items():
            if p.grad is not None:
                sgd_update(p.data, p.grad, self.state["momentum_buf"][name], lr=self.lr,
                           momentum=self.momentum, weight_decay=self.weight_decay_for(name))
