"""Draw one training step of every rank: compute, communication by op, and the idle time between.

Two rows per rank: compute (forward blue, backward orange, optimizer green; pipeline spans are
labelled with their micro-batch, F3 / B3) and communication (one colour per op). The grey behind
them is time the rank did neither: idle, waiting. A step is cut out of the trace by the
"optimizer" compute spans: step k runs from the end of the optimizer of step k-1 to the end of
the optimizer of step k. (For the executed-vs-ideal picture of a pipeline schedule, see
``minidist/parallel/pipeline/timeline.py``.)
"""
from __future__ import annotations

COMPUTE_COLORS = {"forward": "#4e79a7", "backward": "#f28e2b", "weight": "#e15759", "optimizer": "#59a14f"}


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


def busy_seconds(events, window: tuple[float, float]) -> float:
    """Seconds of ``window`` covered by at least one of ``events`` (overlaps counted once)."""
    lo, hi = window
    spans = sorted((max(e.start, lo), min(e.end, hi)) for e in events if e.end > lo and e.start < hi)
    busy, reach = 0.0, lo
    for start, end in spans:
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def _label(e) -> str:
    """``F3`` for the forward of micro-batch 3 of a pipeline stage (B3 backward, W3 its weight
    gradients in a zero-bubble schedule), else nothing."""
    if e.group.startswith("stage") and e.op in ("forward", "backward", "weight"):
        return f"{e.op[0].upper()}{e.seq}"
    return ""


def draw_run_timeline(path, traces, window: tuple[float, float] | None = None, title: str = "") -> None:
    """Save a PNG of ``traces`` (one per rank, clocks shared) inside ``window`` (default: all of
    it), in milliseconds from the window's start; each rank's label gives its idle fraction."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if window is None:
        events = [e for t in traces for e in t.events]
        window = (min(e.start for e in events), max(e.end for e in events))
    lo, hi = window
    ops = sorted({e.op for t in traces for e in t.events if e.kind != "compute" and e.end > lo and e.start < hi})
    palette = plt.get_cmap("tab10")
    op_colors = {op: palette(3 + i % 7) for i, op in enumerate(ops)}  # tab10's 0-2 are the compute colours
    fig, ax = plt.subplots(figsize=(13, 1.0 + 0.9 * len(traces)))
    ticks, names = [], []
    for r, t in enumerate(traces):
        inside = [e for e in t.events if e.end > lo and e.start < hi]
        y = 2 * r
        ax.barh(y + 0.5, 1e3 * (hi - lo), left=0, height=1.9, color="#e6e6e6")  # idle unless covered
        for e in inside:
            start, width = 1e3 * (max(e.start, lo) - lo), 1e3 * (min(e.end, hi) - max(e.start, lo))
            compute = e.kind == "compute"
            color = COMPUTE_COLORS.get(e.op, "#bab0ac") if compute else op_colors[e.op]
            ax.barh(y if compute else y + 1, width, left=start, height=0.8, color=color, edgecolor="black",
                    linewidth=0.3)
            if _label(e) and width > 1e3 * (hi - lo) * 0.015:
                ax.text(start + width / 2, y, _label(e), ha="center", va="center", fontsize=7, color="white")
        idle = 1.0 - busy_seconds(inside, window) / (hi - lo)
        ticks += [y, y + 1]
        names += [f"rank {t.rank} compute  (idle {100 * idle:.0f}%)", "communication"]
    ax.set_yticks(ticks, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1e3 * (hi - lo))
    ax.set_xlabel("milliseconds (grey: neither computing nor communicating)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in list(COMPUTE_COLORS.values()) + list(op_colors.values())]
    ax.legend(handles, list(COMPUTE_COLORS) + ops, loc="lower center", bbox_to_anchor=(0.5, 1.0),
              ncol=min(8, len(handles)), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
