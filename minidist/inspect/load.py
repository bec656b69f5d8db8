"""Read a run directory: what ``python -m minidist.train --trace DIR --out DIR`` left there.

The layout (``write.py`` writes it; ``trace_path`` and ``memory_path`` name the files):

    DIR/trace/rank<r>.jsonl    rank r's trace events, one per line: the trainer streams them as
                               they happen in the compact format (``Trace.stream``), ``Trace.save``
                               writes plain JSON objects; both are read (``comm/trace_events.py``
                               says how), times straight from ``time.perf_counter()``; an event
                               written before calls had labels has no "label" and reads as
                               unlabelled ("")
    DIR/memory/rank<r>.json    rank r's memory rows: {"rank": r, "rows": [{"label": ..., <bytes>...}]}
    DIR/metrics.jsonl          one JSON object per step (written by rank 0)

Which ranks form a group needs no extra file: every rank of a group takes part in every collective
on it, so the ranks whose traces name a group are its members.

Everything here is read as untrusted input, with bounds. Only regular files are read (a FIFO or a
device named like a trace is refused, never waited on). A JSON-lines file (a trace, the metrics) is
read line by line, at most :data:`MAX_LINE_BYTES` a line, and only its last bytes when it is larger
than its share of :data:`MAX_TRACE_BYTES` (or :data:`MAX_METRICS_BYTES`): the last steps, which
is what a timeline draws (a compact trace's share is a quarter: its events are shorter; read from
its middle, it decodes from the first segment header on). A line that holds no event or row (the last one, cut in half when a crash
killed the run; a garbled one; JSON nested deeper than Python's parser goes) is skipped and said
(``Run.skipped``). A folder with metrics but no trace (a run with ``--out`` and no ``--trace``) reads
as a run without traces. A run directory that cannot be read at all (missing, not a folder, neither
trace nor metrics, a file that is not a regular one, a memory report that is not one) is a
:class:`RunError` naming the file.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from minidist.comm.trace import Trace
from minidist.comm.trace_events import COMPACT_START, TraceReader
from minidist.files import kind_of
from minidist.untrusted import open_bounded, parse_json, read_json

MAX_RANKS = 1024  # trace files a run directory may hold
MAX_TRACE_BYTES = 128 << 20  # of plain trace lines read over all ranks (about 600,000 events): each file's end
COMPACT_SHARE = 4  # a compact trace is read to a quarter of that: its events are about a fifth as long
MAX_METRICS_BYTES = 32 << 20  # of metrics.jsonl read: its end
MAX_LINE_BYTES = 1 << 20  # a plain event is about 250 bytes, a compact one 50, a metrics row a few KiB
MAX_REPORT_BYTES = 16 << 20  # one memory report
RANK = r"rank(0|[1-9][0-9]{0,8})\."  # rank0.<ext> ... rank999999999.<ext>: one spelling per rank
MEMBER = re.compile(r"member-(0|[1-9][0-9]{0,8})")  # a population member's folder (train/pbt.py)


class RunError(ValueError):
    """A run directory, or one of its files, that cannot be read: the message names the file."""


def trace_path(run_dir, rank: int) -> Path:
    """Where rank ``rank``'s trace events live: ``run_dir/trace/rank<r>.jsonl``."""
    return Path(run_dir) / "trace" / f"rank{rank}.jsonl"


def memory_path(run_dir, rank: int) -> Path:
    """Where rank ``rank``'s memory rows live: ``run_dir/memory/rank<r>.json``."""
    return Path(run_dir) / "memory" / f"rank{rank}.json"


