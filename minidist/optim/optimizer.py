"""What every optimizer shares: named parameters, per-parameter state arrays, checkpointable state.

The update math itself lives in element-wise functions (``sgd_update``, ``adamw_update``) that take
plain arrays, so the same code updates a whole tensor or a flat shard of a partitioned (ZeRO) buffer.
An optimizer class is a thin loop over named parameters that calls its function.
"""
import numpy as np

from minidist.autograd.backend import get_array_module, to_numpy


def decays(shape):
    """nanoGPT's weight-decay rule: matrices and embeddings (ndim >= 2) are decayed, biases and
    LayerNorm gains (ndim 1) are not."""
    return len(shape) >= 2


class Optimizer:
    """Base class: holds ``params`` ({name: Parameter}), ``lr`` and ``state`` ({slot: {name: array}}).

    Subclasses name their state slots in ``slots`` (e.g. AdamW's ``exp_avg`` and ``exp_avg_sq``);
    each slot holds one zero-initialised array per parameter, same shape, dtype and device.
    Set ``opt.lr`` between steps to follow a learning-rate schedule.
    """
    slots: tuple = ()

    def __init__(self, named_parameters, lr, weight_decay):
        self.params = dict(named_parameters)
        if len({id(p) for p in self.params.values()}) != len(self.params):
            raise ValueError("a parameter appears under two names (tied weights?): it would be "
                             "updated twice per step; pass each parameter once")
        self.lr, self.weight_decay = lr, weight_decay
        self.step_count = 0
        self.state = {slot: {name: get_array_module(p.data).zeros_like(p.data)
                             for name, p in self.params.items()} for slot in self.slots}

    def weight_decay_for(self, name):
        """The weight-decay rate of one parameter: ``weight_decay`` if it is >= 2-D, else 0."""
        return self.weight_decay if decays(self.params[name].data.shape) else 0.0

    def step(self):
        """Apply one update to every parameter that has a gradient."""
        raise NotImplementedError

    def zero_grad(self):
        """Drop every parameter's gradient, so the next backward starts from nothing."""
        for p in self.params.values():
            p.grad = None

    def state_dict(self):
        """The optimizer's state as NumPy arrays: ``"<slot>.<parameter name>"`` per state array,
        plus ``"step"`` (0-d int64). No pickle needed to save it."""
        sd = {f"{slot}.{name}": to_numpy(arr).copy() for slot, arrs in self.state.items()
              for name, arr in arrs.items()}
        sd["step"] = np.array(self.step_count, dtype=np.int64)
        return sd

    def load_state_dict(self, sd):
        """Copy state saved by :meth:`state_dict` into this optimizer's arrays, in place."""
        for slot, arrs in self.state.items():
            for name, arr in arrs.items():
                copy_into(arr, sd[f"{slot}.{name}"])
        self.step_count = int(sd["step"])


def copy_into(dst, src):
    """Overwrite ``dst`` (NumPy or CuPy) in place with the values of the NumPy array ``src``."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"optimizer state has shape {src.shape}, expected {dst.shape}")
    dst[...] = get_array_module(dst).asarray(src)
