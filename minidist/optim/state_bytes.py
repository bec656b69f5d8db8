"""Bytes of optimizer state per parameter, by optimizer and dtype: the one table (the ZeRO paper's K).

An optimizer keeps its state slots (``Optimizer.slots``): SGD with momentum one buffer, AdamW two
moments. In full precision they have the parameter's dtype; under mixed precision (the model
computes in float16 or bfloat16) the optimizer keeps a float32 master of every parameter and its
slots in float32 too:

    K = slots x itemsize           full precision   (float32 AdamW 8, SGD 4; float64 AdamW 16)
    K = 4 + slots x 4              mixed precision  (AdamW 12: the ZeRO paper's K; SGD 8)

The planner (minidist/plan/memory.py, timing.py) and the accounting's formulas
(minidist/inspect/accounting.py) take K from here.
"""
from __future__ import annotations

import numpy as np

from minidist.optim.adamw import AdamW
from minidist.optim.sgd import SGD

OPTIMIZERS = {"sgd": SGD, "adamw": AdamW}  # the optimizers by name, each with its ``slots``
ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}  # bytes of one element, by dtype name
MASTER_DTYPE = "float32"  # masters and slots under mixed precision


def slots(optimizer) -> tuple[str, ...]:
    """The state ``optimizer`` keeps per parameter: SGD's ``momentum_buf``, AdamW's ``exp_avg`` and
    ``exp_avg_sq``. ``optimizer``: a name of :data:`OPTIMIZERS` ("sgd", "adamw"), or an optimizer
    (class or instance) with its ``slots``."""
    if not isinstance(optimizer, str):
        return optimizer.slots
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    return OPTIMIZERS[optimizer].slots


def optimizer_problems(name) -> list[str]:
    """``["--optimizer must be one of sgd, adamw, got 'x'"]`` for a name minidist has no optimizer of,
    else nothing: the one check, asked by the trainer and the planner."""
    if name in OPTIMIZERS:
        return []
    return [f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}"]


def itemsize(dtype) -> int:
    """Bytes of one element of ``dtype``: a name of :data:`ITEMSIZE` (bfloat16 2, as on a GPU) or
    anything ``numpy.dtype`` reads."""
    return ITEMSIZE[str(dtype)] if str(dtype) in ITEMSIZE else np.dtype(dtype).itemsize


def state_bytes_per_parameter(optimizer, dtype, mixed_precision) -> dict:
    """``{"master_weights": bytes, "optimizer_states": bytes}`` that ``optimizer`` (:func:`slots`) keeps
    per parameter of ``dtype`` (the parameter's: the model's dtype); ``mixed_precision`` (truthy: a
    float16 / bfloat16 run) adds a float32 master and keeps the slots in float32 (module docstring)."""
    mixed = bool(mixed_precision)
    slot = itemsize(MASTER_DTYPE) if mixed else itemsize(dtype)
    return {"master_weights": itemsize(MASTER_DTYPE) * mixed, "optimizer_states": len(slots(optimizer)) * slot}


def optimizer_bytes_per_parameter(optimizer, dtype, mixed_precision) -> int:
    """K of the ZeRO paper: the bytes of optimizer state (float32 master included under mixed
    precision) per parameter, from :func:`state_bytes_per_parameter` (mixed-precision AdamW: 12)."""
    return sum(state_bytes_per_parameter(optimizer, dtype, mixed_precision).values())
