"""A ZeRO model's full state, for checkpoints and exports: the parameters gathered whole for a
while (or their float32 masters), and the model's values brought back from loaded master shards.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from minidist.amp import to_compute


def masters_to_model(zero) -> None:
    """After a checkpoint loaded the master shards: bring the model's values from them (stage 3's
    shards, rounded under mixed precision, up to the device under offload; stages 0-2 read their
    full parameters from the checkpoint and round them here), and write stored arrays back."""
    if zero.partitions.parameters:
        for s in zero.shards:
            zero.storage.publish(zero.compute_value(s), s.compute)
    elif zero.mixed_precision:
        for s in zero.shards:
            s.flat[...] = to_compute(s.flat.astype(np.float32), zero.mixed_precision)
    for s in zero.shards:
        zero.storage.write_back(s.stored)


@contextmanager
def full_parameters(zero, masters: bool = False):
    """Inside the block every parameter of the model holds its full value (stage 3 all-gathers
    them, collectively, and frees them after): for export, evaluation by hand, checkpoints. With
    ``masters`` under mixed precision they hold the float32 masters instead (every stage
    all-gathers the master shards, float32, and rebinds the model's own values after)."""
    if masters and zero.mixed_precision:
        for s in zero.shards:
            full = s.unit.xp.asarray(s.param.data)  # stage 0: the masters are whole (on the device)
            if zero.partitions.optimizer_states:
                full = s.unit.xp.empty(s.unit.numel, dtype=s.param.data.dtype)  # (numel,) float32
                s.group.all_gather(s.unit.xp.asarray(s.param.data), count=s.unit.numel, out=full,
                                   label=f"parameter: float32 masters of {s.name}")
            s.unit.bind(full)
    elif zero.gatherer is not None:
        zero.gatherer.ensure(zero.shards)
    try:
        yield zero.model
    finally:
        for s in zero.shards:
            if s.flat is not None:
                s.unit.bind(s.flat)
        if zero.gatherer is not None:
            zero.gatherer.free(zero.shards)
            for s in zero.shards:
                s.unit.release()
