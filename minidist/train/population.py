"""Population-based training's rules (Jaderberg et al. 2017), as pure functions of the seed and the
validation losses: which hyper-parameters each member starts with, which members copy which, and how
a copy's hyper-parameters are perturbed. train/pbt.py runs them; nothing here sends or reads.

    draw        member k's first hyper-parameters: each explored one log-uniform in its range
                (``--lr-range A B``), from a generator seeded with (seed, k)
    ready       every ``--ready-every`` S steps each member reports its validation loss
    exploit     truncation: a member in the bottom ``--quantile`` Q (by loss; Q K members, rounded half
                up) copies a member drawn from the top Q; tournament: each member meets one other,
                drawn, and copies it if its loss is higher. A member that diverged (its loss NaN)
                copies one of the top Q in any case. A copy takes the donor's weights, optimizer
                state and hyper-parameters
    explore     the copied hyper-parameters, each multiplied by 0.8 or 1.2 (a coin), or with
                probability ``RESAMPLE`` drawn again from its range; each change is named ("x0.8",
                "x1.2", "fresh draw", and ", clipped to [A, B]" where the range cut it)

Every draw comes from ``numpy.random.default_rng([seed, step, member, purpose])``, so the population's
whole history is a function of the seed (and the losses, which are themselves a function of it).
Ties in loss go to the lower member index.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

POPULATION = "population"  # under --ckpt-dir: the population at each ready point, step-<n>.json
EXPLORABLE = ("lr", "weight_decay", "grad_clip", "min_lr")  # float flags a member may explore
EXPLOITS = ("truncation", "tournament")
FACTORS = (0.8, 1.2)
RESAMPLE = 0.25  # the chance that explore draws a hyper-parameter afresh instead of perturbing it
DRAW, PAIR, DONOR, EXPLORE = 0, 1, 2, 3  # the purposes of the random draws


@dataclasses.dataclass
class Member:
    """One member of the population: its index, its hyper-parameters, its parent (the member whose
    weights it last took at a ready point; its own index when it never copied) and its last
    validation loss."""
    index: int
    hparams: dict
    parent: int
    val_loss: float | None = None

    def to_json(self) -> dict:
        return dict(index=self.index, hparams=self.hparams, parent=self.parent, val_loss=self.val_loss)


def rng(seed: int, step: int, member: int, purpose: int) -> np.random.Generator:
    return np.random.default_rng([seed, step, member, purpose])


def log_uniform(g: np.random.Generator, lo: float, hi: float) -> float:
    """A draw from [lo, hi], uniform in log space (lo = hi: that value)."""
    return float(math.exp(g.uniform(math.log(lo), math.log(hi)))) if lo < hi else float(lo)


def draw(k: int, seed: int, base: dict, ranges: dict) -> list[Member]:
    """``k`` members: each explored hyper-parameter drawn in its range (``ranges``: name -> (lo, hi)),
    the others ``base``'s."""
    members = []
    for i in range(k):
        g = rng(seed, 0, i, DRAW)
        hparams = {name: log_uniform(g, *ranges[name]) if name in ranges else base[name] for name in base}
        members.append(Member(i, hparams, i))
    return members


def ranked(losses: list[float]) -> list[int]:
    """Member indices from the lowest loss to the highest (NaN last; ties: lower index first)."""
    return sorted(range(len(losses)), key=lambda i: (not math.isfinite(losses[i]), losses[i] if math.isfinite(losses[i]) else 0, i))


def exploit(losses: list[float], rule: str, quantile: float, seed: int, step: int) -> dict[int, int]:
    """{member: donor} for every member that copies another at ``step``, by ``rule`` ("truncation" or
    "tournament") over ``losses`` (one per member, lower is better)."""
    k, order = len(losses), ranked(losses)
    n = max(1, math.floor(quantile * k + 0.5)) if k > 1 else 0  # the quantile's members, rounded half up
    top = [m for m in order[:n] if math.isfinite(losses[m])]
    if rule == "truncation":
        copies = {m: top[int(rng(seed, step, m, DONOR).integers(len(top)))] for m in order[k - n:] if m not in top}
    elif rule == "tournament":
        copies = {}
        for m in range(k):
            other = int(rng(seed, step, m, PAIR).integers(k - 1))
            other += other >= m  # one of the others
            if order.index(other) < order.index(m):
                copies[m] = other
    else:
        raise ValueError(f"exploit rule must be truncation or tournament, got {rule!r}")
    for m in range(k):  # a diverged member (no loss, no checkpoint of this step) always copies one of the top
        if not math.isfinite(losses[m]) and (m not in copies or not math.isfinite(losses[copies[m]])) and top:
            copies[m] = top[int(rng(seed, step, m, DONOR).integers(len(top)))]
    return copies


def explore(hparams: dict, names, ranges: dict, seed: int, step: int, member: int) -> tuple[dict, dict]:
    """(``hparams`` with each of ``names`` perturbed, x0.8 or x1.2, or with probability RESAMPLE drawn
    afresh from its range when it has one, then clipped to its range; {name: how it changed}: "x0.8",
    "x1.2" or "fresh draw", with ", clipped to [A, B]" where the range cut it)."""
    g, out, how = rng(seed, step, member, EXPLORE), dict(hparams), {}
    for name in names:
        resample, factor = g.random() < RESAMPLE, FACTORS[int(g.integers(2))]
        if resample and name in ranges:
            out[name], how[name] = log_uniform(g, *ranges[name]), "fresh draw"
        else:
            out[name], how[name] = hparams[name] * factor, f"x{factor}"
        if name in ranges:
            lo, hi = ranges[name]
            kept = float(min(max(out[name], lo), hi))
            if kept != out[name]:
                how[name] += f", clipped to [{lo:g}, {hi:g}]"
            out[name] = kept
    return out, how


def generation(members: list[Member], losses: list[float], *, rule: str, quantile: float, names, ranges: dict,
               seed: int, step: int) -> tuple[list[Member], dict[int, int], dict[int, dict]]:
    """The population after the ready point at ``step``: each copier takes its donor's weights and
    hyper-parameters (explored), its donor becoming its parent; the others keep theirs. Returns
    (members, {copier: donor}, {copier: {name: how it changed}})."""
    copies, changes, after = exploit(losses, rule, quantile, seed, step), {}, []
    for m, loss in zip(members, losses):
        if m.index in copies:
            donor = members[copies[m.index]]
            hparams, changes[m.index] = explore(donor.hparams, names, ranges, seed, step, m.index)
            after.append(Member(m.index, hparams, donor.index, loss))
        else:
            after.append(Member(m.index, dict(m.hparams), m.parent, loss))
    return after, copies, changes
