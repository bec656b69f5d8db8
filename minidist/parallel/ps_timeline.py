"""Who waits for whom: every rank's trace on one time axis, one row per rank.

Compute spans (forward, backward, optimizer, a straggler's delay) are drawn in colour, waits in
red, messages as thin grey ticks. In a synchronous parameter-server run the fast workers' rows are
mostly red while the straggler computes; in an asynchronous one they keep computing.

Under MPI each rank holds its own trace: :func:`gather_traces` brings them to one rank (as JSON
lines, ``ProcessGroup.gather_bytes``, no pickle). ``time.perf_counter`` is the system's monotonic clock on Linux,
shared by all processes of one machine, so the spans line up; ranks on several machines would need
their clocks aligned first. matplotlib is imported only when drawing (Agg, no display).
"""
from __future__ import annotations

from minidist.comm import Trace

COLORS = {"forward": "tab:blue", "backward": "tab:cyan", "optimizer": "tab:green",
          "straggler delay": "tab:purple"}
WAIT_COLOR, MESSAGE_COLOR = "tab:red", "0.6"


def gather_traces(group, trace: Trace, root: int = 0) -> list[Trace] | None:
    """Every rank's ``trace`` on ``root`` (a list in rank order); None on the other ranks. Each
    rank's events travel as JSON lines (``Trace.to_bytes``) in one ``group.gather_bytes``."""
    gathered = group.gather_bytes(trace.to_bytes(), dst=root)
    if gathered is None:
        return None
    return [trace if rank == root else Trace.from_bytes(data, rank) for rank, data in enumerate(gathered)]


def plot_timeline(traces: list[Trace], path, labels: list[str] | None = None, title: str = "") -> None:
    """Draw ``traces`` (one per rank, one shared clock) as a timeline PNG at ``path``: a row per rank
    named by ``labels`` (default "rank r"), time in milliseconds from the earliest event."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min((e.start for t in traces for e in t.events), default=0.0)
    labels = labels or [f"rank {t.rank}" for t in traces]
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(traces) + 1.2))
    for row, t in enumerate(traces):
        for e in t.events:
            start, width = 1e3 * (e.start - origin), 1e3 * e.duration
            if e.kind == "wait":
                ax.broken_barh([(start, width)], (row - 0.35, 0.7), color=WAIT_COLOR)
            elif e.kind == "compute":
                ax.broken_barh([(start, width)], (row - 0.35, 0.7), color=COLORS.get(e.op, "tab:olive"))
            elif e.kind == "p2p":
                ax.vlines(start, row - 0.45, row + 0.45, color=MESSAGE_COLOR, linewidth=0.5)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in list(COLORS.values()) + [WAIT_COLOR]]
    ax.legend(handles, list(COLORS) + ["waiting"], loc="upper right", ncol=5, fontsize=8)
    ax.set_yticks(range(len(traces)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
