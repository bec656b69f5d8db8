"""Check a schedule before it runs: static rules, then a dry run of all ranks together.

A pipeline bug at run time is a hang with no message. Here the whole schedule (every rank's list)
is checked first, and the first broken rule raises :class:`ScheduleError` naming the rank, the
position and the action:

- every action runs on the rank that holds its stage, for an existing stage and micro-batch;
- every stage runs each micro-batch's F exactly once and (when training) its B exactly once, F first,
  and in a zero-bubble schedule its W exactly once, after the B;
- an F / B runs only after the RECV of its input / output gradient (or, when the neighbouring stage is
  on the same rank, after that stage's F / B: the tensor is handed over, not sent), a SEND only after
  the F / B that produced its tensor;
- every SEND has its RECV on the peer rank and vice versa, and on each edge (stage s -> stage s+1
  for activations, s -> s-1 for gradients) the receiver takes the micro-batches in the order they were
  sent (messages of one tag never overtake each other);
- no deadlock: :func:`simulate` runs all ranks' lists together (sends never block, a RECV waits for
  its SEND) and reports the ranks stuck, each at the action it waits on;
- none either under NCCL's rules (:func:`check_rounds`): the executor posts each round (the messages
  between two compute actions) as one batch that waits for all of its messages, and messages
  between two ranks match in posting order, whatever their tags.

The dry run also yields the ideal timeline: when each F, B and W would start and end if an F took
``forward_cost`` and a whole backward ``backward_cost`` time units (split, a W ``weight_cost`` and B
the rest) and messages were free.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property

from minidist.parallel.pipeline.actions import RECVS, SENDS, Action, stage_rank


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message names the rank, the position and the action."""


_WORDS = {"F": "forward", "B": "backward", "W": "weight gradients", "SEND_F": "send activation",
          "RECV_F": "receive activation", "SEND_B": "send gradient", "RECV_B": "receive gradient"}


def describe(a: Action) -> str:
    """An action in words: ``1B2 (backward of micro-batch 2 on stage 1)``."""
    return f"{a} ({_WORDS[a.op]} of micro-batch {a.microbatch} on stage {a.stage})"


def matching(a: Action) -> Action:
    """The RECV that pairs with SEND ``a`` on the peer stage, or the SEND that pairs with RECV ``a``."""
    return Action({"SEND_F": "RECV_F", "RECV_F": "SEND_F", "SEND_B": "RECV_B", "RECV_B": "SEND_B"}[a.op],
                  a.peer_stage(), a.microbatch)


@dataclass(frozen=True)
class Span:
    """One compute action of the timeline: ``action`` ran on ``rank`` from ``start`` to ``end``."""
    rank: int
    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    """The compute spans of every rank (``spans[rank]``, in order) and the step's length."""
    spans: list[list[Span]]
    makespan: float

    def bubble(self) -> float:
        """Fraction of the step the ranks sit idle, averaged over ranks: 1 - busy / makespan."""
        busy = [sum(s.end - s.start for s in spans) for spans in self.spans]
        return 1.0 - sum(busy) / (len(busy) * self.makespan)

    def peak_in_flight(self) -> list[int]:
        """Per rank, the most micro-batches forwarded but not yet backwarded at once (activations
        held; in a zero-bubble schedule until their W, which still reads the layer inputs); with v
        chunks, each (chunk, micro-batch) counts."""
        return [int(peak) for peak in self.peak_held(lambda stage: 1)]

    def peak_held(self, weight) -> list[float]:
        """Per rank, the most of ``weight(stage)`` (>= 0) held at once: with ``weight`` a stage's
        activation bytes of one micro-batch, the rank's peak activation memory (minidist/plan/memory.py)."""
        return [max((sum(n * weight(s) for s, n in enumerate(held)) for held in seen), default=0)
                for seen in self.held_counts]

    @cached_property
    def held_counts(self) -> list[set[tuple[int, ...]]]:
        """Per rank, every distinct count of micro-batches held per stage right after one of its
        forwards, a (stage, micro-batch) being held from its F to its B (to its W in a zero-bubble
        schedule). A peak comes right after a forward, so any peak of held weight is one of these."""
        release = "W" if any(s.action.op == "W" for spans in self.spans for s in spans) else "B"
        stages = 1 + max((s.action.stage for spans in self.spans for s in spans), default=-1)
        per_rank = []
        for spans in self.spans:
            held, seen = [0] * stages, set()
            for s in spans:
                held[s.action.stage] += {"F": 1, release: -1}.get(s.action.op, 0)
                if s.action.op == "F":
                    seen.add(tuple(held))
            per_rank.append(seen)
        return per_rank


def _where(rank: int, index: int, action: Action) -> str:
    return f"rank {rank}, action #{index} {describe(action)}"


