"""ZeRO's shards kept twice, so that the survivors of a lost data-parallel replica rebuild its part.

ZeRO-1 and 2 cut the optimizer state (and, under mixed precision, the float32 masters) over the dp
ranks, each part held once: a replica that dies takes its part with it. :class:`ShardCopies` keeps
each rank's part as it was at the start of the step twice: here (a peer may die in the step's last
all-gather, after this rank has updated its part) and on the next dp rank. When replicas die, every
survivor rebuilds each unit's full state from the copies and cuts it again for the new number of
ranks (:func:`recut`): the state at the start of the step, so the step is redone as if on dp - k
ranks from the start.

What it costs each step: every rank sends its parts (masters and slots: (1 + slots) x P / N
elements) to the next dp rank, and holds two such copies more.
"""
from __future__ import annotations

from minidist.amp import to_compute
from minidist.comm.ops import offsets
from minidist.parallel.zero.storage import OnDevice


def state_arrays(shard, slots) -> list:
    """What one rank holds of a unit that the others lack: its masters, then its optimizer ``slots``."""
    return [shard.param.data] + [shard.state[slot] for slot in slots]


class ShardCopies:
    """The start-of-step copies of ``zero``'s parts (a ZeroOptimizer, stage 1 or 2, its state on the
    device, every unit over its dp group): this rank's own (``own``) and the previous dp rank's
    (``previous``), as of step ``step_count``."""

    def __init__(self, zero):
        if zero.stage not in (1, 2) or not isinstance(zero.storage, OnDevice):
            raise ValueError(f"shard copies keep ZeRO-1 and 2's parts on the device, not stage {zero.stage} "
                             f"with its state in {zero.storage.where}")
        if any(s.group is not zero.group for s in zero.shards):
            raise ValueError("shard copies need every unit over the dp group (no experts' own group)")
        self.zero, self.group = zero, zero.group
        self.slots = zero.optimizer.slots
        self.own, self.previous, self.step_count, self.previous_step = [], [], -1, -1

    def save(self) -> None:
        """Copy this rank's parts, and swap copies with the dp ring: call at the start of each step.

        What it sends: each unit's masters and slots (this rank's part) to the next dp rank, while it
        receives the previous dp rank's."""
        g, zero = self.group, self.zero
        self.step_count = zero.step_count
        self.own = [[a.copy() for a in state_arrays(s, self.slots)] for s in zero.shards]
        before, after = (g.rank - 1) % g.size, (g.rank + 1) % g.size
        received = []
        for s, mine in zip(zero.shards, self.own if g.size > 1 else []):
            theirs = [s.unit.xp.empty(s.unit.counts[before], dtype=a.dtype) for a in mine]  # (their part,)
            for a, b in zip(mine, theirs):
                g.sendrecv(a, after, b, before, label=f"parameter: ZeRO part copied to the next replica {s.name}")
            received.append(theirs)
        self.previous, self.previous_step = received, self.step_count  # only once whole: a peer may die meanwhile


def recut(copies: ShardCopies, gone: set[int], survivors, new_zero) -> None:
    """Collective over ``survivors`` (the dp group of the ranks left, in the old order): put into
    ``new_zero`` (built over ``survivors`` on the same model) the state of the start of the step:
    every unit's masters and slots, and the model's parameters, whole. ``gone``: the old dp ranks
    that died; each one's part comes from the copy on the next old dp rank, which must be alive.

    What it sends: one number, whether every survivor holds what it must (a lost replica's copy of
    this step: it may have died while the copies were sent), the minimum over the survivors; then
    each unit's masters and slots, full length, summed over the survivors (every element is held by
    exactly one of them, the others add zeros): an all-reduce per array."""
    old_size, old_rank = copies.group.size, copies.group.rank
    lost = [d for d in sorted(gone) if (d + 1) % old_size in gone]
    if lost:
        raise RuntimeError(f"the ZeRO parts of dp ranks {lost} are lost: the next dp rank, which held their "
                           f"copies, died too; resume from a checkpoint")
    before = (old_rank - 1) % old_size
    holds = before not in gone or copies.previous_step == copies.step_count
    xp = copies.zero.shards[0].unit.xp
    if survivors.all_reduce(xp.array([float(holds)]), op="min", label="metric: every lost ZeRO part copied")[0] == 0:
        raise RuntimeError(f"a lost replica's ZeRO part of step {copies.step_count} was not copied whole before it "
                           f"died (it died while the copies were sent); resume from a checkpoint")
    for s_old, own, previous, s_new in zip(copies.zero.shards, copies.own, copies.previous or [None] * len(copies.own),
                                           new_zero.shards):
        counts, starts = s_old.unit.counts, offsets(s_old.unit.counts)
        wholes = []
        for i, mine in enumerate(own):
            whole = s_old.unit.xp.zeros(s_old.unit.numel, dtype=mine.dtype)  # (numel,)
            whole[starts[old_rank]:starts[old_rank] + counts[old_rank]] = mine
            if before in gone:
                whole[starts[before]:starts[before] + counts[before]] = previous[i]
            survivors.all_reduce(whole, label=f"parameter: ZeRO state rebuilt after a lost replica {s_old.name}")
            wholes.append(whole)
        lo, hi = s_new.unit.lo, s_new.unit.hi
        s_new.param.data[...] = wholes[0][lo:hi]
        for slot, whole in zip(copies.slots, wholes[1:]):
            s_new.state[slot][...] = whole[lo:hi]
        s_new.flat[...] = to_compute(wholes[0], new_zero.mixed_precision) if new_zero.mixed_precision else wholes[0]
    new_zero.step_count = copies.step_count
