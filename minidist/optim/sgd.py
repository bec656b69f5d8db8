"""SGD with momentum: one element-wise update on plain arrays, cache-blocked on the host, and the
optimizer that loops it."""
from minidist.device import get_array_module
from minidist.optim.blocks import Scratch, block_length, chunks, none_of, rates_array
from minidist.optim.optimizer import Optimizer


def sgd_update(param, grad, momentum_buf, *, lr, momentum=0.0, weight_decay=0.0):
    """Update ``param`` (and ``momentum_buf``) in place with PyTorch's SGD rule (dampening 0):

        g      = grad + weight_decay * param
        buf    = momentum * buf + g        (buf starts at zero, so step 1 gives buf = g)
        param -= lr * buf                  (momentum == 0: param -= lr * g, buf is not touched)

    ``weight_decay`` may be a float or an array of per-element rates (a 0/1 mask times the rate):
    that is how a flat shard mixing decayed and non-decayed parameters is updated. NumPy arrays
    longer than :data:`~minidist.optim.blocks.BLOCK` are updated in cache-sized blocks, bitwise the
    whole-array result; CuPy arrays whole.
    """
    xp = get_array_module(param)
    arrays = (param, grad, momentum_buf if momentum else None, rates_array(weight_decay))
    scratch = Scratch(block_length(*arrays))
    for p, g, buf, rates in chunks(*arrays):
        n, rate = p.size, weight_decay if rates is None else rates
        if not _is_zero(rate):
            rated = xp.multiply(rate, p, out=scratch.out("rated", n, lambda: none_of(rate) * p[:0]))
            g = xp.add(g, rated, out=scratch.out("decayed", n, lambda: g[:0] + rated[:0]))  # grad + rate * param
        if momentum:
            buf *= momentum
            buf += g
            g = buf
        p -= xp.multiply(lr, g, out=scratch.out(("step", g.dtype), n, lambda: lr * g[:0]))


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

    def apply(self, param, grad, state: dict, weight_decay) -> None:
        """One SGD update of ``param`` from ``grad`` with its momentum buffer in ``state``."""
        sgd_update(param, grad, state["momentum_buf"], lr=self.lr, momentum=self.momentum, weight_decay=weight_decay)
