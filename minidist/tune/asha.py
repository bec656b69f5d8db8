"""Early stopping by asynchronous successive halving (ASHA: Li et al. 2020; the stopping form Ray
Tune's ``ASHAScheduler`` runs).

A trial's budget is ``steps``. Its rungs are at ``grace`` steps times the powers of ``reduction``
below the budget: grace 10, reduction 3, 100 steps -> rungs 10, 30, 90. At each rung a trial
reports its validation loss and goes on only when it is in the top 1 / reduction of every loss
recorded at that rung so far (its own included; at least the best one goes on, so the first trial
to reach a rung always does); otherwise it is stopped early, and its sub-group takes the next trial.
Ties go to the lower trial index; a NaN loss never goes on. No rung waits for another trial:
the comparison is with what has arrived.
"""
from __future__ import annotations

import math

SCHEDULERS = ("none", "asha")


def rungs(grace: int, reduction: int, steps: int) -> list[int]:
    """The steps below ``steps`` where a trial reports and may be stopped: grace * reduction^i."""
    found, at = [], grace
    while at < steps:
        found.append(at)
        at *= reduction
    return found


def goes_on(trial: int, recorded: dict[int, float], reduction: int) -> bool:
    """Whether ``trial`` continues past a rung where ``recorded`` ({trial: loss}, its own included)
    arrived so far: its place among them (lowest loss first, ties by index) is within the top
    max(1, floor(n / reduction))."""
    loss = recorded[trial]
    if not math.isfinite(loss):
        return False
    order = sorted(recorded, key=lambda t: (not math.isfinite(recorded[t]), recorded[t] if math.isfinite(recorded[t]) else 0, t))
    return order.index(trial) < max(1, len(recorded) // reduction)


def segment(milestones: list[int], steps: int, save_every: int = 0) -> int:
    """The steps a sub-group runs between two agreements of the search: the greatest common divisor
    of the rungs, the budget and ``save_every`` (0: not given), so every rung ends a segment."""
    return math.gcd(*milestones, steps, save_every)
