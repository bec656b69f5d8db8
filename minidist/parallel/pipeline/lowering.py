"""Lowering: a compute order becomes a full schedule, with the messages between the ranks.

Two passes. :func:`add_communication` puts a RECV right before each F / B whose input comes from a
stage on another rank, and a SEND right after each F / B whose result goes to one.
:func:`receive_when_sent` then moves each RECV into the round in which the dry run sends its message.
A ROUND is the run of messages between two compute actions of a rank; the executor posts it as one
batch, which over NCCL completes only once all of its messages have (a send waits for its receive).
Placed where their messages are sent, no two ranks' rounds can wait on each other, whatever the
schedule (validate.check_rounds checks it; interleaved 1F1B and ZB-V need it).
"""
from __future__ import annotations

from bisect import bisect_left

from minidist.parallel.pipeline.actions import RECVS, Action, stage_rank


def add_communication(compute: list[list[Action]], n_stages: int, placement: str = "loop",
                      pp_size: int | None = None) -> list[list[Action]]:
    """RECV_F before each F whose input is on another rank, SEND_F after each F whose output goes to
    one, RECV_B / SEND_B likewise around each B; nothing for W, nor between two stages of one rank
    (the tensor is handed over). ``pp_size``: the pipeline's ranks (default: one list per rank)."""
    p = pp_size or len(compute)

    def remote(a, peer):  # a message only between stages on different ranks
        return 0 <= peer < n_stages and stage_rank(peer, p, placement) != stage_rank(a.stage, p, placement)

    lowered = []
    for actions in compute:
        out = []
        for a in actions:
            if not a.is_compute:
                raise ValueError(f"add_communication takes compute actions (F, B, W), got {a}")
            if a.op == "W":  # weight gradients: nothing comes in or goes out
                out.append(a)
                continue
            source, target = (a.stage - 1, a.stage + 1) if a.op == "F" else (a.stage + 1, a.stage - 1)
            out += [Action("RECV_" + a.op, a.stage, a.microbatch)] if remote(a, source) else []
            out += [a] + ([Action("SEND_" + a.op, a.stage, a.microbatch)] if remote(a, target) else [])
        lowered.append(out)
    return lowered


def receive_when_sent(schedule: list[list[Action]], timeline) -> list[list[Action]]:
    """Move each RECV into the round in which its message is sent in ``timeline``, the dry run of
    ``schedule`` (validate.simulate): after every compute action of its rank that started earlier."""
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
