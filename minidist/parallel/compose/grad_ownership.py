"""Who owns which gradient element: the one rule, read by gradient-norm clipping (clip.py), ZeRO's
flat shards (flat_buffer.py's masks), the sequence-parallel sync and the checkpoint writer.

It follows from the three tags declared on :class:`~minidist.nn.Parameter`:

    tag                 gradient on this rank                     in the global norm, squares added by
    tensor_parallel     this rank's shard alone                   every tp rank          ("sharded")
    (none)              the same on every tp rank                 tp rank 0 only         ("replicated")
    sequence_parallel   a partial sum over this rank's tokens:    like "replicated", once summed
                        all-reduce it over tp first
    tied_copy           a copy of another stage's parameter,      nobody: the stage holding the
                        summed over the embedding group           original counts it

    expert              this ep rank's experts (distinct on       every ep rank (its own experts),
                        each ep rank), complete over the ep       and by tp as above
                        group: reduced over the ranks holding
                        the same experts only

Data-parallel replicas hold the same (averaged) gradients: nothing is added over dp. Pipeline stages
hold different parameters: their sums add up. Which ranks hold the same values of a parameter, and
so average its gradient, shard it under ZeRO and write it once to a checkpoint, is
:func:`replica_group`: one rule for the data-parallel sync, ZeRO, clipping and checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass


def norm_bucket(p) -> str | None:
    """Which sum of squares parameter ``p``'s gradient goes to: "sharded" (distinct on each tp rank:
    summed over tp), "replicated" (the same on every tp rank: counted once), or None (a tied copy:
    not counted here at all)."""
    if p.tied_copy:
        return None
    return "sharded" if p.tensor_parallel else "replicated"


def counted_in_norm(p, tp_rank: int) -> bool:
    """Whether this rank (tensor-parallel rank ``tp_rank``) adds the squares of ``p``'s gradient
    when the global gradient norm is summed once per element over tp and pp: tensor-parallel shards
    on every tp rank, replicated parameters on tp rank 0 only, tied copies never."""
    bucket = norm_bucket(p)
    return bucket == "sharded" or (bucket == "replicated" and tp_rank == 0)


def summed_over_tp(p) -> bool:
    """Whether ``p``'s gradient is a partial sum to all-reduce over the tensor-parallel group before
    it is used (sequence parallelism: replicated, but it saw only this rank's tokens)."""
    return p.sequence_parallel


def replica_group(p, dp_group, expert_group=None):
    """The ranks holding the same values of ``p``: the group its gradient is reduced over (dividing
    by the dp replicas, data_parallel.py), ZeRO shards it over, and whose rank 0 writes it to a
    checkpoint. An expert parameter: ``expert_group``, the expert-data-parallel group (its gradient
    already sums every ep rank's tokens; a mesh's ``expert_dp_group``); any other, or without
    ``expert_group``: ``dp_group`` (a mesh's ``dp_cp_group``)."""
    return expert_group if p.expert and expert_group is not None else dp_group


@dataclass(frozen=True)
class ReplicaGroups:
    """Who holds the same values, for a data-parallel reduction (DataParallel) or ZeRO: ``group`` (a
    mesh's ``dp_cp_group``, or any dp group), of whose ranks ``replicas`` are data replicas (None:
    every rank; under context parallelism the cp ranks hold parts of one replica's gradient), and
    ``experts`` (a mesh's ``expert_dp_group``, or None) for the expert parameters."""
    group: object
    replicas: int | None = None
    experts: object = None

    def of(self, p):
        """The group ``p``'s gradient is reduced (and under ZeRO sharded) over: :func:`replica_group`."""
        return replica_group(p, self.group, self.experts)

    def reduce_op(self, flat, group) -> str:
        """The op to reduce ``flat`` over ``group`` with: :func:`average_over_replicas`."""
        return average_over_replicas(flat, group, self.replicas)


def average_over_replicas(flat, group, replicas: int | None) -> str:
    """The rule for a gradient reduction over ``group`` whose ranks hold ``replicas`` data replicas
    (None: every rank is one): returns the reduce op to send ``flat`` with. Every rank a replica:
    "avg". Otherwise the other ranks hold parts of one replica's gradient (context parallelism: the
    cp ranks' tokens), which add up: ``flat`` is divided by ``replicas`` in place (before the sum,
    as a float16 average is) and summed, "sum"."""
    if replicas is None or replicas == group.size:
        return "avg"
    if replicas != 1:
        flat *= 1.0 / replicas
    return "sum"


def summed_over_ep(p) -> bool:
    """Whether the squares of ``p``'s gradient are added over the ep group in the global norm (each
    ep rank holds different experts)."""
    return p.expert
