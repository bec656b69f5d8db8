"""Where a ZeRO shard's optimizer state lives: a storage object the shard delegates to.

A ZeroOptimizer never asks *where* its masters and moments are. It asks its storage to place a
shard's state (:meth:`place`), to bring the reduced gradient shard to where the update runs
(:meth:`to_update`), to have a unit's state ready before its update (:meth:`read`) and written after
it (:meth:`write_back`), and to publish the new parameter shard where the model reads it
(:meth:`publish`). :class:`OnDevice` is the plain case: everything stays in the model's memory and
every call is free. :class:`~minidist.parallel.zero.offload.Offload` answers the same calls with host
memory or files (ZeRO-Offload, ZeRO-Infinity), so the optimizer's code is the same with and without it.
"""
from __future__ import annotations

from minidist.device import get_array_module


class OnDevice:
    """The shards' state in the model's own memory (no offload): nothing moves, nothing is stored."""
    params = False  # the parameter shards are not stored elsewhere
    where = "device"

    def place(self, name: str, master, compute, slots, mixed_precision) -> tuple:
        """(master, compute, {slot: zeroed array like master}, stored arrays [], host gradient None)."""
        xp = get_array_module(master)
        return master, compute, {slot: xp.zeros(master.size, dtype=master.dtype) for slot in slots}, [], None

    def to_update(self, shards) -> list:
        """Each shard's reduced gradient where the update runs: ``s.grad`` itself."""
        return [s.grad for s in shards]

    def reduced(self, s) -> None:
        """Nothing to copy while backward runs."""

    def visit(self, shards):
        """The shards in order, for their update (nothing to read or write around it)."""
        yield from shards

    def write_back(self, stored) -> None:
        """Nothing to write."""

    def publish(self, value, compute) -> None:
        """Write the new parameter shard ``value`` into ``compute`` (unless it is ``compute`` itself)."""
        if value is not compute:
            compute[...] = value

    def begin_step(self) -> None:
        """Nothing counted."""

    def close(self) -> None:
        """Nothing to remove."""
