"""1F1B as data: each rank's compute order, then the messages between the ranks.

With p ranks and m micro-batches, rank r runs min(p - r - 1, m) warm-up forwards, then one forward
and one backward by turns, then the last backwards (PipeDream-Flush): GPipe's bubble, (p-1)/(m+p-1)
of the step, but at most min(p - r, m) micro-batches' activations held on rank r, not m. Then
:func:`add_communication` adds the messages (rounds.py moves each RECV to where its message is sent).
"""
from __future__ import annotations

from minidist.parallel.pipeline.actions import Action, stage_rank


def one_f_one_b(pp_size: int, micro_batches: int) -> list[list[Action]]:
    """1F1B's compute order: per rank, F and B actions in the order the rank runs them."""
    schedule = []
    for r in range(pp_size):
        warmup = min(pp_size - r - 1, micro_batches)
        actions = [Action("F", r, i) for i in range(warmup)]
        for i in range(micro_batches - warmup):  # steady state: forward i + warmup, backward i
            actions += [Action("F", r, i + warmup), Action("B", r, i)]
        actions += [Action("B", r, i) for i in range(micro_batches - warmup, micro_batches)]
        schedule.append(actions)
    return schedule


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
