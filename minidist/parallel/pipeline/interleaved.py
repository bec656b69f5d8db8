"""Interleaved 1F1B (Megatron-LM): v chunks per rank, so the bubble shrinks by about v.

Rank r holds chunks 0..v-1, chunk c being stage c*p + r ("loop" placement, actions.py). A
micro-batch crosses the ranks v times, in smaller steps: with the same m micro-batches the step has
v times as many, v times shorter, actions, and the bubble falls from (p-1)/(m+p-1) to
(p-1)/(v m + p-1) of the step, for v times the messages.
"""
from __future__ import annotations

from minidist.parallel.pipeline.actions import Action


def interleaved_1f1b(pp_size: int, micro_batches: int, virtual_stages: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B compute order. Rank r walks m*v "virtual micro-batches" k:
    forward k runs chunk (k // p) % v on micro-batch (k // (p v)) p + k % p, so groups of p
    micro-batches go through chunk 0, then chunk 1, ...; backward k runs the chunks in reverse.
    Warm-up is 2(p - r - 1) + (v - 1) p forwards. Needs m to be a multiple of p (as Megatron does)."""
    p, v = pp_size, virtual_stages
    if micro_batches % p:
        raise ValueError(f"interleaved 1F1B needs micro-batches ({micro_batches}) to be a multiple of "
                         f"the pipeline size ({p})")
    total = micro_batches * v

    def action(op, k, r):
        chunk = (k // p) % v
        if op == "B":
            chunk = v - 1 - chunk
        return Action(op, chunk * p + r, (k // (p * v)) * p + k % p)

    schedule = []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        actions = [action("F", k, r) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [action("F", k + warmup, r), action("B", k, r)]
        actions += [action("B", k, r) for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule
