"""Every collective and point-to-point call, recorded.

A :class:`Trace` belongs to one rank. The group wraps each call in ``trace.record(...)``, which notes
the operation, group, algorithm, bytes, start, end and sequence number. Traces summarise per op and
export to Chrome trace JSON (open the file in https://ui.perfetto.dev).
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass


KINDS = ("compute", "collective", "p2p", "wait")  # "wait": blocked on a peer (parameter server)


@dataclass
class Event:
    """One recorded call. Times are seconds from ``time.perf_counter()``."""
    op: str
    group: str
    algorithm: str
    nbytes: int
    start: float
    end: float
    seq: int
    rank: int
    peer: int | None = None
    kind: str = "collective"  # one of KINDS

    @property
    def duration(self) -> float:
        return self.end - self.start


class Trace:
    """The events of one rank, in the order they ended."""

    def __init__(self, rank: int = 0, enabled: bool = True):
        self.rank = rank
        self.enabled = enabled
        self.events: list[Event] = []

    @contextmanager
    def record(self, op: str, *, group: str = "world", algorithm: str = "", nbytes: int = 0,
               seq: int = 0, peer: int | None = None, kind: str = "collective"):
        """Time the body of the ``with`` block as one event."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.events.append(Event(op, group, algorithm, nbytes, start, time.perf_counter(), seq,
                                     self.rank, peer, kind))

    def clear(self) -> None:
        self.events.clear()

    def summary(self) -> list[dict]:
        """Per (op, group): calls, bytes and seconds, in order of first appearance."""
        rows: dict[tuple[str, str], dict] = {}
        for e in self.events:
            row = rows.setdefault((e.op, e.group), dict(op=e.op, group=e.group, calls=0, bytes=0, seconds=0.0))
            row["calls"] += 1
            row["bytes"] += e.nbytes
            row["seconds"] += e.duration
        return list(rows.values())

    def format_summary(self) -> str:
        """The summary as a text table, one line per (op, group)."""
        lines = [f"rank {self.rank}: {'op':<16} {'group':<10} {'calls':>6} {'bytes':>12} {'ms':>10}"]
        for r in self.summary():
            lines.append(f"rank {self.rank}: {r['op']:<16} {r['group']:<10} {r['calls']:>6} "
                         f"{r['bytes']:>12} {1e3 * r['seconds']:>10.3f}")
        return "\n".join(lines)

    def to_bytes(self) -> bytes:
        """The events as JSON lines (one event per line, UTF-8): what :meth:`save` writes and what
        ranks send each other (``ProcessGroup.gather_bytes``)."""
        return "".join(json.dumps(asdict(e)) + "\n" for e in self.events).encode()

    @classmethod
    def from_bytes(cls, data: bytes, rank: int | None = None) -> "Trace":
        """The trace encoded by :meth:`to_bytes`; ``rank`` defaults to the events' rank."""
        events = [Event(**json.loads(line)) for line in data.decode().splitlines() if line.strip()]
        trace = cls(rank if rank is not None else (events[0].rank if events else 0))
        trace.events = events
        return trace

    def save(self, path) -> None:
        """Write the events as JSON lines (:meth:`to_bytes`) to ``path``."""
        with open(path, "wb") as f:
            f.write(self.to_bytes())

    @classmethod
    def load(cls, path, rank: int | None = None) -> "Trace":
        """Read a trace written by :meth:`save`; ``rank`` defaults to the events' rank."""
        with open(path, "rb") as f:
            return cls.from_bytes(f.read(), rank)

    def to_chrome(self, origin: float | None = None) -> list[dict]:
        """Chrome trace 'complete' events (ph 'X') in microseconds: one process (pid) per rank, and
        within it one row (tid) per kind, so communication overlapping compute shows as two rows."""
        if origin is None:
            origin = min((e.start for e in self.events), default=0.0)
        out = []
        for e in self.events:
            args = {k: v for k, v in asdict(e).items() if k not in ("start", "end", "op")}
            out.append(dict(name=e.op, cat=e.kind, ph="X", pid=e.rank, tid=KINDS.index(e.kind),
                            ts=(e.start - origin) * 1e6, dur=e.duration * 1e6, args=args))
        return out


def write_chrome_trace(traces: list[Trace], path, shared_clock: bool = False) -> None:
    """Merge the traces of several ranks into one Chrome trace JSON file at ``path``.

    perf_counter clocks of different processes are not aligned, so by default each rank's events are
    shifted to start at 0. In-process ranks share one clock: pass ``shared_clock=True`` to keep it.
    """
    origin = min((e.start for t in traces for e in t.events), default=0.0) if shared_clock else None
    events = []
    for t in traces:
        events.extend(t.to_chrome(origin))
    meta = [dict(name="process_name", ph="M", pid=t.rank, args=dict(name=f"rank {t.rank}")) for t in traces]
    meta += [dict(name="thread_name", ph="M", pid=t.rank, tid=i, args=dict(name=kind))
             for t in traces for i, kind in enumerate(KINDS)]
    with open(path, "w") as f:
        json.dump(dict(traceEvents=meta + events, displayTimeUnit="ms"), f)
