"""See a schedule: the per-rank timeline in the terminal, and timelines side by side in a PNG.

The ideal timeline comes from the simulator (``validate.simulate``); the executed one from the
trace, whose compute events ("forward" / "backward" / "weight", group "stage s", seq = micro-batch)
the engine records (on this machine's real stages, or on stages with known costs: known_costs.py).
All are :class:`~minidist.parallel.pipeline.validate.Timeline` objects, so the same ``bubble()``
measures each: the fraction of the step the ranks sit idle. ``draw_panels`` draws them in a grid,
every box labelled only where its label fits.

    rank 0 | F0 F1 F2 F3 .  .  .  B0 -- B1 -- B2 -- B3 --
    rank 1 | .  F0 F1 F2 F3 .  B0 -- B1 -- B2 -- B3 -- .
"""
from __future__ import annotations

from dataclasses import dataclass

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
HATCHES = {"B": "//", "W": "xx"}  # F plain
BOX_HEIGHT = 0.8  # of a rank's row


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
    gathered = group.gather_bytes(np.ascontiguousarray(spans, dtype=np.float64).tobytes(), dst=0,
                                  label="metric: this rank's compute spans, for the timeline")
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


@dataclass
class Panel:
    """One timeline to draw: ``title`` says what it is (and is printed as it is), its times
    multiplied by ``factor`` (1e3: milliseconds)."""
    timeline: Timeline
    title: str
    factor: float = 1.0


def draw_timeline(ax, timeline: Timeline, factor: float = 1.0, colors=None, title: str = "") -> None:
    """Draw ``timeline``'s boxes into matplotlib axes ``ax``: one row per rank, F, B and W boxes
    coloured by micro-batch (``colors``: a colormap; B hatched //, W hatched xx), idle time grey;
    times multiplied by ``factor``; ``title`` as it is. The boxes get their labels from
    :func:`label_boxes`, once the figure's layout is final."""
    import matplotlib.pyplot as plt

    colors = colors or plt.get_cmap("tab10")
    ax.set_facecolor("#d9d9d9")  # idle
    for op in "FBW":  # one call per op: its hatching and alpha
        rows = [(r, s) for r, ranks in enumerate(timeline.spans) for s in ranks if s.action.op == op]
        if rows:
            ax.barh([r for r, _ in rows], [(s.end - s.start) * factor for _, s in rows], height=BOX_HEIGHT,
                    left=[s.start * factor for _, s in rows], edgecolor="black", linewidth=0.4,
                    color=[colors(s.action.microbatch % colors.N) for _, s in rows], hatch=HATCHES.get(op),
                    alpha=0.75 if op == "F" else 1.0)
    ax.set_yticks(range(len(timeline.spans)), [f"rank {r}" for r in range(len(timeline.spans))])
    ax.set_ylim(len(timeline.spans) - 0.5, -0.5)  # rank 0 on top
    ax.set_title(title, fontsize=9, loc="left")


def label_boxes(ax, timeline: Timeline, factor: float = 1.0, words=None, measured=None) -> None:
    """Write each box's label inside it: ``words(action)``, by default ``F3`` or ``B3.1`` (op,
    micro-batch, chunk), in the largest of 7, 6 or 5 points that fits, else without the op letter
    (the hatching shows it), else the micro-batch alone, else not at all: a label keeps 3 points
    clear of each side of its box, so labels never overlap and never run together.
    Measures text and boxes on the figure's renderer: call it once the layout is final (after
    ``tight_layout``); times multiplied by ``factor``; ``measured``: a dict of text sizes to share
    between the axes of one figure."""
    renderer = ax.figure.canvas.get_renderer()
    margin = 6 * ax.figure.dpi / 72  # 3 points each side, in pixels
    p = len(timeline.spans)
    chunks = any(s.action.stage >= p for spans in timeline.spans for s in spans)
    measured = {} if measured is None else measured  # (words, points) -> (width, height) in pixels
    for r, spans in enumerate(timeline.spans):
        for s in spans:
            (x0, y0), (x1, y1) = ax.transData.transform([(s.start * factor, r - BOX_HEIGHT / 2),
                                                         (s.end * factor, r + BOX_HEIGHT / 2)])
            full = words(s.action) if words else _label(s.action, p, chunks)
            text = ax.text((s.start + s.end) / 2 * factor, r, full, ha="center", va="center",  # legible on hatching
                           bbox=dict(boxstyle="square,pad=0.1", fc="white", alpha=0.6, lw=0))
            shorter = dict.fromkeys((full, full.lstrip("FBW"), str(s.action.microbatch)))  # longest first
            for label, size in ((label, size) for label in shorter for size in (7, 6, 5)):
                if (label, size) not in measured:
                    text.set_text(label)
                    text.set_fontsize(size)
                    box = text.get_window_extent(renderer)
                    measured[label, size] = box.width, box.height
                width, height = measured[label, size]
                if width + margin <= abs(x1 - x0) and height <= abs(y1 - y0):
                    text.set_text(label)
                    text.set_fontsize(size)
                    break
            else:
                text.remove()


