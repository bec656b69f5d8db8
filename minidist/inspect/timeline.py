"""Draw one training step of every rank: compute per module, communication per mesh axis, and the
idle time between.

Two rows per rank. Compute, in three bands: on top each pass, whole (forward blue, backward orange,
weight red, optimizer green; pipeline spans are labelled with their micro-batch, F3 / B3); below it,
the same colour where the rank computed, with the time it sat blocked inside a collective it called
from that thread cut OUT (there it was communicating); at the bottom its module spans
(inspect/spans.py: embedding, h.0 ... head), thin outlined bands in a tint of their pass, named
where there is room, so they never hide the pass. Communication: one colour per mesh axis of the
call's group (dp, tp, pp, cp, ep, world; ``accounting.axis_of``), so tensor parallelism's
all-reduces and data parallelism's read apart. The grey behind them is time the rank did neither:
idle, waiting. The legend lists only what the picture holds, and every text is black or white,
whichever contrasts more with the colour under it (``colors.py``). A step is cut out of the trace
by the "optimizer" compute spans: step k runs from the end of the optimizer of step k-1 to the end
of the optimizer of step k. (For the executed-vs-ideal picture of a pipeline schedule, see
``minidist/parallel/pipeline/timeline.py``.)
"""
from __future__ import annotations

from minidist.inspect.accounting import axis_of
from minidist.inspect.colors import text_color, tint
from minidist.inspect.spans import is_module_span

COMPUTE_COLORS = {"forward": "#4e79a7", "backward": "#f28e2b", "weight": "#e15759", "optimizer": "#59a14f"}
AXIS_COLORS = {"tp": "#b07aa1", "dp": "#76b7b2", "pp": "#edc948", "cp": "#ff9da7", "ep": "#9c755f",
               "world": "#555555"}
OTHER, IDLE = "#bab0ac", "#e6e6e6"  # a compute span or axis without a colour of its own; neither computing nor sending


def step_title(step: int) -> str:
    """How a timeline names training step ``step`` (negative: from the last): "last step",
    "step 3", "2 steps before the last"."""
    if step == -1:
        return "last step"
    return f"step {step}" if step >= 0 else f"{-step - 1} step{'s' if step < -2 else ''} before the last"


def step_window(traces, step: int) -> tuple[float, float] | None:
    """(start, end) of training step ``step`` (negative: from the last) over all ranks, cut by the
    "optimizer" spans; None when the traces hold none (then draw everything)."""
    ends = []
    for t in traces:
        optimizer = [e for e in sorted(t.events, key=lambda e: e.start) if e.op == "optimizer"]
        if not optimizer:
            return None
        ends.append(optimizer)
    n_steps = min(len(o) for o in ends)
    k = step if step >= 0 else n_steps + step
    if not 0 <= k < n_steps:
        raise ValueError(f"the trace holds {n_steps} steps, there is no step {step}")
    if k == 0:
        start = min(e.start for t in traces for e in t.events if e.kind == "compute")
    else:
        start = min(o[k - 1].end for o in ends)
    return start, max(o[k].end for o in ends)


def _union(intervals) -> list[tuple[float, float]]:
    """``intervals`` (start, end) merged where they overlap, in order."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        elif end > start:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _clip(intervals, window):
    lo, hi = window
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def busy_seconds(events, window: tuple[float, float]) -> float:
    """Seconds of ``window`` covered by at least one of ``events`` (overlaps counted once)."""
    return sum(b - a for a, b in _union(_clip([(e.start, e.end) for e in events if e.kind != "data"], window)))


def blocked(events) -> list[tuple[float, float]]:
    """The intervals a rank sat inside a collective or message it called on the thread that computes:
    inside a compute span and recorded by that span's thread (calls on a communication thread,
    data parallelism's overlapped buckets, do not block it)."""
    spans = [e for e in events if e.kind == "compute" and not is_module_span(e)]
    calls = [e for e in events if e.kind not in ("compute", "data")]  # a read from disk does not block
    return _union((c.start, c.end) for c in calls
                  if any(s.thread == c.thread and s.start <= c.start and c.end <= s.end for s in spans))


def _minus(intervals, cuts) -> list[tuple[float, float]]:
    """``intervals`` with every one of ``cuts`` (merged, in order) removed."""
    out = []
    for a, b in intervals:
        for c, d in cuts:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
        if b > a:
            out.append((a, b))
    return out


def compute_seconds(events, window: tuple[float, float]) -> float:
    """Seconds of ``window`` this rank computed: covered by a compute span and not blocked in a call
    (:func:`blocked`)."""
    spans = _union(_clip([(e.start, e.end) for e in events if e.kind == "compute"], window))
    return sum(b - a for a, b in _minus(spans, blocked(events)))


def _label(e) -> str:
    """``F3`` for the forward of micro-batch 3 of a pipeline stage (B3 backward, W3 its weight
    gradients in a zero-bubble schedule), else nothing."""
    if e.group.startswith("stage") and e.op in ("forward", "backward", "weight"):
        return f"{e.op[0].upper()}{e.seq}"
    return ""


