"""Rounds: which messages the executor posts together, placed so that no two ranks wait on each other.

A ROUND is the run of messages between two compute actions of a rank. The executor posts it as one
batch (p2p.py), and over NCCL a batch completes only once all of its messages have: a send waits for
its receive. With each receive right before the compute action that needs it (add_communication),
interleaved 1F1B and ZB-V deadlock so: a rank waits in a round on a peer that waits in a round whose
message this rank posts only later. :func:`receive_when_sent` moves each receive into the round in
which the dry run sends its message, so each round holds the messages of one stretch of the dry
run's time. A rank waiting in a round for a peer still in an earlier round waits on a round that
ends sooner in that time: along a chain of waits the times fall, so the waits cannot close a circle,
whatever the schedule. ``validate.check_rounds`` dry-runs every schedule so before it runs.
"""
from __future__ import annotations

from bisect import bisect_left

from minidist.parallel.pipeline.actions import RECVS, Action


def receive_when_sent(schedule: list[list[Action]], timeline) -> list[list[Action]]:
    """Move each RECV into the round in which its message is sent in ``timeline``, the dry run of
    ``schedule`` (validate.simulate): after every compute action of its rank that started earlier.
    Receives from one rank stay in the order it sends them (NCCL matches them by that order)."""
    sent = {span.action: span.end for spans in timeline.spans for span in spans}  # F / B -> when it sends
    out = []
    for r, actions in enumerate(schedule):
        starts = [span.start for span in timeline.spans[r]]  # this rank's compute actions, in order
        rounds = [[] for _ in range(len(starts) + 1)]  # rounds[k]: the receives posted before compute action k
        for when, _, a in sorted((sent[Action(a.op[-1], a.peer_stage(), a.microbatch)], i, a)
                                 for i, a in enumerate(actions) if a.op in RECVS):
            rounds[bisect_left(starts, when)].append(a)
        lowered, k = [], 0
        for a in actions:
            if a.is_compute:
                lowered, k = lowered + rounds[k], k + 1
            lowered += [] if a.op in RECVS else [a]
        out.append(lowered)
    return out
