"""What a ZeRO optimizer holds, measured from its live arrays, beside the ZeRO paper's formula.

Reads a :class:`~minidist.parallel.zero.optimizer.ZeroOptimizer` (its shards and storage); sends
nothing. The formulas themselves are accounting.py's (:func:`zero_formula`, :func:`offload_formula`).
"""
from __future__ import annotations

from minidist.inspect.accounting import offload_formula, unique_nbytes, zero_formula
from minidist.optim import state_bytes


def optimizer_bytes_per_parameter(zero) -> int:
    """K of the ZeRO paper for ``zero``'s optimizer, parameter dtype and precision, from the one table
    (``minidist.optim.optimizer_bytes_per_parameter``; mixed-precision AdamW: 12)."""
    dtype = zero.shards[0].unit.dtype if zero.shards else "float32"
    return state_bytes.optimizer_bytes_per_parameter(zero.optimizer, dtype, zero.mixed_precision)


def model_state_bytes(zero) -> dict:
    """Bytes this rank holds now in parameters and gradients (the model's dtype) and optimizer state
    (moments, and the float32 masters under mixed precision), measured from the live arrays (a buffer
    counted once however many views share it). Call it after backward and the reduction, when the
    model states are at their largest. Those three are device memory; under offload ``host`` and
    ``disk`` hold what lives there (offload.py)."""
    shards = zero.shards
    params = [p for s in shards for _, p in s.unit.params]
    stored = {id(a) for s in shards for a in s.stored}
    on_device = lambda arrays: [a for a in arrays if a is not None and id(a) not in stored]  # noqa: E731
    masters = [s.param.data for s in shards] if zero.mixed_precision else []
    grads = [p.grad for p in params] + [s.grad for s in shards]
    if not zero.mixed_precision and zero.offload is None:
        grads += [s.param.grad for s in shards]
    held = {
        "parameters": unique_nbytes(on_device([p.data for p in params] + [s.compute for s in shards])),
        "gradients": unique_nbytes(grads),
        "optimizer": unique_nbytes(on_device(masters + [a for s in shards for a in s.state.values()])),
    }
    if zero.offload is not None:
        offloaded = unique_nbytes([a for s in shards for a in s.stored])
        host_grads = unique_nbytes([s.host_grad for s in shards])
        held["host"] = host_grads + offloaded * (zero.offload.where == "host")
        held["disk"] = offloaded * (zero.offload.where == "disk")
    return held


def formula(zero) -> dict:
    """The ZeRO paper's bytes per rank for ``zero``'s stage: P = G = numel x the model's itemsize,
    O = K x numel (:func:`optimizer_bytes_per_parameter`). Stage 1 P + G + O/N, 2 P + (G + O)/N,
    3 (P + G + O)/N. Under offload O/N leaves the device for the store (the host or the disk), with
    the parameter shard P/N (ZeRO-3 parameters offloaded, or without mixed precision the master
    copy), and the host holds the gradient shard (numel/N x itemsize) too."""
    itemsize = zero.shards[0].unit.dtype.itemsize if zero.shards else 0
    k = optimizer_bytes_per_parameter(zero)
    total = {}
    for group in {id(s.group): s.group for s in zero.shards}.values():  # experts: over their own group
        numel = sum(s.unit.numel for s in zero.shards if s.group is group)
        part = zero_formula(zero.stage, numel * itemsize, numel * k, group.size)
        if zero.offload is not None:
            part = offload_formula(part, numel * itemsize / (group.size if zero.stage else 1), zero.offload.where,
                                   zero.offload.params, master_copy=not zero.mixed_precision)
        total = {key: total.get(key, 0) + value for key, value in part.items()}
    return total


def activation_bytes(zero, loss) -> int:
    """Bytes the still-unused graph behind ``loss`` keeps for backward (``zero``'s weights not counted)."""
    from minidist.inspect.accounting import activation_bytes as kept
    return kept(loss, exclude=[p.data for s in zero.shards for _, p in s.unit.params])
