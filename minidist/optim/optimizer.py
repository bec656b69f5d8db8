"""What every optimizer shares: named parameters, per-parameter state arrays, checkpointable state.

The update math itself lives in element-wise functions (``sgd_update``, ``adamw_update``) that take
plain arrays, so the same code updates a whole tensor or a flat shard of a partitioned (ZeRO) buffer.
An optimizer class is a thin loop over named parameters that calls its function (``update``); ZeRO
runs the same classes over its flat shards, one ``update`` per shard.
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
        self.decay_masks = {}  # name -> 0/1 array: a flat buffer mixing decayed and other parameters
        self.step_count = 0
        self.state = {slot: {name: get_array_module(p.data).zeros_like(p.data)
                             for name, p in self.params.items()} for slot in self.slots}

    def weight_decay_for(self, name):
        """The weight-decay rate of one parameter: ``weight_decay`` if it is >= 2-D, else 0; for a flat
        buffer of several parameters (a ZeRO shard) with a mask in ``decay_masks[name]``, the rate
        per element (mask times rate, or 0 without decay)."""
        mask = self.decay_masks.get(name)
        if mask is not None:
            return self.weight_decay * mask if self.weight_decay else 0.0
        return self.weight_decay if decays(self.params[name].data.shape) else 0.0

    def step(self):
        """Apply one update to every parameter that has a gradient (step ``step_count + 1``)."""
        self.step_count += 1
        for name, p in self.params.items():
            if p.grad is not None:
                self.update(name)

    def update(self, name):
        """The update of one parameter (or a ZeRO shard's flat buffer) ``name`` from its ``.grad``."""
        p = self.params[name]
        self.apply(p.data, p.grad, {slot: self.state[slot][name] for slot in self.slots}, self.weight_decay_for(name))

    def apply(self, param, grad, state: dict, weight_decay) -> None:
        """The update math on plain arrays (``state``: slot -> array like ``param``), in place."""
        raise NotImplementedError

    def flatten(self, groups) -> None:
        """Lay each group of parameters (a list of names: a data-parallel bucket's, in its order) end
        to end in flat buffers: the parameters' values and every state slot become views of one flat
        array per group, so :meth:`step_flat` updates a group with one call per run of parameters
        that are decayed alike (matrices, or vectors: :func:`decays`). Each element sees the same operations with the same scalars
        as in :meth:`step`: bitwise the per-tensor update."""
        self.flat_groups = []
        for names in groups:
            params = [self.params[name] for name in names]
            xp = get_array_module(params[0].data)
            values = xp.concatenate([p.data.reshape(-1) for p in params])  # (n,) the group's values
            state = {slot: xp.concatenate([self.state[slot][name].reshape(-1) for name in names]) for slot in self.slots}
            runs, lo = [], 0
            for name, p in zip(names, params):
                hi = lo + p.data.size
                p.data = values[lo:hi].reshape(p.data.shape)
                for slot in self.slots:
                    self.state[slot][name] = state[slot][lo:hi].reshape(p.data.shape)
                decayed = decays(p.data.shape)
                if runs and runs[-1][2] == decayed and runs[-1][1] == lo:
                    runs[-1] = (runs[-1][0], hi, decayed)  # decayed alike: one run
                else:
                    runs.append((lo, hi, decayed))
                lo = hi
            self.flat_groups.append((values, state, runs))

    def step_flat(self, grads) -> None:
        """Apply one update to every group of :meth:`flatten`, ``grads`` holding each group's flat
        gradient (n,) in the same order (a data-parallel bucket's buffer, or its unscaled copy)."""
        self.step_count += 1
        for (values, state, runs), grad in zip(self.flat_groups, grads):
            for lo, hi, decayed in runs:
                rate = self.weight_decay if decayed else 0.0  # weight_decay_for's rule, per run
                self.apply(values[lo:hi], grad[lo:hi], {slot: a[lo:hi] for slot, a in state.items()}, rate)

    def set_weight_decay(self, rate: float) -> None:
        """The decoupled weight-decay rate from the next step on (a population member's explore): the
        same as an optimizer built with it, for per-tensor, flat and masked updates alike."""
        self.weight_decay = rate

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