def legend_handles(timelines: list[Timeline], colors) -> list:
    """Legend entries for ``timelines``: a colour per micro-batch, F plain, B and W hatched (each only
    where it occurs), idle grey."""
    from matplotlib.patches import Patch

    spans = [s for t in timelines for ranks in t.spans for s in ranks]
    ops = {s.action.op for s in spans}
    words = {"F": "F: forward", "B": "B: backward" + (" (input gradient)" if "W" in ops else ""),
             "W": "W: weight gradients"}
    handles = [Patch(fc=colors(i % colors.N), ec="black", label=f"micro-batch {i}")
               for i in range(1 + max(s.action.microbatch for s in spans))]
    handles += [Patch(fc="white", ec="black", hatch=HATCHES.get(op), label=words[op]) for op in "FBW" if op in ops]
    return handles + [Patch(fc="#d9d9d9", label="idle")]


def draw_panels(path, rows: list[list[Panel]], title: str = "", xlabel: str = "") -> None:
    """Save a PNG of timelines in a grid: ``rows`` of :class:`Panel`, the panels of a column on one
    time axis; each panel's boxes drawn by :func:`draw_timeline` and labelled by :func:`label_boxes`,
    one legend for all."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timelines = [panel.timeline for row in rows for panel in row]
    n_mb = 1 + max(s.action.microbatch for t in timelines for ranks in t.spans for s in ranks)
    colors = plt.get_cmap("tab20" if n_mb > 10 else "tab10")
    p, columns = max(len(t.spans) for t in timelines), len(rows[0])
    fig, axes = plt.subplots(len(rows), columns, squeeze=False, sharex="col",
                             figsize=(max(13.0, 8 * columns + 0.5), 0.6 + len(rows) * (0.42 * p + 0.75)))
    for c in range(columns):
        end = max(panel.timeline.makespan * panel.factor for panel in (row[c] for row in rows))
        for ax, panel in zip(axes[:, c], (row[c] for row in rows)):
            draw_timeline(ax, panel.timeline, panel.factor, colors, panel.title)
            ax.set_xlim(0, end)
            ax.tick_params(axis="x", labelsize=8)
        axes[-1, c].set_xlabel(xlabel, fontsize=9)
    fig.legend(handles=legend_handles(timelines, colors), loc="upper left", bbox_to_anchor=(1.0, 0.97), fontsize=8,
               frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    measured = {}  # each label's size, measured once for the whole figure
    for axes_row, row in zip(axes, rows):
        for ax, panel in zip(axes_row, row):
            label_boxes(ax, panel.timeline, panel.factor, measured=measured)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def draw_timelines(path, executed: Timeline, ideal: Timeline, title: str = "") -> None:
    """Save a PNG: the executed timeline (top) above the ideal one (bottom, scaled to the same
    length), with their bubbles (:func:`draw_panels`)."""
    scale = executed.makespan / ideal.makespan
    draw_panels(path, [[Panel(executed, f"executed: bubble {100 * executed.bubble():.1f}%")],
                       [Panel(ideal, f"ideal: bubble {100 * ideal.bubble():.1f}%", scale)]],
                title, "seconds (ideal: the simulator's cost units, scaled to the executed step)")
