"""Zero-bubble schedules (Qi et al. 2023): backward split into B and W, and W used to fill the bubble.

With backward split (autograd/engine.py), a stage's backward of one micro-batch is two actions:

    B   the gradient of the stage's input: the previous stage waits for it (critical path)
    W   the gradients of the stage's weights: nobody waits for it, so it can run whenever the
        rank would otherwise sit idle, as long as it comes after its B (and before the step ends)

Both zero-bubble schedules (schedules.py) are made by one list scheduler, the paper's heuristic, run
on the costs F, B and W of one chunk: each rank, whenever it is free, runs

    1. a B whose gradient has arrived (the critical path first),
    2. else an F whose input has arrived, if that keeps its activations within the memory limit,
    3. else a pending W, if it ends before any of its F or B could start (it fills what would be a
       bubble without delaying the critical path; at the memory limit no F counts),
    4. else it waits for the next message.

    zb-h1   one stage per rank, 1F1B's order of F and B (only the W are placed), at most 1F1B's p
            micro-batches in flight on a rank (ZB-H1): the bubble falls from 1F1B's
            (p-1)(T_F+T_B+T_W) to (p-1)(T_F+T_B-T_W) when the three costs are equal.
    zbv     two chunks per rank placed in a V (rank r holds stages r and 2p-1-r, so rank 0 holds the
            first and the last: embeddings and head together), at most 2p chunk-micro-batches in
            flight, 1F1B's activation memory (ZB-V). Rank p-1 cannot start before (p-1) T_F, so
            the step is at least that plus 2m(T_F+T_B+T_W) in chunk costs; with equal costs this
            heuristic reaches the bound at p = 2 and 4 and idles one chunk unit more at p = 3
            (tests/test_pipeline_schedules.py).

A micro-batch's activations are held from its F until its W (W still needs the layer inputs).
The result is a compute order, lowered and checked like every schedule (schedules.py, validate.py).
The executor runs B and W with the extension split_backward.py.
"""
from __future__ import annotations

from minidist.parallel.pipeline.actions import Action, rank_stages, stage_rank


def zb_h1(one_f_one_b: list[list[Action]], micro_batches: int, costs=(1.0, 1.0, 1.0)) -> list[list[Action]]:
    """ZB-H1's compute order: ``one_f_one_b``'s forwards and backwards (1F1B's order; B now only
    the input gradient), each W placed by the list scheduler where the rank would idle, at most p
    micro-batches in flight."""
    p = len(one_f_one_b)
    return list_schedule(p, micro_batches, 1, "loop", limit=p, costs=costs, fixed=one_f_one_b)


def zbv(pp_size: int, micro_batches: int, costs=(0.5, 0.5, 0.5)) -> list[list[Action]]:
    """ZB-V's compute order: two chunks per rank in a V, F, B and W all placed by the list
    scheduler, at most 2p chunk-micro-batches in flight (the activations of p whole stages: 1F1B's
    peak). ``costs``: (F, B, W) of one chunk."""
    return list_schedule(pp_size, micro_batches, 2, "v", limit=2 * pp_size, costs=costs)


