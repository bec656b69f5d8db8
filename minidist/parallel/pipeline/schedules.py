"""Every schedule by name: its compute order, lowered (one_f_one_b.add_communication) and its
receives placed in rounds (rounds.py); one list of actions per rank.

    gpipe          all m forwards, then all m backwards: m micro-batches held; (p-1)/(m+p-1) idle
    1f1b           one_f_one_b.py: GPipe's bubble, at most p micro-batches held
    interleaved    interleaved.py, v chunks per rank: (p-1)/(v m+p-1) idle, v times the messages
    zb-h1, zbv     zero_bubble.py: backward split into B and W, W filling the bubble (Qi et al.)
"""
from __future__ import annotations

from minidist.parallel.pipeline.actions import Action, rank_stages
from minidist.parallel.pipeline.interleaved import interleaved_1f1b
from minidist.parallel.pipeline.one_f_one_b import add_communication, one_f_one_b
from minidist.parallel.pipeline.rounds import receive_when_sent
from minidist.parallel.pipeline.validate import simulate
from minidist.parallel.pipeline.zero_bubble import zb_h1, zbv

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


def build_schedule(name: str, pp_size: int, micro_batches: int, virtual_stages: int = 1,
                   forward_only: bool = False, costs=(1.0, 1.0, 1.0)) -> list[list[Action]]:
    """The full schedule (messages included) of ``name`` in :data:`SCHEDULES`, one action list per
    pipeline rank. ``virtual_stages`` > 1 with "interleaved" (any) or "zbv" (2). ``forward_only``
    keeps just the forwards, stage by stage (evaluation: no backward, nothing held). ``costs``: the
    (F, B, W) of one stage that zero-bubble schedules are placed for and the rounds timed with."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if pp_size < 1 or micro_batches < 1 or virtual_stages < 1:
        raise ValueError(f"need pp_size, micro_batches, virtual_stages >= 1, got {pp_size}, {micro_batches}, "
                         f"{virtual_stages}")
    if name != "interleaved" and virtual_stages != CHUNKS.get(name, 1):
        raise ValueError(f"the {name!r} schedule runs {CHUNKS.get(name, 1)} chunk(s) per rank "
                         f"(--virtual-stages {CHUNKS.get(name, 1)}), not {virtual_stages}")
    p, m, placement = pp_size, micro_batches, placement_of(name)
    if forward_only:
        compute = [[Action("F", s, i) for i in range(m) for s in rank_stages(r, p, virtual_stages, placement)]
                   for r in range(p)]
    else:
        compute = {"gpipe": lambda: gpipe(p, m), "1f1b": lambda: one_f_one_b(p, m),
                   "interleaved": lambda: interleaved_1f1b(p, m, virtual_stages),
                   "zb-h1": lambda: zb_h1(one_f_one_b(p, m), m, costs),
                   "zbv": lambda: zbv(p, m, tuple(c / virtual_stages for c in costs))}[name]()
    schedule = add_communication(compute, p * virtual_stages, placement)
    f, b, w = costs
    return receive_when_sent(schedule, simulate(schedule, p, f, b + w, w, placement))
