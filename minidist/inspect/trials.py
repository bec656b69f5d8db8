"""A search's trials (``--mode search`` writes ``--out``/trials.jsonl): read, as a table, and as a
picture: the loss of each trial against each hyper-parameter, and the best loss found against the
steps spent (every trial's steps together, early-stopped ones' included)."""
from __future__ import annotations

import math
from pathlib import Path

from minidist.inspect.load import read_json_lines
from minidist.untrusted import parse_json

MAX_TRIALS_BYTES = 16 << 20  # of trials.jsonl read: its end (a few hundred bytes a trial)
COLOURS = {"completed": "#1f77b4", "stopped early": "#ff7f0e", "failed": "#d62728", "running": "#7f7f7f"}


def trial_row(line: bytes) -> dict:
    """One line of trials.jsonl: an integer ``trial``, a ``state``, ``hparams`` of numbers, ``rungs``
    of numbers or nulls, ``loss`` a number or null, integer ``step``; ValueError otherwise."""
    row = parse_json(line)
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
    if not (isinstance(row, dict) and type(row.get("trial")) is int and row.get("state") in COLOURS
            and isinstance(row.get("hparams"), dict) and all(number(v) for v in row["hparams"].values())
            and isinstance(row.get("rungs"), dict) and all(v is None or number(v) for v in row["rungs"].values())
            and (row.get("loss") is None or number(row["loss"])) and type(row.get("step")) is int
            and (row.get("spent") is None or type(row["spent"]) is int)):
        raise ValueError("not a trial: trial, state, hparams, rungs, loss, step, spent")
    return row


def read_trials(path: Path, skipped: list[str]) -> list[dict]:
    """The rows of trials.jsonl at ``path`` (lines that are not a trial skipped, said in ``skipped``)."""
    return read_json_lines(path, MAX_TRIALS_BYTES, lambda _: trial_row, skipped, ("a trials file", "trial"))


def format_trials(rows: list[dict]) -> str:
    """The trials as a table, in trial order: hyper-parameters, the loss at each rung, the state."""
    names = sorted({n for r in rows for n in r["hparams"]})
    steps = sorted({int(s) for r in rows for s in r["rungs"]})
    head = ["trial", *names, *(f"@{s}" for s in steps), "state"]
    body = [[str(r["trial"]), *(f"{r['hparams'][n]:.4g}" if n in r["hparams"] else "" for n in names),
             *(_loss(r["rungs"][str(s)]) if str(s) in r["rungs"] else "" for s in steps), r["state"]] for r in rows]
    widths = [max(len(line[i]) for line in [head] + body) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in [head] + body)


def best_curve(rows: list[dict]) -> list[tuple[int, float]]:
    """(steps spent, the best loss at the end of a trial's budget so far), each time it improves."""
    done = sorted((r["spent"], r["loss"]) for r in rows if r["state"] == "completed" and r["loss"] is not None)
    curve, best = [], math.inf
    for spent, loss in done:
        if loss < best:
            best = loss
            curve.append((spent, best))
    return curve


def draw_trials(rows: list[dict], out, title: str) -> None:
    """The picture (module docstring) saved as a PNG to the open binary file ``out``."""
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = sorted({n for r in rows for n in r["hparams"]})
    fig, axes = plt.subplots(1, len(names) + 1, figsize=(4.2 * (len(names) + 1), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        for state, colour in COLOURS.items():
            shown = [r for r in rows if r["state"] == state and r["loss"] is not None and name in r["hparams"]]
            if shown:
                ax.scatter([r["hparams"][name] for r in shown], [r["loss"] for r in shown], c=colour, s=22,
                           label=f"{state} (at its last rung)" if state == "stopped early" else state)
        values = [r["hparams"][name] for r in rows if name in r["hparams"]]
        if values and min(values) > 0 and max(values) >= 10 * min(values):
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel(name)
        ax.set_ylabel("validation loss")
    axes[0][0].legend(fontsize=7)
    ax, curve = axes[0][-1], best_curve(rows)
    if curve:
        spent, best = zip(*curve)
        ax.step(list(spent) + [max(r["spent"] or 0 for r in rows)], list(best) + [best[-1]], where="post",
                marker="o", color=COLOURS["completed"])
    ax.set_xlabel("steps spent (every trial's)")
    ax.set_ylabel("best validation loss found")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, format="png", dpi=90)
    plt.close(fig)


def _loss(value) -> str:
    return f"{value:.4f}" if value is not None else "failed"
