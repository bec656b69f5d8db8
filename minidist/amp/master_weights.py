"""Master weights: the model runs in a 16-bit dtype, the optimizer updates float32 copies.

Why: an update ``lr * g`` is often smaller than half the spacing of float16 numbers near the weight
(float16 has 10 mantissa bits: around 1.0 the spacing is 0.001), so ``w16 - lr * g`` would round back
to ``w16`` and training would stall. The float32 master accumulates the small updates; the model
gets a rounded copy after each step. AdamW's moments live in float32 too (they are the optimizer's).

One step, after backward (with the loss scaled by :class:`DynamicLossScaler`) and data parallelism's
all-reduce (of float16 gradients: half the bytes of float32), as the gradient pipeline runs it
(minidist/parallel/compose/gradients.py; this class holds the masters, :func:`unscale` and
:func:`to_compute` are the rules):

    1. found_inf: any inf/NaN in the model's gradients, on ANY rank (one all-reduce "max").
       If so: skip everything below, halve the scale. No weight, no optimizer state changes.
    2. unscale:   master.grad = float32(p.grad) / scale       (exact: scale is a power of two)
    3. clip:      global-norm clipping on the unscaled float32 gradients
    4. update:    optimizer.step() on the float32 masters and float32 state
    5. cast back: p.data[...] = float16(master)               (in place: DP buckets, views stay valid)

    dtype      model weights stored as        gradients on the wire   loss scale
    float16    float16                        float16 (half)          dynamic, from 2**16
    bfloat16   float32 holding bfloat16 values float32 (emulation)     none needed (1, static)

bfloat16 is emulated (bfloat16.py): weights are rounded to bfloat16 when cast back, gradients when
read into the masters; activations and arithmetic stay float32.
"""
from __future__ import annotations

import numpy as np

from minidist.amp.bfloat16 import round_to_bfloat16
from minidist.device import get_array_module
from minidist.nn.parameter import Parameter

COMPUTE_DTYPES = {"float16": np.float16, "bfloat16": np.float32}  # name -> storage dtype of the model
SHARDING_TAGS = ("tensor_parallel", "sequence_parallel", "tied_copy", "expert")  # who owns which gradient element


class MixedPrecision:
    """float32 master copies of ``model``'s parameters (the step that uses them: gradients.py).

    ``dtype`` is the compute dtype: "float16" (the model's parameters must be float16) or
    "bfloat16" (float32 parameters, rounded to bfloat16 values here). ``scaler`` is a
    :class:`DynamicLossScaler` (its group: every rank that holds gradients, i.e. the world).
    Build the optimizer over :meth:`master_parameters`, never over the model's.
    """

    def __init__(self, model, dtype: str, scaler):
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute dtype must be one of {sorted(COMPUTE_DTYPES)}, got {dtype!r}")
        self.dtype, self.scaler = dtype, scaler
        self.pairs = list(model.named_parameters())  # (name, model parameter), tied weights once
        storage = np.dtype(COMPUTE_DTYPES[dtype])
        wrong = [name for name, p in self.pairs if p.data.dtype != storage]
        if wrong:
            raise ValueError(f"compute dtype {dtype} keeps the model's parameters as {storage}; "
                             f"these are not: {wrong[:3]}{' ...' if len(wrong) > 3 else ''}")
        self.masters = []
        for _, p in self.pairs:
            master = Parameter(p.data.astype(np.float32))  # a copy
            for tag in SHARDING_TAGS:  # who owns which gradient element: as the model's parameter
                setattr(master, tag, getattr(p, tag))
            self.masters.append(master)
        self.cast_to_model()  # bfloat16: the model starts from bfloat16 values

    def master_parameters(self) -> list:
        """(name, float32 master Parameter) pairs, named like the model's: give these to SGD / AdamW."""
        return [(name, m) for (name, _), m in zip(self.pairs, self.masters)]

    def backward(self, loss, weight: float = 1.0) -> None:
        """Backward of ``weight * scale * loss`` (``weight``: 1/micro_batches under accumulation).
        The loss must be float32 (cross-entropy returns float32 for float16 logits): 2**16 is not a
        float16 number."""
        loss.backward(get_array_module(loss.data).full_like(loss.data, weight * self.scaler.scale))

    def cast_to_model(self) -> None:
        """Write the masters into the model's parameters, in place, rounded to the compute dtype
        (:func:`to_compute`). Also after a checkpoint has loaded the masters."""
        for (_, p), master in zip(self.pairs, self.masters):
            p.data[...] = to_compute(master.data, self.dtype)


def unscale(grad, scale: float, dtype: str) -> np.ndarray:
    """float32(grad) / scale, a new array; bfloat16 rounds the gradient first (the one rule, for
    the full masters here and ZeRO's sharded ones)."""
    g = grad.astype(np.float32)
    if dtype == "bfloat16":
        g = round_to_bfloat16(g)
    g *= 1.0 / scale
    return g


def to_compute(master, dtype: str) -> np.ndarray:
    """float32 ``master`` values in the compute dtype ``dtype``: float16 by NumPy's round-to-nearest-
    even cast, bfloat16 by :func:`round_to_bfloat16` (kept in float32 storage). A new array."""
    return round_to_bfloat16(master) if dtype == "bfloat16" else master.astype(np.float16)
