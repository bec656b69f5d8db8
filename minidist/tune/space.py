"""The search space: each searched hyper-parameter's range, searched on a log or a linear scale, and
the unit cube the samplers work in (a point u in [0, 1]^d is one value per dimension).

    --lr-range 1e-4 1e-2 --warmup-range 0 50 --log-scale lr   ->   lr log-uniform, warmup linear (integers)

A range is refused (one line each) when it is empty or inverted (A >= B), not finite, below the
flag's own floor (every searchable flag is >= 0), on a log scale with A = 0, or, for an integer
flag, holding no integer.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

SEARCHABLE = ("lr", "weight_decay", "warmup", "grad_clip")  # the flags a trial's hyper-parameters may set
INTEGERS = ("warmup",)  # searched as integers: a value rounds to the nearest one in its range


def range_flag(name: str) -> str:
    """``lr`` -> ``--lr-range``: the command line's spelling of a range."""
    return f"--{name.replace('_', '-')}-range"


@dataclasses.dataclass(frozen=True)
class Dimension:
    """One searched hyper-parameter: ``name`` in [``lo``, ``hi``], uniform in log space when ``log``."""
    name: str
    lo: float
    hi: float
    log: bool

    def value(self, u: float):
        """The hyper-parameter at ``u`` in [0, 1] (0: lo, 1: hi): an int for an integer flag."""
        u = min(max(float(u), 0.0), 1.0)
        if self.log:
            v = math.exp(math.log(self.lo) + u * (math.log(self.hi) - math.log(self.lo)))
        else:
            v = self.lo + u * (self.hi - self.lo)
        if self.name in INTEGERS:
            return int(min(max(round(v), math.ceil(self.lo)), math.floor(self.hi)))
        return float(min(max(v, self.lo), self.hi))

    def unit(self, v: float) -> float:
        """Where value ``v`` lies in [0, 1]: the inverse of :meth:`value` (an integer's exact place)."""
        if self.log:
            return (math.log(v) - math.log(self.lo)) / (math.log(self.hi) - math.log(self.lo))
        return (v - self.lo) / (self.hi - self.lo)


@dataclasses.dataclass(frozen=True)
class Space:
    """The searched dimensions, in :data:`SEARCHABLE`'s order."""
    dims: tuple

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.dims]

    def values(self, u) -> dict:
        """{name: value} of the point ``u`` (one number in [0, 1] per dimension)."""
        return {d.name: d.value(x) for d, x in zip(self.dims, u)}

    def unit(self, hparams: dict) -> np.ndarray:
        """The point of ``hparams`` in the unit cube, (d,)."""
        return np.array([d.unit(hparams[d.name]) for d in self.dims], dtype=np.float64)


def space_of(ranges: dict, log_names) -> Space:
    """The space of ``ranges`` ({name: (lo, hi) or None}); a dimension is on a log scale when its name
    is in ``log_names``. Check it first with :func:`space_problems`."""
    return Space(tuple(Dimension(n, float(ranges[n][0]), float(ranges[n][1]), n in log_names)
                       for n in SEARCHABLE if ranges.get(n) is not None))


def space_problems(ranges: dict, log_names) -> list[str]:
    """What is wrong with the space of ``ranges`` and ``log_names``, one line each (module docstring)."""
    found = [f"--log-scale: {n} is not a hyper-parameter a search can range over ({', '.join(SEARCHABLE)})"
             for n in log_names if n not in SEARCHABLE]
    given = {n: r for n, r in ranges.items() if r is not None}
    if not given:
        found.append("--mode search needs at least one range to search: "
                     + ", ".join(f"{range_flag(n)} A B" for n in SEARCHABLE))
    for name, (lo, hi) in given.items():
        spelled, scale = f"{range_flag(name)} {lo:g} {hi:g}", "log" if name in log_names else "linear"
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (lo, hi)):
            found.append(f"{spelled}: the range must be finite")
        elif lo >= hi:
            found.append(f"{spelled} is {'empty' if lo == hi else 'inverted'}: give A < B")
        elif lo < 0:
            found.append(f"{spelled}: the flag is never negative: give 0 <= A < B")
        elif scale == "log" and lo <= 0:
            found.append(f"{spelled} is on a log scale (--log-scale), which needs A > 0: give A > 0, "
                         f"or leave {name} out of --log-scale")
        elif name in INTEGERS and math.ceil(lo) > math.floor(hi):
            found.append(f"{spelled} holds no integer: {name} is a number of steps")
    return found
