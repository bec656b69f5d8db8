"""The communication table, the memory table and the metrics table of a run.

The communication table is nccl-tests' view of a whole run: one row per (op, group, label) with the
calls, bytes and time of one rank, and two bandwidths; the label is why the calls were made, as
their call site said (``<purpose>: <what>``, the purposes of ``comm.trace.PURPOSES``). algbw is
bytes / time. busbw rescales it to what each rank's link carried, so that it can be compared with
the hardware's bandwidth whatever the group size n: an all-reduce of N bytes sends 2(n-1)/n N per
rank, a reduce-scatter or all-gather (n-1)/n N, a broadcast, a reduce or a point-to-point message N.
"""
from __future__ import annotations

import math

import numpy as np

from minidist.comm.ops import bus_factor
from minidist.comm.trace import PURPOSES, purpose_of
from minidist.inspect.accounting import format_memory_table


def human_bytes(n: float) -> str:
    """``1.5 MiB``-style text for a byte count."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def comm_table(traces, members: dict[str, list[int]]) -> list[dict]:
    """One row per (op, group, label) of the communication in ``traces``, most time first.

    ``members`` maps a group name to its ranks (``Run.group_members``). A row's ``ranks`` are the
    ranks that made the op (all members for a collective, the senders for ``send``); ``calls``,
    ``bytes`` and ``seconds`` are per such rank (their mean); ``algbw`` = bytes / seconds and
    ``busbw`` = algbw x the op's factor for n = the group's size, in bytes per second (None for
    ops that move no data: barrier, split); ``label`` is the calls' label ("" for calls made
    without one, or recorded before labels existed) and ``purpose`` its first word."""
    totals: dict[tuple[str, str], dict] = {}
    for t in traces:
        for e in t.events:
            if e.kind in ("compute", "data"):  # not calls: spans, and reads from disk
                continue
            row = totals.setdefault((e.op, e.group, e.label), dict(op=e.op, group=e.group, label=e.label, ranks=set(),
                                                                    calls=0, bytes=0, seconds=0.0))
            row["ranks"].add(t.rank)
            row["calls"] += 1
            row["bytes"] += e.nbytes
            row["seconds"] += e.duration
    rows = []
    for row in totals.values():
        k, n = len(row["ranks"]), len(members[row["group"]])
        calls, nbytes, seconds = row["calls"] / k, row["bytes"] / k, row["seconds"] / k
        algbw = nbytes / seconds if nbytes and seconds > 0 else None
        factor = bus_factor(row["op"], n)
        busbw = algbw * factor if algbw is not None and factor is not None else None
        rows.append(dict(op=row["op"], group=row["group"], n=n, ranks=k, calls=calls, bytes=nbytes,
                         seconds=seconds, algbw=algbw, busbw=busbw, purpose=purpose_of(row["label"]),
                         label=row["label"]))
    return sorted(rows, key=lambda r: -r["seconds"])


def format_comm_table(rows: list[dict]) -> str:
    """:func:`comm_table` as text: time in ms, bandwidths in GB/s (1e9 bytes, as nccl-tests), then
    the label ("(unlabelled)" for calls without one)."""
    def gbs(x):
        return f"{x / 1e9:>9.3f}" if x is not None else f"{'-':>9}"

    width = max([len(r["group"]) for r in rows] + [5])
    lines = [f"{'op':<14} {'group':<{width}} {'n':>3} {'calls':>7} {'bytes':>11} {'time ms':>9} "
             f"{'algbw':>9} {'busbw':>9}   purpose: what (per rank; GB/s)"]
    for r in rows:
        calls = f"{r['calls']:.0f}" if r["calls"] == int(r["calls"]) else f"{r['calls']:.1f}"
        lines.append(f"{r['op']:<14} {r['group']:<{width}} {r['n']:>3} {calls:>7} {human_bytes(r['bytes']):>11} "
                     f"{1e3 * r['seconds']:>9.2f} {gbs(r['algbw'])} {gbs(r['busbw'])}   {r['label'] or '(unlabelled)'}")
    return "\n".join(lines)


def format_purposes(rows: list[dict]) -> str:
    """Per purpose (:data:`~minidist.comm.trace.PURPOSES`, in their order; "(unlabelled)" last) the
    calls and bytes of :func:`comm_table`'s ``rows``, all ranks together: one line."""
    totals: dict[str, list] = {p: [0.0, 0.0] for p in PURPOSES}
    for r in rows:
        total = totals.setdefault(r["purpose"] or "(unlabelled)", [0.0, 0.0])
        total[0] += r["calls"] * r["ranks"]  # a row's numbers are per rank that made the calls
        total[1] += r["bytes"] * r["ranks"]
    return "; ".join(f"{p} {human_bytes(b)} in {c:.0f} calls" for p, (c, b) in totals.items() if c)