def validate(schedule: list[list[Action]], pp_size: int, micro_batches: int, virtual_stages: int = 1,
             forward_only: bool = False, forward_cost: float = 1.0, backward_cost: float = 2.0,
             weight_cost: float = 1.0, placement: str = "loop") -> Timeline:
    """Check ``schedule`` (one action list per rank, stages placed by ``placement``) against every
    rule above; return the ideal :class:`Timeline` from :func:`simulate`. Raises
    :class:`ScheduleError` on the first broken rule."""
    if len(schedule) != pp_size:
        raise ScheduleError(f"the schedule has {len(schedule)} rank lists for a pipeline of {pp_size} ranks")
    n_stages = pp_size * virtual_stages
    split = any(a.op == "W" for actions in schedule for a in actions)

    def rank_of(stage):
        return stage_rank(stage, pp_size, placement)
    done = defaultdict(set)  # rank -> {(op, stage, microbatch) done so far}
    for r, actions in enumerate(schedule):
        for i, a in enumerate(actions):
            where = _where(r, i, a)
            if not (0 <= a.stage < n_stages and 0 <= a.microbatch < micro_batches):
                raise ScheduleError(f"{where}: stage must be in 0..{n_stages - 1} and micro-batch in "
                                    f"0..{micro_batches - 1}")
            if rank_of(a.stage) != r:
                raise ScheduleError(f"{where}: stage {a.stage} lives on rank {rank_of(a.stage)}")
            if forward_only and a.op in ("B", "W", "SEND_B", "RECV_B"):
                raise ScheduleError(f"{where}: a forward-only schedule has no backward")
            peer = None if a.is_compute else a.peer_stage()
            if peer is not None and not 0 <= peer < n_stages:
                raise ScheduleError(f"{where}: there is no stage {peer} to talk to")
            if peer is not None and rank_of(peer) == r:
                raise ScheduleError(f"{where}: stage {peer} is on this rank too: its tensor is handed over, "
                                    f"not sent")
            key = (a.op, a.stage, a.microbatch)
            if key in done[r]:
                raise ScheduleError(f"{where}: runs twice")
            needs = _needs(a, n_stages, rank_of)
            if needs is not None and needs not in done[r]:
                raise ScheduleError(f"{where}: comes before {Action(*needs)}, which it needs")
            done[r].add(key)
    for s in range(n_stages):
        r = rank_of(s)
        for mb in range(micro_batches):
            for op in ("F",) if forward_only else ("F", "B", "W") if split else ("F", "B"):
                if (op, s, mb) not in done[r]:
                    raise ScheduleError(f"rank {r} never runs {describe(Action(op, s, mb))}")
    _check_pairs_and_order(schedule, pp_size, placement)
    timeline = simulate(schedule, pp_size, forward_cost, backward_cost, weight_cost, placement)
    check_rounds(schedule, pp_size, placement)
    return timeline


def _needs(a: Action, n_stages: int, rank_of):
    """The (op, stage, microbatch) that must come earlier on the same rank, or None."""
    here, mb = rank_of(a.stage), a.microbatch
    if a.op == "F" and a.stage > 0:
        return ("F", a.stage - 1, mb) if rank_of(a.stage - 1) == here else ("RECV_F", a.stage, mb)
    if a.op == "B":
        if a.stage == n_stages - 1:
            return ("F", a.stage, mb)
        return ("B", a.stage + 1, mb) if rank_of(a.stage + 1) == here else ("RECV_B", a.stage, mb)
    if a.op == "W":
        return ("B", a.stage, mb)
    if a.op == "RECV_B":
        return ("F", a.stage, mb)
    if a.op in ("SEND_F", "SEND_B"):
        return (a.op[-1], a.stage, mb)
    return None


def _channel(a: Action, rank: int, pp_size: int, placement: str) -> tuple[int, int, int]:
    """(sending rank, receiving rank, tag) of a SEND or RECV run on ``rank``."""
    peer = stage_rank(a.peer_stage(), pp_size, placement)
    return (rank, peer, a.channel_tag()) if a.op in SENDS else (peer, rank, a.channel_tag())


def _check_pairs_and_order(schedule, pp_size, placement) -> None:
    """Every SEND meets its RECV, and each channel is received in the order it was sent."""
    sent, received = defaultdict(list), defaultdict(list)  # channel -> [(rank, index, action)]
    for r, actions in enumerate(schedule):
        for i, a in enumerate(actions):
            if a.op in SENDS:
                sent[_channel(a, r, pp_size, placement)].append((r, i, a))
            elif a.op in RECVS:
                received[_channel(a, r, pp_size, placement)].append((r, i, a))
    for channel in sorted(set(sent) | set(received)):
        sends, recvs = sent[channel], received[channel]
        posted = {a for _, _, a in recvs}
        for r, i, a in sends:
            if matching(a) not in posted:
                raise ScheduleError(f"{_where(r, i, a)}: rank {channel[1]} never posts the matching "
                                    f"{matching(a)}")
        posted = {a for _, _, a in sends}
        for r, i, a in recvs:
            if matching(a) not in posted:
                raise ScheduleError(f"{_where(r, i, a)}: rank {channel[0]} never sends the matching "
                                    f"{matching(a)}")
        for (_, _, s), (r, i, a) in zip(sends, recvs):
            if s.microbatch != a.microbatch:
                raise ScheduleError(f"{_where(r, i, a)}: rank {channel[0]} sends micro-batch {s.microbatch} "
                                    f"first on this edge, so this receive would get {s} (messages of one "
                                    f"edge arrive in the order they were sent)")