@dataclass
class Run:
    """One run directory, read: ``traces`` in rank order (none for a folder with only metrics),
    ``metrics`` (one dict per step), ``memory`` ({rank: rows}), ``skipped`` (what was not read, one
    line each: lines cut by a crash, garbled lines, the beginning of a file too large). Times are the ranks' raw ``perf_counter``
    readings (one machine: one clock)."""
    path: Path
    traces: list[Trace]
    metrics: list[dict] = field(default_factory=list)
    memory: dict[int, list[dict]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    def group_members(self) -> dict[str, list[int]]:
        """{group name: the global ranks whose traces record calls on it}, ranks sorted."""
        members: dict[str, set[int]] = {}
        for t in self.traces:
            for e in t.events:
                if e.kind != "compute":
                    members.setdefault(e.group, set()).add(t.rank)
        return {name: sorted(ranks) for name, ranks in members.items()}


def _ranked(folder: Path, extension: str) -> list[tuple[int, Path]]:
    """(rank, path) of the files ``rank<r>.<extension>`` in ``folder`` (none if it is missing), by rank."""
    if not folder.is_dir():
        return []
    pattern = re.compile(RANK + re.escape(extension))
    found = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if (m := pattern.fullmatch(entry.name)):
                found.append((int(m.group(1)), folder / entry.name))
                if len(found) > MAX_RANKS:
                    raise RunError(f"{folder} holds more than {MAX_RANKS} rank files: inspect reads at most {MAX_RANKS}")
    return sorted(found)


def population(run_dir) -> list[Path]:
    """The ``member-<k>`` folders of ``run_dir`` that hold a run (a trace folder or metrics.jsonl), by
    k: what ``--mode pbt`` leaves in its ``--trace DIR`` or ``--out DIR`` (each member's run in its
    own folder); [] for any other folder."""
    found = []
    with os.scandir(run_dir) as entries:
        for entry in entries:
            folder = Path(run_dir) / entry.name
            if (m := MEMBER.fullmatch(entry.name)) and entry.is_dir(follow_symlinks=False) and (
                    (folder / "trace").is_dir() or os.path.lexists(folder / "metrics.jsonl")):
                found.append((int(m.group(1)), folder))
                if len(found) > MAX_RANKS:
                    raise RunError(f"{run_dir} holds more than {MAX_RANKS} member folders: inspect lists at most {MAX_RANKS}")
    return [folder for _, folder in sorted(found)]


def member_summary(folder: Path, skipped: list[str]) -> tuple[int, list[dict]]:
    """(how many ranks traced, the metrics rows) of one member's run ``folder``: what a line of the
    population's list says, read without its traces' events."""
    metrics = []
    if os.path.lexists(folder / "metrics.jsonl"):
        metrics = read_json_lines(folder / "metrics.jsonl", MAX_METRICS_BYTES, lambda _: metrics_row, skipped,
                                  ("a metrics file", "row"))
    return len(_ranked(folder / "trace", "jsonl")), metrics


def _lines(f, size: int):
    """(line, ended) for each line of the next ``size`` bytes of ``f``: ``ended`` False for a last
    line without its newline; a line longer than :data:`MAX_LINE_BYTES` comes as None (skipped whole,
    never held in memory)."""
    left = size
    while left > 0:
        line = f.readline(min(left, MAX_LINE_BYTES + 1))
        if not line:
            return  # the file shrank while being read
        left -= len(line)
        if len(line) > MAX_LINE_BYTES:
            while left > 0 and not line.endswith(b"\n"):  # skip to its end, a block at a time
                line = f.readline(min(left, MAX_LINE_BYTES))
                left -= len(line)
                if not line:
                    return
            yield None, True
        else:
            yield line, line.endswith(b"\n")


def read_json_lines(path: Path, budget: int, parser, skipped: list[str], what=("a trace", "event")) -> list:
    """What ``parse(line)`` makes of each line of regular file ``path`` (blank lines aside, and lines
    it makes None of), reading at most its last ``budget`` bytes, where ``parse = parser(from_middle)``
    (``from_middle``: whether the lines read start in the middle of the file). A line ``parse``
    refuses (ValueError) is skipped; what was skipped is appended to ``skipped``, one line per kind:
    the beginning of a file over budget, an incomplete last line (a crash cut it: it starts as JSON
    does, else it is garbled), garbled lines (the first reason given). A file of garbled lines only,
    nothing read from it, is not what it should be (``what``: the file, an item of it): a
    :class:`RunError` naming it."""
    kept, garbled, first_reason, cut = [], 0, "", False
    with open_bounded(path, RunError) as f:
        size = os.fstat(f.fileno()).st_size
        parse = parser(size > budget)
        if size > budget:
            f.seek(size - budget - 1)
            partial = f.read(1) != b"\n"  # the window starts inside a line: drop that line
            skipped.append(f"{path.name}: read only its last {budget / 2**20:.1f} MiB of {size / 2**20:.1f} MiB "
                           f"(the lines before were skipped)")
            size = budget
        else:
            partial = False
        for number, (line, ended) in enumerate(_lines(f, size), 1):
            if partial:
                partial = False
                continue
            if line is not None and not line.strip():
                continue
            try:
                if line is None:
                    raise ValueError(f"longer than {MAX_LINE_BYTES >> 20} MiB")
                if (item := parse(line)) is not None:
                    kept.append(item)
            except ValueError as e:
                if not ended and line is not None and line.lstrip()[:1] in (b"{", b"["):
                    cut = True
                else:
                    garbled += 1
                    first_reason = first_reason or f"line {number}: {e}"
    if garbled and not kept:  # random bytes, a binary file: nothing in it reads as a line of one
        raise RunError(f"{path}: not {what[0]}: no {what[1]} read ({garbled} garbled line{'s' * (garbled > 1)}; "
                       f"{first_reason})"[:300])
    if garbled:
        skipped.append(f"{path.name}: skipped {garbled} garbled line{'s' * (garbled > 1)} ({first_reason})"[:300])
    if cut:
        skipped.append(f"{path.name}: skipped 1 incomplete line at the end (cut when the run stopped)")
    return kept


def _finite(v) -> bool:
    """Whether JSON value ``v`` is a number that prints and sums: an int (not a bool) or a finite float."""
    return isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2**63 or isinstance(v, float) and math.isfinite(v)


def _numbers(v) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(_finite(x) for x in v)


def metrics_row(line: bytes) -> dict:
    """One row of metrics.jsonl: an object with an integer "step", a "loss" (a number, or null for
    a non-finite one), and for a mixture of experts "expert_rows" (one number per rank) and
    "expert_load" ({block: a number per expert}); ValueError saying what is wrong otherwise."""
    row = parse_json(line)
    if not isinstance(row, dict) or not (_finite(row.get("step")) and isinstance(row["step"], int)):
        raise ValueError("not an object with an integer 'step'")
    if "loss" in row and row["loss"] is not None and not isinstance(row["loss"], (int, float)):
        raise ValueError(f"'loss' holds {row['loss']!r}"[:100])
    if "expert_load" in row and not (_numbers(row.get("expert_rows")) and isinstance(row["expert_load"], dict)
                                     and all(_numbers(load) for load in row["expert_load"].values())):
        raise ValueError("'expert_load' or 'expert_rows' is not numbers per rank and per expert")
    return row


def read_memory_report(path: Path, columns: list | None) -> tuple[list[dict], list | None]:
    """(the rows of memory report ``path``, their columns): each row an object with a text "label"
    and finite numbers, all with the columns ``columns`` (those of the reports read before, if
    any: one table holds them all). :class:`RunError`
    naming the file if it is larger than :data:`MAX_REPORT_BYTES`, not JSON, or not such rows."""
    report = read_json(path, MAX_REPORT_BYTES, "a memory report", RunError)
    rows = report.get("rows") if isinstance(report, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("label"), str) for r in rows):
        raise RunError(f"{path}: not a memory report (no \"rows\": a list of objects with a \"label\")")
    for row in rows:
        keys = ["label"] + [k for k in row if k != "label"]
        if not all(_finite(v) for k, v in row.items() if k != "label"):
            raise RunError(f"{path}: the row {row['label'][:60]!r} holds a value that is not a finite number")
        if columns is not None and keys != columns:
            raise RunError(f"{path}: the row {row['label'][:60]!r} has the columns {', '.join(keys[1:])[:200]}; "
                           f"the other rows {', '.join(columns[1:])[:200]}")
        columns = keys
    return rows, columns


