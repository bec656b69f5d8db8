"""Read a run directory: what ``python -m minidist.train --trace DIR --out DIR`` left there.

The layout (``write.py`` writes it; ``trace_path`` and ``memory_path`` name the files):

    DIR/trace/rank<r>.jsonl    rank r's trace events, one JSON object per line (``Trace.save``; the
                               trainer streams them as they happen, ``Trace.stream``), times
                               straight from ``time.perf_counter()``; an event written before
                               calls had labels has no "label" and reads as unlabelled ("")
    DIR/memory/rank<r>.json    rank r's memory rows: {"rank": r, "rows": [{"label": ..., <bytes>...}]}
    DIR/metrics.jsonl          one JSON object per step (written by rank 0)

Which ranks form a group needs no extra file: every rank of a group takes part in every collective
on it, so the ranks whose traces name a group are its members.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from minidist.comm.trace import Trace


def trace_path(run_dir, rank: int) -> Path:
    """Where rank ``rank``'s trace events live: ``run_dir/trace/rank<r>.jsonl``."""
    return Path(run_dir) / "trace" / f"rank{rank}.jsonl"


def memory_path(run_dir, rank: int) -> Path:
    """Where rank ``rank``'s memory rows live: ``run_dir/memory/rank<r>.json``."""
    return Path(run_dir) / "memory" / f"rank{rank}.json"


@dataclass
class Run:
    """One run directory, read: ``traces`` in rank order, ``metrics`` (one dict per step),
    ``memory`` ({rank: rows}). Times are the ranks' raw ``perf_counter`` readings (one machine:
    one clock)."""
    path: Path
    traces: list[Trace]
    metrics: list[dict] = field(default_factory=list)
    memory: dict[int, list[dict]] = field(default_factory=dict)

    def group_members(self) -> dict[str, list[int]]:
        """{group name: the global ranks whose traces record calls on it}, ranks sorted."""
        members: dict[str, set[int]] = {}
        for t in self.traces:
            for e in t.events:
                if e.kind != "compute":
                    members.setdefault(e.group, set()).add(t.rank)
        return {name: sorted(ranks) for name, ranks in members.items()}


def _ranked(paths, pattern: str) -> list[tuple[int, Path]]:
    """(rank, path) for the paths whose name matches ``pattern`` (one group: the rank), by rank."""
    found = [(int(m.group(1)), p) for p in paths if (m := re.fullmatch(pattern, p.name))]
    return sorted(found)


def load_run(run_dir) -> Run:
    """Read ``run_dir`` (see the module docstring). Raises FileNotFoundError when it holds no trace."""
    run_dir = Path(run_dir)
    ranked = _ranked((run_dir / "trace").glob("rank*.jsonl"), r"rank(\d+)\.jsonl")
    if not ranked:
        raise FileNotFoundError(f"{run_dir} holds no trace/rank<r>.jsonl (run the trainer with --trace {run_dir})")
    traces = [Trace.load(p, rank=r) for r, p in ranked]
    metrics = []
    if (run_dir / "metrics.jsonl").exists():
        with open(run_dir / "metrics.jsonl") as f:
            metrics = [json.loads(line) for line in f if line.strip()]
    memory = {}
    for r, p in _ranked((run_dir / "memory").glob("rank*.json"), r"rank(\d+)\.json"):
        with open(p) as f:
            memory[r] = json.load(f)["rows"]
    return Run(run_dir, traces, metrics, memory)