def list_schedule(pp_size: int, micro_batches: int, virtual_stages: int, placement: str, limit: int,
                  costs=(1.0, 1.0, 1.0), fixed=None) -> list[list[Action]]:
    """The compute order (F, B, W actions per rank) that the heuristic above produces with ``limit``
    (chunk, micro-batch) pairs in flight per rank and ``costs`` = (F, B, W) of one chunk; ``fixed``
    (per rank, its F and B in order) leaves the scheduler only the W to place."""
    p, m = pp_size, micro_batches
    n_stages = p * virtual_stages
    owned = [rank_stages(r, p, virtual_stages, placement) for r in range(p)]
    cost = dict(zip("FBW", costs))
    finished = {}  # (op, stage, micro-batch) -> the time it ends
    next_mb = {(op, s): 0 for op in "FBW" for s in range(n_stages)}  # each stage runs each op in order
    clock, held = [0.0] * p, [0] * p
    order = [[] for _ in range(p)]
    left = [3 * m * len(owned[r]) for r in range(p)]

    def needs(op, s, i):
        """The action whose result (op, s, i) waits for, or None (stage 0's forwards)."""
        if op == "F":
            return ("F", s - 1, i) if s > 0 else None
        if op == "B":
            return ("F", s, i) if s == n_stages - 1 else ("B", s + 1, i)
        return ("B", s, i)

    def arrival(op, s, i):
        """When (op, s, i) may start as far as its inputs go; None while its input is not scheduled."""
        before = needs(op, s, i)
        return 0.0 if before is None else finished.get(before)

    def soonest(op, s, i):
        """The earliest (op, s, i) can start: its arrival, or while unknown, when the rank that makes
        its input could finish that at the soonest."""
        known = arrival(op, s, i)
        if known is not None:
            return known
        before = needs(op, s, i)
        return clock[stage_rank(before[1], p, placement)] + cost[before[0]]

    def candidates(r, op):
        """(arrival, stage, micro-batch) of the next ``op`` of each stage rank ``r`` holds."""
        out = []
        for s in owned[r]:
            i = next_mb[(op, s)]
            if i < m and (op != "W" or i < next_mb[("B", s)]):
                out.append((arrival(op, s, i), s, i))
        return out

    def step(r) -> bool:
        """Let rank ``r`` run its next action, or wait until its next input can arrive; False if it
        waits on an action nobody has scheduled yet."""
        now = clock[r]
        # the limit holds back new micro-batches (F of the rank's first chunk); a deeper chunk's F
        # always may run: it leads to the B and W that free memory
        b, w = candidates(r, "B"), candidates(r, "W")
        f = [c for c in candidates(r, "F") if held[r] < limit - (c[1] == owned[r][0] and len(owned[r]) > 1)]
        if fixed is not None:  # the F / B order is given: only its next action may run
            done = sum(a.op != "W" for a in order[r])
            nxt = fixed[r][done] if done < len(fixed[r]) else None
            b = [c for c in b if nxt is not None and nxt.op == "B" and (c[1], c[2]) == (nxt.stage, nxt.microbatch)]
            f = [c for c in f if nxt is not None and nxt.op == "F" and (c[1], c[2]) == (nxt.stage, nxt.microbatch)]
        ready_b = [c for c in b if c[0] is not None and c[0] <= now]
        ready_f = [c for c in f if c[0] is not None and c[0] <= now]
        if ready_b:  # the critical path: the earliest gradient, the deepest stage on a tie
            op, (_, s, i) = "B", min(ready_b, key=lambda c: (c[0], -c[1]))
        elif ready_f:  # the deepest stage first: a micro-batch reaches the loss, and frees memory, sooner
            op, (_, s, i) = "F", min(ready_f, key=lambda c: (c[0], -c[1]))
        elif w and all(now + cost["W"] <= soonest("B" if c in b else "F", c[1], c[2]) for c in b + f):
            # a bubble: the oldest pending W, as it ends before any F or B could start
            op, (_, s, i) = "W", min(w, key=lambda c: c[2])
        else:  # idle until an input arrives or another rank moves on, whichever is first
            later = [c[0] for c in b + f if c[0] is not None and c[0] > now]
            if not later:
                return False
            clock[r] = min(later + [clock[q] for q in range(p) if left[q] and clock[q] > now])
            return True
        commit(r, op, s, i)
        return True

    def commit(r, op, s, i) -> None:
        """Rank ``r`` runs (op, s, i) from its clock on."""
        order[r].append(Action(op, s, i))
        clock[r] += cost[op]
        finished[(op, s, i)] = clock[r]
        next_mb[(op, s)] += 1
        held[r] += {"F": 1, "B": 0, "W": -1}[op]
        left[r] -= 1

    while any(left):
        active = sorted((r for r in range(p) if left[r]), key=lambda r: (clock[r], r))
        if not any(step(r) for r in active):  # every rank waits on another: move the earliest on
            earliest = clock[active[0]]
            higher = [clock[q] for q in active if clock[q] > earliest]
            if not higher:  # every rank waits for memory (W costlier than B keeps it held): a pending W frees some
                pending = [r for r in active if candidates(r, "W")]
                if not pending:
                    raise RuntimeError(f"the zero-bubble list scheduler is stuck at time {earliest} "
                                       f"(a limit of {limit} in flight is too small)")
                r = pending[0]
                _, s, i = min(candidates(r, "W"), key=lambda c: c[2])
                commit(r, "W", s, i)
                continue
            for r in active:
                clock[r] = max(clock[r], min(higher))
    return order
