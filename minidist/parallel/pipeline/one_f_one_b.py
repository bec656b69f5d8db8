"""1F1B and GPipe, the classic schedules, as compute orders: which F and B each rank runs, in order.

With p ranks and m micro-batches:

    GPipe   all m forwards, then all m backwards: m micro-batches' activations held at once.
    1F1B    rank r runs p - r - 1 warm-up forwards, then one forward and one backward by turns, then
            the last backwards: the same bubble, (p-1)/(m+p-1) of the step, but at most
            min(p - r, m) micro-batches in flight on rank r (PipeDream-Flush).

lowering.py then adds the messages between the ranks.
"""
from __future__ import annotations

from minidist.parallel.pipeline.actions import Action


def gpipe(pp_size: int, micro_batches: int) -> list[list[Action]]:
    """GPipe's compute order: every rank forwards micro-batches 0..m-1, then backwards 0..m-1."""
    return [[Action("F", r, i) for i in range(micro_batches)] + [Action("B", r, i) for i in range(micro_batches)]
            for r in range(pp_size)]


def one_f_one_b(pp_size: int, micro_batches: int) -> list[list[Action]]:
    """1F1B's compute order: rank r warms up with min(p - r - 1, m) forwards, then alternates F and
    B until the forwards run out, then runs the remaining backwards."""
    schedule = []
    for r in range(pp_size):
        warmup = min(pp_size - r - 1, micro_batches)
        actions = [Action("F", r, i) for i in range(warmup)]
        for i in range(micro_batches - warmup):  # steady state: forward i + warmup, backward i
            actions += [Action("F", r, i + warmup), Action("B", r, i)]
        actions += [Action("B", r, i) for i in range(micro_batches - warmup, micro_batches)]
        schedule.append(actions)
    return schedule
