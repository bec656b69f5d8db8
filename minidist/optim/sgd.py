"""SGD with momentum: one element-wise update on plain arrays, cache-blocked on the host, and the
optimizer that loops it."""
from minidist.device import get_array_module
from minidist.optim.blocks import Decay, Scratch, block_length, chunks, none_of
from minidist.optim.optimizer import Optimizer


def sgd_update(param, grad, momentum_buf, *, lr, momentum=0.0, weight_decay=0.0):
    """Update ``param`` (and ``momentum_buf``) in place with PyTorch's SGD rule (dampening 0):

        g      = grad + weight_decay * param
        buf    = momentum * buf + g        (buf starts at zero, so step 1 gives buf = g)
        param -= lr * buf                  (momentum == 0: param -= lr * g, buf is not touched)

    ``weight_decay`` is a number, an array of per-element rates (a 0/1 mask times the rate: how a flat
    shard mixing decayed and non-decayed parameters is updated), or spans ``[(start, stop, rate), ...]``
    of a flat buffer (see :mod:`minidist.optim.blocks`). NumPy arrays are updated in cache-sized
    blocks (bitwise the whole-array result); CuPy arrays whole.
    """
    xp = get_array_module(param)
    decay = Decay(weight_decay, param)
    arrays = (param, grad, momentum_buf if momentum else None, decay.array)
    scratch = Scratch(block_length(*arrays))
    for (p, gr, buf, rates), lo, hi in chunks(*arrays):
        for a, b, rate in decay.pieces(lo, hi, rates):
            n, piece, g = b - a, p[a:b], gr[a:b]
            if rate is not None and not _is_zero(rate):
                rated = xp.multiply(rate, piece, out=scratch.out("rated", n, lambda: none_of(rate) * piece[:0]))
                g = xp.add(g, rated, out=scratch.out("decayed", n, lambda: g[:0] + rated[:0]))
            if momentum:
                velocity = buf[a:b]
                velocity *= momentum
                velocity += g
                g = velocity
            piece -= xp.multiply(lr, g, out=scratch.out(("step", g.dtype), n, lambda: lr * g[:0]))


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