def format_memory(memory: dict[int, list[dict]]) -> str:
    """Every rank's memory rows as one table (``format_memory_table``), labelled ``rank r: label``."""
    rows = [{**row, "label": f"rank {rank}: {row['label']}"} for rank in sorted(memory) for row in memory[rank]]
    return format_memory_table(rows) if rows else "(no memory files)"


def _cell(v) -> str:
    """A metrics value as a table cell: whole numbers as they are, large ones with thousands
    separators, small ones in scientific notation, the rest to 4 decimals; null for a non-finite
    step's null."""
    if v is None:
        return "null"
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10_000 else str(v)
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.2e}" if 0 < abs(v) < 0.01 else f"{v:.4f}"


def _number(v) -> bool:
    return v is None or isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and abs(v) < 2**63


def format_metrics(metrics: list[dict], max_rows: int = 11, max_columns: int = 8) -> str:
    """The metrics rows (``metrics.jsonl``) as a table: one row per step for at most ``max_rows``
    steps (the first, the last and evenly between), one column per number the rows hold (loss,
    val_loss, lr, grad_norm, tokens_per_s, ...; at most ``max_columns``, in the order they first
    appear; a blank cell where a step has none, as val_loss between evaluations)."""
    if not metrics:
        return "(no metrics rows)"
    columns: list[str] = []
    for row in metrics:
        columns += [k for k, v in row.items() if k != "step" and k not in columns and _number(v)]
    columns = columns[:max_columns]
    picked = sorted(set(np.linspace(0, len(metrics) - 1, min(max_rows, len(metrics))).round().astype(int)))
    names = ["step"] + ["".join(c if c.isprintable() else "?" for c in k[:20]) for k in columns]
    cells = [[_cell(metrics[i]["step"])] + [_cell(metrics[i][k]) if _number(metrics[i].get(k, "")) else ""
                                            for k in columns] for i in picked]
    widths = [max(len(n), *(len(r[j]) for r in cells)) for j, n in enumerate(names)]
    lines = ["  ".join(f"{n:>{w}}" for n, w in zip(names, widths))]
    lines += ["  ".join(f"{c:>{w}}" for c, w in zip(r, widths)) for r in cells]
    if len(picked) < len(metrics):
        lines.append(f"({len(picked)} of {len(metrics)} steps shown)")
    return "\n".join(lines)


def format_expert_load(metrics: list[dict]) -> str:
    """A mixture-of-experts run's routing, from its metrics rows: the token rows each rank's experts
    computed per step (mean over the steps; the busiest rank sets an expert-parallel step's pace),
    and the assignments per expert of each MoE block in the last step, each with max / mean."""
    rows = [m for m in metrics if "expert_load" in m]
    if not rows:
        return "(not a mixture of experts)"
    per_rank = np.mean([m["expert_rows"] for m in rows], axis=0)  # (world,)
    lines = [f"rows each rank's experts computed per step (mean of {len(rows)} steps; max/mean "
             f"{per_rank.max() / per_rank.mean():.2f}):",
             "  " + "  ".join(f"rank {r}: {n:.0f}" for r, n in enumerate(per_rank)),
             f"assignments per expert in step {rows[-1]['step']}:"]
    for block, load in rows[-1]["expert_load"].items():
        lines.append(f"  block {block}: {' '.join(f'{n:>5}' for n in load)}   max/mean {max(load) / np.mean(load):.2f}")
    return "\n".join(lines)