def _occurring(inside_by_rank, module: bool) -> list[str]:
    """The compute ops drawn (passes; or the passes whose modules are drawn), in legend order."""
    ops = {e.algorithm if module else e.op for inside in inside_by_rank for e in inside
           if e.kind == "compute" and is_module_span(e) == module}
    known = [op for op in COMPUTE_COLORS if op in ops]
    return known + (["other compute"] if ops - set(known) else [])


def timeline_figure(traces, window: tuple[float, float] | None = None, title: str = ""):
    """The matplotlib figure :func:`draw_run_timeline` saves. Every text drawn on a colour carries
    that colour as its gid ("on #rrggbb"), so its contrast can be checked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if window is None:
        events = [e for t in traces for e in t.events]
        window = (min(e.start for e in events), max(e.end for e in events))
    lo, hi = window
    ms = lambda t: 1e3 * (t - lo)  # noqa: E731
    inside_by_rank = [[e for e in t.events if e.end > lo and e.start < hi and e.kind != "data"]  # reads: the chrome
                      for t in traces]                                                                 # trace's data row
    axes = sorted({axis_of(e.group) for inside in inside_by_rank for e in inside if e.kind != "compute"},
                  key=lambda a: (a not in AXIS_COLORS, a))
    axis_colors = {a: AXIS_COLORS.get(a, OTHER) for a in axes}
    fig, ax = plt.subplots(figsize=(14, 1.2 + 1.1 * len(traces)))

    def text(left, width, y, s, background, size):  # centred on a box, if it fits (a 14-inch figure: ~860 pt wide)
        if width / ms(hi) * 860 >= (len(s) + 1) * 0.6 * size:
            ax.text(left + width / 2, y, s, ha="center", va="center", fontsize=size, color=text_color(background),
                    gid=f"on {background}", clip_on=True)

    ticks, names = [], []
    for r, (t, inside) in enumerate(zip(traces, inside_by_rank)):
        cuts = blocked(inside)
        y = 2 * r
        ax.barh(y + 0.5, ms(hi), left=0, height=1.9, color=IDLE)  # idle unless covered
        for e in inside:
            start, width = ms(max(e.start, lo)), ms(min(e.end, hi)) - ms(max(e.start, lo))
            if e.kind == "compute" and not is_module_span(e):
                color = COMPUTE_COLORS.get(e.op, OTHER)
                ax.barh(y - 0.3, width, left=start, height=0.3, color=color, linewidth=0)  # the whole pass
                for a, b in _minus(_clip([(e.start, e.end)], window), cuts):  # computing: not blocked in a call
                    ax.barh(y, ms(b) - ms(a), left=ms(a), height=0.3, color=color, linewidth=0)
                if _label(e):
                    text(start, width, y - 0.3, _label(e), color, 6)
            elif is_module_span(e):  # a thin band below its pass, tinted by the pass, outlined
                color = tint(COMPUTE_COLORS.get(e.algorithm, OTHER), 0.75)
                ax.barh(y + 0.31, width, left=start, height=0.26, color=color, edgecolor="#333333", linewidth=0.4)
                text(start, width, y + 0.31, "emb" if e.op == "embedding" else e.op, color, 5.5)
            else:
                ax.barh(y + 1, width, left=start, height=0.8, color=axis_colors[axis_of(e.group)],
                        edgecolor="black", linewidth=0.3)
        busy = busy_seconds(inside, window) / (hi - lo)
        computing = compute_seconds(inside, window) / (hi - lo)
        ticks += [y, y + 1]
        names += [f"rank {t.rank} compute {100 * computing:.0f}%", f"comm {100 * (busy - computing):.0f}%, "
                  f"idle {100 * (1 - busy):.0f}%"]
    ax.set_yticks(ticks, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, ms(hi))
    ax.set_xlabel("milliseconds. Compute row: the pass on top (F3: forward of micro-batch 3), full height while "
                  "computing, the top alone while blocked in a collective; its modules below, outlined. "
                  "Grey: idle", fontsize=8)
    passes, modules = _occurring(inside_by_rank, False), _occurring(inside_by_rank, True)
    entries = [(op, plt.Rectangle((0, 0), 1, 1, color=COMPUTE_COLORS.get(op, OTHER))) for op in passes]
    entries += [(f"{op} modules" if op != "other compute" else "other modules",
                 plt.Rectangle((0, 0), 1, 1, facecolor=tint(COMPUTE_COLORS.get(op, OTHER), 0.75), edgecolor="#333333",
                               linewidth=0.4)) for op in modules]
    entries += [(f"{a} comm", plt.Rectangle((0, 0), 1, 1, color=c)) for a, c in axis_colors.items()]
    if entries:
        ax.legend([h for _, h in entries], [name for name, _ in entries], loc="lower center",
                  bbox_to_anchor=(0.5, 1.0), ncol=min(10, len(entries)), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    return fig


def draw_run_timeline(path, traces, window: tuple[float, float] | None = None, title: str = "") -> None:
    """Save a PNG of ``traces`` (one per rank, clocks shared) inside ``window`` (default: all of
    it), in milliseconds from the window's start; each rank's label gives its compute, blocked
    (communicating) and idle fractions. The legend names only what is drawn; every text is black
    or white, whichever reads better on its colour (``colors.text_color``)."""
    import matplotlib.pyplot as plt

    fig = timeline_figure(traces, window, title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