def _compact(path: Path) -> bool:
    """Whether trace file ``path`` starts as the compact format does (``Trace.stream``)."""
    with open_bounded(path, RunError) as f:
        return f.read(len(COMPACT_START)) == COMPACT_START


def load_run(run_dir) -> Run:
    """Read ``run_dir`` (see the module docstring; ``Run.traces`` is empty for a folder with metrics
    and no trace). Raises FileNotFoundError when it is missing or holds neither, :class:`RunError` when a file cannot be read at all; lines that hold nothing are
    skipped and listed in ``Run.skipped``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        if run_dir.exists():
            raise RunError(f"{run_dir} is {kind_of(os.stat(run_dir).st_mode)}, not a run folder")
        raise FileNotFoundError(f"{run_dir}: no such folder (run the trainer with --trace {run_dir})")
    ranked = _ranked(run_dir / "trace", "jsonl")
    if not ranked and not os.path.lexists(run_dir / "metrics.jsonl"):
        raise FileNotFoundError(f"{run_dir} holds no trace/rank<r>.jsonl and no metrics.jsonl "
                                f"(run the trainer with --trace {run_dir} --out {run_dir})")
    skipped: list[str] = []
    traces = []
    for r, p in ranked:
        share = MAX_TRACE_BYTES // len(ranked)
        trace = Trace(r)
        trace.events = read_json_lines(p, share // COMPACT_SHARE if _compact(p) else share, TraceReader, skipped)
        traces.append(trace)
    metrics = []
    if os.path.lexists(run_dir / "metrics.jsonl"):
        metrics = read_json_lines(run_dir / "metrics.jsonl", MAX_METRICS_BYTES, lambda _: metrics_row, skipped,
                                  ("a metrics file", "row"))
        width = next((len(m["expert_rows"]) for m in metrics if "expert_load" in m), None)
        odd = sum("expert_load" in m and len(m["expert_rows"]) != width for m in metrics)
        if odd:  # the expert table averages expert_rows over the steps: one count of ranks
            skipped.append(f"metrics.jsonl: skipped {odd} row{'s' * (odd > 1)} whose expert_rows count other "
                           f"than {width} ranks")
            metrics = [m for m in metrics if "expert_load" not in m or len(m["expert_rows"]) == width]
    memory, columns = {}, None
    for r, p in _ranked(run_dir / "memory", "json"):
        memory[r], columns = read_memory_report(p, columns)
    return Run(run_dir, traces, metrics, memory, skipped)
