"""A search's state: every trial so far (its hyper-parameters, the step it reached, its losses at
its rungs, whether it runs, completed, was stopped early or failed) and the steps spent, written by
train/search.py to ``--ckpt-dir``/search/state.json after each segment, read back by ``--resume``
through the one bounded reader and checked, and one line per trial in ``--out``/trials.jsonl.
"""
from __future__ import annotations

import dataclasses
import math

from minidist.untrusted import read_json

STATES = ("running", "completed", "stopped early", "failed")
STATE_BYTES = 1 << 24  # a state file: a few hundred bytes a trial


@dataclasses.dataclass
class Trial:
    """One trial: ``index``, the ``slot`` (sub-group) that runs it, its ``hparams``, the ``step`` it
    reached, ``rungs`` ({step: validation loss} at each rung and at the end), its ``state``,
    ``spent``: the search's steps spent when it ended (None while it runs), and ``started``: when it
    started (the results it was chosen from: those of the trials whose ``spent`` is at most that)."""
    index: int
    slot: int
    hparams: dict
    step: int = 0
    rungs: dict = dataclasses.field(default_factory=dict)
    state: str = "running"
    spent: int | None = None
    started: int = 0

    @property
    def loss(self) -> float | None:
        """The loss at its last rung (None before the first)."""
        return self.rungs[max(self.rungs)] if self.rungs else None

    def to_json(self) -> dict:
        """A line of trials.jsonl (rung steps as strings: JSON's keys)."""
        return dict(trial=self.index, slot=self.slot, hparams=self.hparams, step=self.step,
                    rungs={str(s): finite(v) for s, v in sorted(self.rungs.items())}, state=self.state,
                    loss=finite(self.loss), spent=self.spent, started=self.started)


def finite(value: float | None) -> float | None:
    """``value``, or None for NaN (a failed trial's loss; JSON has no NaN)."""
    return value if value is None or math.isfinite(value) else None


@dataclasses.dataclass
class SearchState:
    """Every trial started so far, by index, and the steps the search has run (every trial's together)."""
    trials: list
    spent: int = 0

    def running(self) -> list[Trial]:
        return [t for t in self.trials if t.state == "running"]

    def best(self) -> Trial | None:
        """The completed trial of the lowest loss (ties: the lower index), None when none completed."""
        done = [t for t in self.trials if t.state == "completed" and math.isfinite(t.loss)]
        return min(done, key=lambda t: (t.loss, t.index), default=None)

    def to_json(self) -> dict:
        return dict(spent=self.spent, trials=[t.to_json() for t in self.trials])


def read_state(path, names: list[str], trials: int, slots: int, error) -> SearchState:
    """The state file ``path``, read through the one bounded reader and checked: at most ``trials``
    trials indexed 0, 1, ..., each on a slot below ``slots`` with a number for each of ``names``,
    its rungs numbers (or null for a failed one), a known state. ``error`` (one line naming the file)
    otherwise."""
    raw = read_json(path, STATE_BYTES, "a search state file", error=error)
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    rows = raw.get("trials") if isinstance(raw, dict) else None
    fine = (isinstance(raw, dict) and type(raw.get("spent")) is int and raw["spent"] >= 0 and isinstance(rows, list)
            and len(rows) <= trials
            and all(isinstance(r, dict) and r.get("trial") == i and type(r.get("slot")) is int and 0 <= r["slot"] < slots
                    and isinstance(r.get("hparams"), dict) and sorted(r["hparams"]) == sorted(names)
                    and all(number(v) for v in r["hparams"].values())
                    and type(r.get("step")) is int and r["step"] >= 0 and r.get("state") in STATES
                    and isinstance(r.get("rungs"), dict) and all(k.isdigit() and (v is None or number(v))
                                                                 for k, v in r["rungs"].items())
                    and (r.get("spent") is None or type(r["spent"]) is int) and type(r.get("started")) is int
                    for i, r in enumerate(rows)))
    if not fine:
        raise error(f"--resume: {path} is not the state of this search (spent, and at most {trials} trials on "
                    f"{slots} sub-groups with hparams {', '.join(names)}, step, rungs, state, spent and started): remove it and "
                    f"start the search again")
    return SearchState([Trial(r["trial"], r["slot"], r["hparams"], r["step"],
                              {int(k): (math.nan if v is None else float(v)) for k, v in r["rungs"].items()},
                              r["state"], r["spent"], r["started"]) for r in rows], raw["spent"])
