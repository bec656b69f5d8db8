"""Which model states each ZeRO stage shards over the data-parallel replicas: the one table.

    stage 0   nothing sharded (offload without ZeRO moves each rank's whole state)
    stage 1   the optimizer states: each replica updates 1/N of the parameters
    stage 2   and the gradients: reduce-scattered in backward, only the shard kept
    stage 3   and the parameters: only the shard kept between uses

Read by the ZeRO optimizer (minidist/parallel/zero/optimizer.py), the accounting's formula
(minidist/inspect/accounting.py) and the planner's bytes and traffic (minidist/plan/memory.py, comm.py).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """What one ZeRO stage partitions over the dp ranks."""
    optimizer_states: bool  # each rank updates 1/N of the parameters (stages 1-3)
    gradients: bool  # reduce-scattered in backward, only the shard kept (stages 2, 3)
    parameters: bool  # only the shard kept between uses (stage 3)


STAGES = {0: Stage(False, False, False), 1: Stage(True, False, False), 2: Stage(True, True, False),
          3: Stage(True, True, True)}
