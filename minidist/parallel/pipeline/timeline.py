"""See a schedule: the per-rank timeline in the terminal, and timelines side by side in a PNG.

The ideal timeline comes from the simulator (``validate.simulate``); the executed one from the
trace, whose compute events ("forward" / "backward" / "weight", group "stage s", seq = micro-batch)
the engine records (on this machine's real stages, or on stages with known costs: known_costs.py).
All are :class:`~minidist.parallel.pipeline.validate.Timeline` objects, so the same ``bubble()``
measures each: the fraction of the step the ranks sit idle. ``draw_panels`` draws them in a grid,
every box labelled only where its label fits; a panel too fine to read as boxes (a step on a shared
machine, its actions slivers between waits) can be drawn summed: each rank's F, B, W and idle time.

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
OP_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}  # by_op: a colour per op, chunk 1 paler
IDLE = "#d9d9d9"
BOX_HEIGHT = 0.8  # of a rank's row
LABEL_POINTS = (8, 7)  # a label's sizes, the largest that fits first


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
    multiplied by ``factor`` (1e3: milliseconds). ``summed``: each rank's F, B, W and idle time
    added up, one bar per rank as long as the step (:func:`draw_summed`), instead of the boxes."""
    timeline: Timeline
    title: str
    factor: float = 1.0
    summed: bool = False


