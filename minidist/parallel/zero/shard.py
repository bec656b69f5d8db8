"""One rank's shard of one ZeRO unit: the arrays it holds and the per-element facts the step reads.

A unit (flat_buffer.py) is a flat vector of ``numel`` elements; this rank holds ``[lo:hi]`` of it. What
the rest of the step needs to know per element of the shard (does weight decay apply, is it part of
a tensor-parallel shard, is it counted in the global norm here, is it a sequence-parallel partial
sum) is a mask over the shard, cut from the unit's parameters' tags (grad_ownership.py).

Mixed precision, the paper's way (its memory model: 2Ψ + 2Ψ + 12Ψ for Adam): the model's
parameters and gradients are in the compute dtype (float16 / bfloat16: P = G = 2Ψ bytes), and the
optimizer holds float32 MASTER weights and moments, sharded like the rest of O (4 + 4 + 4 = K = 12
bytes per parameter). The gradients are reduced in the compute dtype (half the bytes), each rank
unscales ITS gradient shard into float32, one found-inf flag is agreed over the whole world, and the
update runs on the master shard; the shard is cast to the compute dtype and (stages 1, 2) all-gathered,
or (stage 3) kept to be gathered at its next use.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minidist.amp import to_compute
from minidist.autograd import Tensor, to_numpy
from minidist.parallel.zero.flat_buffer import FlatUnit


@dataclass
class Shard:
    """This rank's part of one unit, over ``group`` (the ranks that hold the same unit: the dp (x cp)
    group, or for a unit of experts the expert-data-parallel group).

    ``param``: the optimizer's Tensor over the shard (float32 masters under mixed precision, else a
    view of ``compute``), its ``.grad`` the averaged, unscaled gradient shard and its ``decay_mask``
    ``decay``: 1 on elements that take weight decay, else 0; ``compute``: the shard in the model's dtype (what the all-gathers send);
    ``flat``: the unit's full flat parameters (stages 0-2; the model's parameters are views of it);
    ``state``: the optimizer slots. ``grad_flat``: the full flat gradient (stages 0 and 1, ``p.grad``
    being views of it); ``grad``: the reduced gradient shard in the model's dtype, still scaled.
    Where the storage keeps them elsewhere (offload), ``stored`` lists the arrays it keeps and
    ``host_grad`` is the gradient's host buffer."""
    unit: FlatUnit
    group: object
    param: Tensor
    compute: np.ndarray
    flat: np.ndarray | None
    state: dict
    decay: np.ndarray  # 0/1 per element
    tensor_parallel: np.ndarray  # bool per element: a tensor-parallel shard's (summed over tp in the norm)
    counted: np.ndarray  # bool per element: False on a pipeline stage's tied copy (not in the norm here)
    sequence_parallel: np.ndarray  # bool per element: a partial sum over tp
    grad_flat: np.ndarray | None = None
    grad: np.ndarray | None = None
    host_grad: np.ndarray | None = None
    stored: list = field(default_factory=list)
    downloaded: object = None  # offload: the ``grad`` array already copied into ``host_grad``
    completed_later: bool = False  # summed over tp or with a tied copy after the reduction (complete.py)
    ready: int = 0  # stages 2, 3: parameters of the unit whose gradient is final in this backward
    work: object = None  # stages 2, 3: the reduce-scatter in flight

    @property
    def name(self) -> str:
        return self.unit.name


def make_shard(unit: FlatUnit, group, storage, *, sharded_params: bool, full_grads: bool, tied, slots,
               mixed_precision: str | None) -> Shard:
    """Build ``unit``'s shard: flatten its parameters (stages 0-2: the model's parameters become views
    of the flat vector; ``sharded_params``, stage 3: only the shard is kept), make its float32 master
    under mixed precision (the model then holds the rounded values), its masks, its full gradient
    buffer when ``full_grads`` (stages 0, 1), and let ``storage`` place the master and the optimizer
    ``slots``. ``tied``: a pipeline's tied embedding copies (their gradients are completed later,
    as are sequence-parallel ones). Sends nothing."""
    flat = unit.flatten([p.data for _, p in unit.params])  # (numel,) full values, the model's dtype
    if sharded_params:
        compute, flat = flat[unit.lo:unit.hi].copy(), None  # keep the shard only
    else:
        unit.bind(flat)  # parameters become views of the flat vector
        compute = flat[unit.lo:unit.hi]  # a view: writing it writes the parameters
    master = compute
    if mixed_precision:  # float32 masters of the initial values; the model gets them rounded
        master = compute.astype(np.float32)
        whole = compute if flat is None else flat
        whole[...] = to_compute(whole.astype(np.float32), mixed_precision)
    masks = [unit.decay_mask().astype(master.dtype, copy=False),  # the masters' dtype: 1 - lr * rate rounds as theirs
             unit.tensor_parallel_mask().astype(bool), unit.counted_mask().astype(bool),
             unit.sequence_parallel_mask().astype(bool)]
    grad_flat = unit.xp.zeros(unit.numel, dtype=unit.dtype) if full_grads else None  # (numel,)
    master, compute, state, stored, host_grad = storage.place(unit.name, master, compute, slots, mixed_precision)
    if stored:  # the update runs where the state lives: the masks it reads are host copies
        masks = [to_numpy(m) for m in masks[:3]] + masks[3:]
    later = bool(masks[3].any()) or any(p is q for _, p in unit.params for q in tied)
    return Shard(unit, group, Tensor(master), compute, flat, state, *masks, grad_flat=grad_flat, host_grad=host_grad,
                 stored=stored, completed_later=later)