def simulate(schedule: list[list[Action]], pp_size: int, forward_cost: float = 1.0,
             backward_cost: float = 2.0, weight_cost: float = 1.0, placement: str = "loop") -> Timeline:
    """Dry-run every rank's list together and return the ideal :class:`Timeline`.

    Each rank keeps a clock. F, B and W advance it by their cost (a B that is a whole backward costs
    ``backward_cost``; split, B costs ``backward_cost - weight_cost`` and W ``weight_cost``); a SEND
    is posted at the current time and never blocks; the k-th RECV of a channel waits until the k-th
    SEND of that channel was posted. When no rank can move and some are not done, the schedule
    deadlocks: :class:`ScheduleError` lists each stuck rank and the receive it waits on."""
    split = any(a.op == "W" for actions in schedule for a in actions)
    cost = {"F": forward_cost, "B": backward_cost - weight_cost * split, "W": weight_cost}
    position, clock = [0] * pp_size, [0.0] * pp_size
    sent_at = defaultdict(list)  # channel -> times of its sends so far
    received = defaultdict(int)  # channel -> receives completed so far
    spans = [[] for _ in range(pp_size)]
    moved = True
    while moved:
        moved = False
        for r in range(pp_size):
            while position[r] < len(schedule[r]):
                a = schedule[r][position[r]]
                if a.op in SENDS:
                    sent_at[_channel(a, r, pp_size, placement)].append(clock[r])
                elif a.op in RECVS:
                    channel = _channel(a, r, pp_size, placement)
                    k = received[channel]
                    if k >= len(sent_at[channel]):
                        break  # its message is not sent yet: this rank waits
                    clock[r] = max(clock[r], sent_at[channel][k])
                    received[channel] += 1
                else:
                    spans[r].append(Span(r, a, clock[r], clock[r] + cost[a.op]))
                    clock[r] += cost[a.op]
                position[r] += 1
                moved = True
    _stuck("deadlock", [r for r in range(pp_size) if position[r] < len(schedule[r])],
           lambda r: f"{_where(r, position[r], schedule[r][position[r]])} waits for rank "
                     f"{stage_rank(schedule[r][position[r]].peer_stage(), pp_size, placement)}")
    return Timeline(spans, max(clock))


def _stuck(what: str, ranks: list[int], waits) -> None:
    """Raise :class:`ScheduleError` "``what``: " and what each of ``ranks`` waits for, if any is stuck."""
    if ranks:
        raise ScheduleError(f"{what}: " + "; ".join(waits(r) for r in ranks))


def rounds_of(actions: list[Action]) -> list[list[Action]]:
    """The rounds of one rank's list: each run of SENDs and RECVs between two compute actions."""
    rounds, current = [], []
    for a in actions + [Action("F", 0, 0)]:  # a compute action at the end closes the last round
        if a.is_compute and current:
            rounds.append(current)
            current = []
        elif not a.is_compute:
            current.append(a)
    return rounds


def check_rounds(schedule: list[list[Action]], pp_size: int, placement: str = "loop") -> None:
    """Dry-run ``schedule`` as the executor posts it over NCCL: each round one batch that completes
    once every peer holding one of its messages has reached that message's round (a send waits
    for its receive), messages between two ranks matched in posting order (NCCL has no tags).
    Raises :class:`ScheduleError` where a receive would get another message, or ranks would wait on
    each other for ever."""
    rounds = [rounds_of(actions) for actions in schedule]
    posted = defaultdict(list)  # (sending rank, receiving rank, "SEND" / "RECV") -> [(round, action)]
    for r, batches in enumerate(rounds):
        for k, batch in enumerate(batches):
            for a in batch:
                src, dst, _ = _channel(a, r, pp_size, placement)
                posted[src, dst, a.op[:4]].append((k, a))
    partners, crossed = defaultdict(list), []  # (rank, round) -> [(peer, its round)]; mismatched pairs
    for (src, dst, kind), sends in list(posted.items()):
        for (k, send), (j, recv) in zip(sends, posted[src, dst, "RECV"] if kind == "SEND" else []):
            crossed += [f"rank {dst} receives {recv} where rank {src} sends {send}"] if matching(send) != recv else []
            partners[src, k].append((dst, j))
            partners[dst, j].append((src, k))
    reached = [0] * pp_size  # each rank's current round (the ones before are complete)
    moved = True
    while moved:
        moved = False
        for r in range(pp_size):
            while reached[r] < len(rounds[r]) and all(reached[q] >= j for q, j in partners[r, reached[r]]):
                reached[r] += 1
                moved = True
    _stuck("deadlock over NCCL (each round one batch)", [r for r in range(pp_size) if reached[r] < len(rounds[r])],
           lambda r: f"rank {r} posts {' '.join(map(str, rounds[r][reached[r]]))} and waits for rank "
                     f"{next(q for q, j in partners[r, reached[r]] if reached[q] < j)}")
    if crossed:
        raise ScheduleError(f"{crossed[0]}: messages between two ranks match in posting order over NCCL")