def draw_timeline(ax, timeline: Timeline, factor: float = 1.0, colors=None, title: str = "",
                  by_op: bool = False) -> None:
    """Draw ``timeline``'s boxes into matplotlib axes ``ax``: one row per rank, F, B and W boxes
    coloured by micro-batch (``colors``: a colormap; B hatched //, W hatched xx), or ``by_op``: F, B
    and W in three colours; a rank's second chunk paler; idle time grey; times multiplied by
    ``factor``; ``title`` as it is. The boxes get their labels from :func:`label_boxes`, once the
    figure's layout is final."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    colors = colors or plt.get_cmap("tab10")
    p = len(timeline.spans)
    ax.set_facecolor(IDLE)
    for op in "FBW":  # one call per op: its hatching and alpha
        rows = [(r, s) for r, ranks in enumerate(timeline.spans) for s in ranks if s.action.op == op]
        if rows:
            fill = ([to_rgba(OP_COLOURS[op], 0.5 if s.action.stage >= p else 1.0) for _, s in rows] if by_op else
                    [to_rgba(colors(s.action.microbatch % colors.N), (0.75 if op == "F" else 1.0)
                             * (0.45 if s.action.stage >= p else 1.0)) for _, s in rows])
            ax.barh([r for r, _ in rows], [(s.end - s.start) * factor for _, s in rows], height=BOX_HEIGHT,
                    left=[s.start * factor for _, s in rows], edgecolor="black", linewidth=0.4,
                    color=fill, hatch=None if by_op else HATCHES.get(op))
    ax.set_yticks(range(len(timeline.spans)), [f"rank {r}" for r in range(len(timeline.spans))])
    ax.set_ylim(len(timeline.spans) - 0.5, -0.5)  # rank 0 on top
    ax.set_title(title, fontsize=9, loc="left")


def label_boxes(ax, timeline: Timeline, factor: float = 1.0, words=None, measured=None) -> None:
    """Write each box's label inside it: ``words(action)``, by default ``F3`` or ``B3.1`` (op,
    micro-batch, chunk), in the largest of LABEL_POINTS that fits, else without the op letter
    (the hatching shows it), else the micro-batch alone, else not at all: a label keeps 3 points
    clear of each side of its box, so labels never overlap and never run together.
    Measures text and boxes on the figure's renderer: call it once the layout is final (after
    ``tight_layout``); times multiplied by ``factor``; ``measured``: a dict of text sizes to share
    between the axes of one figure."""
    p = len(timeline.spans)
    chunks = any(s.action.stage >= p for spans in timeline.spans for s in spans)
    measured = {} if measured is None else measured  # (words, points) -> (width, height) in pixels
    for r, spans in enumerate(timeline.spans):
        for s in spans:
            (x0, y0), (x1, y1) = ax.transData.transform([(s.start * factor, r - BOX_HEIGHT / 2),
                                                         (s.end * factor, r + BOX_HEIGHT / 2)])
            full = words(s.action) if words else _label(s.action, p, chunks)
            shorter = dict.fromkeys((full, full.lstrip("FBW"), str(s.action.microbatch)))  # longest first
            _fit(ax, (s.start + s.end) / 2 * factor, r, abs(x1 - x0), abs(y1 - y0), shorter, measured)


def _fit(ax, x: float, y: float, width: float, height: float, candidates, measured: dict) -> None:
    """Write the first of ``candidates`` that fits a box ``width`` x ``height`` pixels wide and high,
    centred at data point (x, y), 3 points clear of each side; nothing if none fits."""
    renderer = ax.figure.canvas.get_renderer()
    margin = 6 * ax.figure.dpi / 72
    text = ax.text(x, y, "", ha="center", va="center", bbox=dict(boxstyle="square,pad=0.1", fc="white", alpha=0.6,
                                                                 lw=0))
    for label, size in ((label, size) for label in candidates for size in LABEL_POINTS):
        if (label, size) not in measured:
            text.set_text(label)
            text.set_fontsize(size)
            box = text.get_window_extent(renderer)
            measured[label, size] = box.width, box.height
        if measured[label, size][0] + margin <= width and measured[label, size][1] <= height:
            text.set_text(label)
            text.set_fontsize(size)
            return
    text.remove()


def summed(timeline: Timeline) -> list[dict[str, float]]:
    """Per rank, the time its step spent in F, B and W, and idle (the makespan's rest)."""
    found = []
    for spans in timeline.spans:
        time = {op: sum(s.end - s.start for s in spans if s.action.op == op) for op in "FBW"}
        time["idle"] = timeline.makespan - sum(time.values())
        found.append(time)
    return found


def draw_summed(ax, timeline: Timeline, title: str = "", by_op: bool = False) -> None:
    """One bar per rank, as long as the step (100%): the time it spent in F, then B, then W, then
    idle, each added up (``by_op``: in the ops' colours, else plain and hatched as
    :func:`draw_timeline`'s boxes). Their labels come from :func:`label_summed`, once the layout is
    final."""
    for r, time in enumerate(summed(timeline)):
        left = 0.0
        for op in ("F", "B", "W", "idle"):
            if time[op] > 0:
                colour = IDLE if op == "idle" else OP_COLOURS[op] if by_op else "white"
                ax.barh(r, 100 * time[op] / timeline.makespan, left=100 * left / timeline.makespan, height=BOX_HEIGHT,
                        color=colour, edgecolor="black", linewidth=0.4,
                        hatch=None if by_op or op == "idle" else HATCHES.get(op))
                left += time[op]
    ax.set_yticks(range(len(timeline.spans)), [f"rank {r}" for r in range(len(timeline.spans))])
    ax.set_ylim(len(timeline.spans) - 0.5, -0.5)
    ax.set_xlim(0, 100)
    ax.set_title(title, fontsize=9, loc="left")


def label_summed(ax, timeline: Timeline, factor: float = 1.0, unit: str = "ms", measured=None) -> None:
    """Write each segment of :func:`draw_summed`'s bars inside it, its time multiplied by ``factor``:
    ``B 12 ms``, ``B 12``, ``12``, ``B``, or nothing, the first that fits."""
    measured = {} if measured is None else measured
    for r, time in enumerate(summed(timeline)):
        left = 0.0
        for op in ("F", "B", "W", "idle"):
            if time[op] > 0:
                lo, hi = 100 * left / timeline.makespan, 100 * (left + time[op]) / timeline.makespan
                (x0, y0), (x1, y1) = ax.transData.transform([(lo, r - BOX_HEIGHT / 2), (hi, r + BOX_HEIGHT / 2)])
                value = f"{time[op] * factor:.0f}"
                candidates = [f"{op} {value} {unit}"] * bool(unit) + [f"{op} {value}", value, op]
                _fit(ax, (lo + hi) / 2, r, abs(x1 - x0), abs(y1 - y0), candidates, measured)
                left += time[op]


def legend_handles(timelines: list[Timeline], colors, by_op: bool = False) -> list:
    """Legend entries for ``timelines``: a colour per micro-batch, F plain, B and W hatched (each only
    where it occurs), or ``by_op``: a colour per op; the second chunk paler; idle grey."""
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Patch

    spans = [s for t in timelines for ranks in t.spans for s in ranks]
    ops = {s.action.op for s in spans}
    words = {"F": "F: forward", "B": "B: backward" + (" (input gradient)" if "W" in ops else ""),
             "W": "W: weight gradients"}
    if by_op:
        handles = [Patch(fc=OP_COLOURS[op], ec="black", label=words[op]) for op in "FBW" if op in ops]
        if any(s.action.stage >= len(t.spans) for t in timelines for ranks in t.spans for s in ranks):
            handles += [Patch(fc=to_rgba(OP_COLOURS[op], 0.5), ec="black", label=f"{op}, chunk 1 (paler)")
                        for op in "FBW" if op in ops]
        return handles + [Patch(fc=IDLE, label="idle")]
    handles = [Patch(fc=colors(i % colors.N), ec="black", label=f"micro-batch {i}")
               for i in range(1 + max(s.action.microbatch for s in spans))]
    handles += [Patch(fc="white", ec="black", hatch=HATCHES.get(op), label=words[op]) for op in "FBW" if op in ops]
    if any(s.action.stage >= len(t.spans) for t in timelines for ranks in t.spans for s in ranks):
        handles.append(Patch(fc=to_rgba(colors(0), 0.45), ec="black", label="chunk 1: the same colour, paler"))
    return handles + [Patch(fc=IDLE, label="idle")]


def draw_panels(path, rows: list[list[Panel]], title: str = "", xlabel: str = "", widths=None,
                by_op: bool = False) -> None:
    """Save a PNG of timelines in a grid: ``rows`` of :class:`Panel`, the panels of a column on one
    time axis (``widths``: the columns' relative widths); each panel's boxes drawn by
    :func:`draw_timeline` and labelled by :func:`label_boxes` (a ``summed`` panel: by
    :func:`draw_summed` and :func:`label_summed`), one legend for all; ``by_op``: coloured by op."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timelines = [panel.timeline for row in rows for panel in row]
    n_mb = 1 + max(s.action.microbatch for t in timelines for ranks in t.spans for s in ranks)
    colors = plt.get_cmap("tab20" if n_mb > 10 else "tab10")
    p, columns = max(len(t.spans) for t in timelines), len(rows[0])
    width = max(13.0, 8 * columns + 0.5) if widths is None else 18.0
    fig, axes = plt.subplots(len(rows), columns, squeeze=False, sharex="col", gridspec_kw=dict(width_ratios=widths),
                             figsize=(width, 0.6 + len(rows) * (0.42 * p + 0.75)))
    for c in range(columns):
        end = max(panel.timeline.makespan * panel.factor for panel in (row[c] for row in rows))
        for ax, panel in zip(axes[:, c], (row[c] for row in rows)):
            if panel.summed:
                draw_summed(ax, panel.timeline, panel.title, by_op)
            else:
                draw_timeline(ax, panel.timeline, panel.factor, colors, panel.title, by_op)
                ax.set_xlim(0, end)
            ax.tick_params(axis="x", labelsize=8)
        axes[-1, c].set_xlabel("% of the step: each rank's time in F, B, W and idle added up (inside: ms)"
                               if rows[-1][c].summed else xlabel, fontsize=9)
    fig.legend(handles=legend_handles(timelines, colors, by_op), loc="upper left", bbox_to_anchor=(1.0, 0.97),
               fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    measured = {}  # each label's size, measured once for the whole figure
    for axes_row, row in zip(axes, rows):
        for ax, panel in zip(axes_row, row):
            if panel.summed:
                label_summed(ax, panel.timeline, panel.factor, "ms" if panel.factor == 1e3 else "", measured)
            else:  # with two chunks the paleness says the chunk: every box its micro-batch alone
                chunks = any(s.action.stage >= len(panel.timeline.spans) for spans in panel.timeline.spans for s in spans)
                label_boxes(ax, panel.timeline, panel.factor, measured=measured,
                            words=(lambda a: str(a.microbatch)) if chunks else None)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def draw_timelines(path, executed: Timeline, ideal: Timeline, title: str = "") -> None:
    """Save a PNG: the executed timeline (top) above the ideal one (bottom, scaled to the same
    length), with their bubbles (:func:`draw_panels`)."""
    scale = executed.makespan / ideal.makespan
    draw_panels(path, [[Panel(executed, f"executed: bubble {100 * executed.bubble():.1f}%")],
                       [Panel(ideal, f"ideal: bubble {100 * ideal.bubble():.1f}%", scale)]],
                title, "seconds (ideal: the simulator's cost units, scaled to the executed step)")
