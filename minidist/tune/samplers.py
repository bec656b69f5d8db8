"""Where the next trials go: ``random`` draws them uniformly in the space (log-uniform on a log
scale), ``gp`` by Bayesian optimization. Both are functions of the seed and the results so far.

    random   trial t at u ~ U[0, 1]^d from numpy.random.default_rng([seed, t, DRAW])
    gp       the first ``startup`` trials (d + 1) as random's; then a Gaussian process (gp.py) is
             fitted to every result so far and each new trial goes where the expected improvement
             (acquisition.py) is highest, its candidates drawn from default_rng([seed, t, CANDIDATES])

A round may ask for K trials at once (K sub-groups free), while others still run. The batch is chosen
one point at a time: each chosen point, and each running trial's, is given a made-up result (a lie)
and the process is conditioned on it, its kernel kept, so the next point goes elsewhere:

    believer    the lie is the process's own mean there (kriging believer)
    liar        the lie is the lowest loss seen (constant liar, CL-min; Ginsbourger et al. 2010)

The process is fitted to one budget: with early stopping (asha.py) the results are the losses at the
highest rung at least two ended trials reached with a finite loss (at the end of the budget, without
it). A trial that stopped below that rung, or failed (its run diverged), counts as the highest loss
seen there, so the search leaves its region: losses after different numbers of steps are never
mixed in one process (BOHB, Falkner et al. 2018, fits one model per budget for the same reason).
"""
from __future__ import annotations

import numpy as np

import math
from collections import Counter

from minidist.tune.acquisition import maximize
from minidist.tune.gp import GaussianProcess

SAMPLERS = ("random", "gp")
BATCH_RULES = ("believer", "liar")
DRAW, CANDIDATES = 0, 1  # the purposes of the random draws


def rng(seed: int, trial: int, purpose: int) -> np.random.Generator:
    return np.random.default_rng([seed, trial, purpose])


def startup(dims: int) -> int:
    """Trials the ``gp`` sampler draws at random before it fits a process: d + 1."""
    return dims + 1


def suggest(sampler: str, dims: int, seed: int, first: int, n: int, observed: list, pending: list,
            batch_rule: str = "believer") -> list[np.ndarray]:
    """Points in the unit cube, (dims,) each, for trials ``first`` .. ``first + n - 1``. ``observed``:
    (point, loss) of every trial with a result (NaN: failed); ``pending``: the points of the trials
    still running without one."""
    finite = [loss for _, loss in observed if np.isfinite(loss)]
    chosen = []
    if sampler == "random" or len(finite) < 2:
        return [rng(seed, t, DRAW).random(dims) for t in range(first, first + n)]
    worst = max(finite)
    x = np.array([p for p, _ in observed])
    y = np.array([loss if np.isfinite(loss) else worst for _, loss in observed])
    gp, best = GaussianProcess(x, y), float(min(finite))
    for point in pending:
        gp = gp.with_fantasy(point, lie(gp, point, best, batch_rule))
    for t in range(first, first + n):
        if t < startup(dims):
            point = rng(seed, t, DRAW).random(dims)
        else:
            point = maximize(gp, best, dims, rng(seed, t, CANDIDATES))
        chosen.append(point)
        gp = gp.with_fantasy(point, lie(gp, point, best, batch_rule))
    return chosen


def results(ended: list, space) -> list[tuple[np.ndarray, float]]:
    """(point, loss) of each of ``ended`` (trials of state.py that completed, stopped or failed) at the
    budget the process is fitted to (module docstring): NaN where the trial has no finite loss there."""
    reached = Counter(step for t in ended for step, loss in t.rungs.items() if math.isfinite(loss))
    budgets = [step for step, n in reached.items() if n >= 2]
    if not budgets:
        return [(space.unit(t.hparams), t.loss if t.loss is not None else math.nan) for t in ended]
    return [(space.unit(t.hparams), t.rungs.get(max(budgets), math.nan)) for t in ended]


def lie(gp, point: np.ndarray, best: float, batch_rule: str) -> float:
    """The made-up result of a point chosen but not yet run (module docstring)."""
    if batch_rule == "believer":
        return float(gp.predict(point[None, :])[0][0])
    if batch_rule == "liar":
        return best
    raise ValueError(f"batch rule must be one of {', '.join(BATCH_RULES)}, got {batch_rule!r}")
