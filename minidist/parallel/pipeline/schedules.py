"""Pipeline schedules as data: for every rank, the ordered list of actions of one training step.

A schedule is written in two passes, as torch.distributed.pipelining does:

1. the compute order: which forward (F) and backward (B) each rank runs, micro-batch by micro-batch;
2. :func:`add_communication` lowers it: a RECV before every F / B that needs a neighbour's tensor, a
   SEND after every F / B whose result a neighbour needs.

The classics (p ranks, m micro-batches, v chunks per rank):

    GPipe              all m forwards, then all m backwards. Simple; holds m activations at once.
    1F1B               rank r runs p - r - 1 warm-up forwards, then alternates one forward and one
                       backward, then drains the backwards. Same bubble as GPipe, (p-1)/(m+p-1) of
                       the step, but at most min(p - r, m) micro-batches in flight on rank r.
    interleaved 1F1B   each rank holds v chunks (stages r, r+p, r+2p, ...); micro-batches cross the
                       ranks v times, in smaller steps, so the bubble shrinks by about v (Megatron-LM).

and the zero-bubble ones (zero_bubble.py), whose backward is split into B (input gradient) and W
(weight gradients), W filling the bubble:

    zb-h1              1F1B's memory, the bubble cut to about a third (Qi et al.'s ZB-H1).
    zbv                two chunks per rank placed in a V, 1F1B's memory, about no bubble (ZB-V).
"""
from __future__ import annotations

from minidist.parallel.pipeline.actions import Action, rank_stages, stage_rank
from minidist.parallel.pipeline.zero_bubble import list_schedule

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
CHUNKS = {"zbv": 2}  # the virtual stages a schedule is made for; the others take 1 (interleaved: any)


def placement_of(name: str) -> str:
    """Where schedule ``name`` puts the chunks (actions.py): "v" for zbv, else "loop"."""
    return "v" if name == "zbv" else "loop"


def splits_backward(name: str) -> bool:
    """Whether schedule ``name`` runs each backward as B then W (the zero-bubble schedules)."""
    return name in ("zb-h1", "zbv")


def gpipe(pp_size: int, micro_batches: int) -> list[list[Action]]:
    """GPipe's compute order: every rank forwards micro-batches 0..m-1, then backwards 0..m-1."""
    return [[Action("F", r, i) for i in range(micro_batches)] + [Action("B", r, i) for i in range(micro_batches)]
            for r in range(pp_size)]


def one_f_one_b(pp_size: int, micro_batches: int) -> list[list[Action]]:
    """1F1B's compute order (PipeDream-Flush): rank r warms up with min(p - r - 1, m) forwards, then
    alternates F and B until the forwards run out, then runs the remaining backwards."""
    schedule = []
    for r in range(pp_size):
        warmup = min(pp_size - r - 1, micro_batches)
        actions = [Action("F", r, i) for i in range(warmup)]
        for i in range(micro_batches - warmup):  # steady state: forward i + warmup, backward i
            actions += [Action("F", r, i + warmup), Action("B", r, i)]
        actions += [Action("B", r, i) for i in range(micro_batches - warmup, micro_batches)]
        schedule.append(actions)
    return schedule


