"""ZeRO's state handed to new data-parallel replicas: what joins a running job starts where it is.

Under ZeRO-1 and 2 no replica holds the whole optimizer state: dp rank r holds part r of every unit's
masters and slots (``numpy.array_split`` over the dp ranks). When k replicas join, the dp group grows
from N to N + k ranks (the old ones first, in their order). :func:`hand_over` rebuilds every unit's
whole state on every rank of the grown group, each old rank broadcasting its part, then each rank
keeps its new part (the unit cut over N + k): the joiners receive the weights and the optimizer
state, and the old ranks re-cut theirs.

    parts = [state_arrays(s, slots) for s in zero.shards]   # an old rank's, before the join (None: a joiner's)
    new_zero = make_zero(grown_mesh)                        # ZeRO over the grown dp group, same model
    received = hand_over(parts, zero.step_count, N, grown_mesh.dp_group, new_zero)

What it costs: every rank receives the whole state once ((1 + slots) x P elements), minus its own part.
"""
from __future__ import annotations

from minidist.amp import to_compute
from minidist.comm.ops import offsets, split_counts


def hand_over(parts, step_count: int, old_size: int, group, new_zero) -> int:
    """Collective over ``group`` (the grown dp group: the ``old_size`` old dp ranks first, then the new
    ones): put into ``new_zero`` (ZeRO-1 or 2 over ``group``, on the same model) the state the old ranks
    hold. ``parts``: an old rank's own part of each unit's masters and slots (``state_arrays``, unit by
    unit), None on a new rank; ``step_count``: the old optimizer's updates so far (dp rank 0's is
    used). Sets the model's parameters, the masters, the slots and the optimizer's step count.
    Returns the bytes this rank received.

    What it sends: the step count (one int64) from dp rank 0; then, unit by unit and array by array,
    each old rank's part, broadcast from it to the grown group."""
    xp = new_zero.shards[0].unit.xp
    count = xp.array([step_count], dtype=xp.int64)  # (1,)
    group.broadcast(count, src=0, label="setup: the optimizer's step count, to the joining replicas")
    new_zero.step_count = int(count[0])
    received = 0
    for i, shard in enumerate(new_zero.shards):
        unit = shard.unit
        counts = split_counts(unit.numel, old_size)
        starts = offsets(counts)
        wholes = []
        for j, array in enumerate([shard.param.data] + [shard.state[slot] for slot in new_zero.optimizer.slots]):
            whole = xp.zeros(unit.numel, dtype=array.dtype)  # (numel,)
            for r in range(old_size):
                part = whole[starts[r]:starts[r] + counts[r]]  # (counts[r],) a view: the broadcast fills it
                if group.rank == r:
                    part[...] = parts[i][j]
                else:
                    received += part.nbytes
                group.broadcast(part, src=r, label=f"parameter: ZeRO part handed to the joining replicas {shard.name}")
            wholes.append(whole)
        shard.param.data[...] = wholes[0][unit.lo:unit.hi]
        for slot, whole in zip(new_zero.optimizer.slots, wholes[1:]):
            shard.state[slot][...] = whole[unit.lo:unit.hi]
        shard.flat[...] = to_compute(wholes[0], new_zero.mixed_precision) if new_zero.mixed_precision else wholes[0]
    return received
