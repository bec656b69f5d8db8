"""See a schedule: the per-rank timeline in the terminal, and executed vs ideal as a PNG.

The ideal timeline comes from the simulator (``validate.simulate``); the executed one from the
trace, whose compute events ("forward" / "backward" / "weight", group "stage s", seq = micro-batch)
the engine records. Both are :class:`~minidist.parallel.pipeline.validate.Timeline` objects, so the same
``bubble()`` measures both: the fraction of the step the ranks sit idle.

    rank 0 | F0 F1 F2 F3 .  .  .  B0 -- B1 -- B2 -- B3 --
    rank 1 | .  F0 F1 F2 F3 .  B0 -- B1 -- B2 -- B3 -- .
"""
from __future__ import annotations

import numpy as np

from minidist.parallel.pipeline.actions import Action
from minidist.parallel.pipeline.validate import Span, Timeline


def _label(action: Action, pp_size: int, chunks: bool) -> str:
    """``F3`` (forward of micro-batch 3), with ``.1`` for chunk 1 when ranks hold several chunks."""
    return f"{action.op}{action.microbatch}" + (f".{action.stage // pp_size}" if chunks else "")


def format_timeline(timeline: Timeline, title: str = "") -> str:
    """The simulator's timeline as text: one row per rank, one cell per time unit (costs must be
    whole units, as the defaults F = 1, B = 2 are); ``.`` is idle, ``--`` continues the action to its
    left. Ends with the bubble fraction."""
    p = len(timeline.spans)
    chunks = any(s.action.stage >= p for spans in timeline.spans for s in spans)
    units = int(round(timeline.makespan))
    width = max([len(_label(s.action, p, chunks)) for spans in timeline.spans for s in spans] + [2])
    lines = [title] if title else []
    for r, spans in enumerate(timeline.spans):
        cells = ["."] * units
        for s in spans:
            start, end = int(round(s.start)), int(round(s.end))
            cells[start] = _label(s.action, p, chunks)
            for t in range(start + 1, end):
                cells[t] = "-" * width
        lines.append(f"rank {r} | " + " ".join(c.ljust(width) for c in cells).rstrip())
    lines.append(f"bubble: {100 * timeline.bubble():.1f}% of the step idle")
    return "\n".join(lines)


_TRACED = {"forward": "F", "backward": "B", "weight": "W"}  # trace event -> action op


def compute_spans(trace) -> np.ndarray:
    """The trace's forward/backward/weight events as an (n, 5) float64 array of (start, end, stage,
    micro-batch, kind 0 F / 1 B / 2 W): compact enough to send to one rank for drawing."""
    kinds = list(_TRACED)
    rows = [(e.start, e.end, int(e.group.split()[-1]), e.seq, kinds.index(e.op))
            for e in trace.events if e.kind == "compute" and e.op in _TRACED]
    return np.array(rows, dtype=np.float64).reshape(-1, 5)


def gather_spans(group, spans: np.ndarray) -> list[np.ndarray] | None:
    """Collect every rank's :func:`compute_spans` on rank 0 of ``group`` (a list in rank order; None
    elsewhere): each rank's rows travel as raw float64 bytes in one ``group.gather_bytes``."""
    gathered = group.gather_bytes(np.ascontiguousarray(spans, dtype=np.float64).tobytes(), dst=0)
    if gathered is None:
        return None
    return [np.frombuffer(data, dtype=np.float64).reshape(-1, 5) for data in gathered]  # (n_r, 5) each


def executed_timeline(spans_per_rank: list[np.ndarray]) -> Timeline:
    """The executed :class:`Timeline` from every rank's :func:`compute_spans` (clocks shared: threads
    of one process, or processes of one machine), in seconds from the first event."""
    origin = min(s[:, 0].min() for s in spans_per_rank if len(s))
    end = max(s[:, 1].max() for s in spans_per_rank if len(s))
    ops = list(_TRACED.values())
    timeline = [[Span(r, Action(ops[int(kind)], int(stage), int(mb)), start - origin, stop - origin)
                 for start, stop, stage, mb, kind in rows] for r, rows in enumerate(spans_per_rank)]
    return Timeline(timeline, end - origin)


def draw_timeline(ax, timeline: Timeline, factor: float = 1.0, colors=None, title: str = "") -> None:
    """Draw ``timeline`` into matplotlib axes ``ax``: one row per rank, F, B and W boxes coloured by
    micro-batch (``colors``: a colormap; B hatched //, W hatched xx) and labelled where there is room,
    idle time grey; times multiplied by ``factor``."""
    import matplotlib.pyplot as plt

    p = len(timeline.spans)
    colors = colors or plt.get_cmap("tab10")
    chunks = any(s.action.stage >= p for spans in timeline.spans for s in spans)
    ax.set_facecolor("#d9d9d9")  # idle
    for r, spans in enumerate(timeline.spans):
        for s in spans:
            ax.barh(r, (s.end - s.start) * factor, left=s.start * factor, height=0.8,
                    color=colors(s.action.microbatch % colors.N), edgecolor="black", linewidth=0.4,
                    hatch={"B": "//", "W": "xx"}.get(s.action.op), alpha=0.75 if s.action.op == "F" else 1.0)
            if (s.end - s.start) / timeline.makespan > 0.012:
                ax.text((s.start + s.end) / 2 * factor, r, _label(s.action, p, chunks), ha="center",
                        va="center", fontsize=7)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_title(f"{title}bubble {100 * timeline.bubble():.1f}%", fontsize=10, loc="left")


def draw_timelines(path, executed: Timeline, ideal: Timeline, title: str = "") -> None:
    """Save a PNG: the executed timeline (top) above the ideal one (bottom, scaled to the same
    length), each drawn by :func:`draw_timeline`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = len(ideal.spans)
    n_mb = 1 + max(s.action.microbatch for spans in ideal.spans for s in spans)
    colors = plt.get_cmap("tab20" if n_mb > 10 else "tab10")
    fig, axes = plt.subplots(2, 1, figsize=(12, 1.2 + 1.1 * p), sharex=True)
    for ax, timeline, factor, name in ((axes[0], executed, 1.0, "executed"),
                                       (axes[1], ideal, executed.makespan / ideal.makespan, "ideal")):
        draw_timeline(ax, timeline, factor, colors, f"{name}: ")
        ax.set_xlim(0, executed.makespan)
    axes[1].set_xlabel("seconds (ideal: the simulator's cost units, scaled to the executed step)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