def interleaved_1f1b(pp_size: int, micro_batches: int, virtual_stages: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B compute order. Rank r holds chunks 0..v-1, chunk c being stage
    c*p + r. It walks m*v "virtual micro-batches" k: forward k runs chunk (k // p) % v on micro-batch
    (k // (p v)) p + k % p, so groups of p micro-batches go through chunk 0, then chunk 1, ...;
    backward k runs the chunks in reverse. Warm-up is 2(p - r - 1) + (v - 1) p forwards.
    Needs m to be a multiple of p (as Megatron does)."""
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


def zb_h1(pp_size: int, micro_batches: int, costs=(1.0, 1.0, 1.0)) -> list[list[Action]]:
    """ZB-H1's compute order: 1F1B's forwards and backwards (B now only the input gradient), each W
    placed by the list scheduler where the rank would idle, at most p micro-batches in flight."""
    return list_schedule(pp_size, micro_batches, 1, "loop", limit=pp_size, costs=costs,
                         fixed=one_f_one_b(pp_size, micro_batches))


def zbv(pp_size: int, micro_batches: int, costs=(0.5, 0.5, 0.5)) -> list[list[Action]]:
    """ZB-V's compute order: two chunks per rank in a V, F, B and W all placed by the list
    scheduler, at most 2p chunk-micro-batches in flight (the activations of p whole stages: 1F1B's
    peak). ``costs``: (F, B, W) of one chunk."""
    return list_schedule(pp_size, micro_batches, 2, "v", limit=2 * pp_size, costs=costs)


def add_communication(compute: list[list[Action]], n_stages: int, placement: str = "loop",
                      pp_size: int | None = None) -> list[list[Action]]:
    """Lower a compute order into a full schedule: RECV_F before each F that is not on stage 0,
    SEND_F after each F not on the last stage; RECV_B before each B not on the last stage, SEND_B
    after each B not on stage 0; nothing between two stages on the same rank (the tensor is handed
    over) and nothing for W. Sends are non-blocking, receives wait, so the order of receives decides
    whether the schedule can deadlock (:func:`~minidist.parallel.pipeline.validate.validate` finds
    out before anything runs). ``pp_size``: the pipeline's ranks (default: one list per rank)."""
    p = pp_size or len(compute)

    def remote(a, peer):  # a message only between stages on different ranks
        return 0 <= peer < n_stages and stage_rank(peer, p, placement) != stage_rank(a.stage, p, placement)

    lowered = []
    for actions in compute:
        out = []
        for a in actions:
            if a.op == "F":
                out += ([Action("RECV_F", a.stage, a.microbatch)] if remote(a, a.stage - 1) else []) + [a]
                out += [Action("SEND_F", a.stage, a.microbatch)] if remote(a, a.stage + 1) else []
            elif a.op == "B":
                out += ([Action("RECV_B", a.stage, a.microbatch)] if remote(a, a.stage + 1) else []) + [a]
                out += [Action("SEND_B", a.stage, a.microbatch)] if remote(a, a.stage - 1) else []
            elif a.op == "W":
                out.append(a)
            else:
                raise ValueError(f"add_communication takes compute actions (F, B, W), got {a.describe()}")
        lowered.append(out)
    return lowered


def build_schedule(name: str, pp_size: int, micro_batches: int, virtual_stages: int = 1,
                   forward_only: bool = False, costs=(1.0, 1.0, 1.0)) -> list[list[Action]]:
    """The full schedule (communication included) of ``name`` in :data:`SCHEDULES`, one action list
    per pipeline rank. ``virtual_stages`` > 1 with "interleaved" (any) or "zbv" (2). ``forward_only``
    keeps just the forwards in GPipe order (evaluation: no backward, nothing held). ``costs``: the
    (F, B, W) of one stage that the zero-bubble schedules are placed for (a chunk costs 1/v of them)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if pp_size < 1 or micro_batches < 1 or virtual_stages < 1:
        raise ValueError(f"need pp_size, micro_batches, virtual_stages >= 1, got {pp_size}, {micro_batches}, "
                         f"{virtual_stages}")
    if name != "interleaved" and virtual_stages != CHUNKS.get(name, 1):
        raise ValueError(f"the {name!r} schedule runs {CHUNKS.get(name, 1)} chunk(s) per rank "
                         f"(--virtual-stages {CHUNKS.get(name, 1)}), not {virtual_stages}")
    placement = placement_of(name)
    if forward_only:
        compute = [[Action("F", s, i) for i in range(micro_batches) for s in rank_stages(r, pp_size, virtual_stages, placement)]
                   for r in range(pp_size)]
    elif name == "gpipe":
        compute = gpipe(pp_size, micro_batches)
    elif name == "1f1b":
        compute = one_f_one_b(pp_size, micro_batches)
    elif name == "zb-h1":
        compute = zb_h1(pp_size, micro_batches, costs)
    elif name == "zbv":
        compute = zbv(pp_size, micro_batches, tuple(c / virtual_stages for c in costs))
    else:
        compute = interleaved_1f1b(pp_size, micro_batches, virtual_stages)
    return add_communication(compute, pp_size * virtual_stages, placement)

