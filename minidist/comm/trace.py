"""Every collective and point-to-point call, recorded.

A :class:`Trace` belongs to one rank. The group wraps each call in ``trace.record(...)``, which notes
the operation, group, algorithm, bytes, start, end and sequence number. Traces summarise per op and
export to Chrome trace JSON (open the file in https://ui.perfetto.dev).

How much stays in memory is the trace's choice: ``Trace()`` keeps every event (a test, a lesson, a
notebook: short runs that read them all afterwards); ``Trace(keep=N)`` only the last N, a ring, so a
run of any length holds the same memory (``init()`` and the trainer keep :data:`KEEP_RECENT`, enough
for the flight recorder). Whoever needs every event of a stretch asks for it while it runs:
``with trace.capture() as events`` collects them in a list, ``with trace.stream(path)`` writes them
to a file as they happen (the trainer's ``--trace DIR``).

Files come in two formats, written and read side by side in ``trace_events.py``: plain JSON lines,
one object per event (:meth:`Trace.save`, :meth:`Trace.to_bytes`), and compact lines, about a fifth
of the bytes (:meth:`Trace.stream`); :meth:`Trace.load` and :meth:`Trace.from_bytes` read both.
"""
from __future__ import annotations

import json
import threading
import time
from collections import deque
from contextlib import contextmanager

from minidist.comm.trace_events import (FIELDS, KINDS, VALID, CompactWriter, Event, TraceReader,  # noqa: F401
                                        event_dict, event_from_json, plain_line)
from minidist.files import create


PURPOSES = {  # the first word of every call site's label: why it sent what it sent
    "gradient": "gradients: reduced over replicas, completed over tp or tied copies, moved for the update",
    "parameter": "parameters or optimizer state: made the same on every replica, gathered for use, published",
    "activation": "activations and their gradients, in forward and backward",
    "metric": "a number about the step: a loss, a norm, an overflow flag, an expert's load",
    "setup": "building groups, agreeing on the run, checkpoints and exports",
}
KEEP_RECENT = 4096  # events a long run keeps in memory (init(), the trainer): a few hundred KiB per rank


def purpose_of(label: str) -> str:
    """The purpose a call site's ``label`` gives ("gradient: ZeRO reduce-scatter" -> "gradient"),
    one of :data:`PURPOSES`, or "" for a call without a label."""
    head = label.split(":", 1)[0]
    return head if head in PURPOSES else ""


class Trace:
    """The events of one rank, in the order they ended: every one (``keep=None``) or the last ``keep``.

    ``recorded`` counts every event recorded (since construction or :meth:`clear`), kept or not;
    ``last(n)`` returns the newest n kept. :meth:`capture` and :meth:`stream` see every event
    recorded while they are open, whatever ``keep`` is. Recording sends nothing."""

    def __init__(self, rank: int = 0, enabled: bool = True, keep: int | None = None):
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 0):
            raise ValueError(f"keep must be None (every event) or a count >= 0, got {keep!r}")
        self.rank = rank
        self.enabled = enabled
        self.keep = keep
        self._sinks: tuple = ()  # callables given each new event (capture, stream); replaced, never mutated
        self.events = []

    @property
    def events(self):
        """The kept events, oldest first: a list, or a ring (a ``deque``) when ``keep`` is set;
        iterate, index or :meth:`last` it (a ring does not slice)."""
        return self._events

    @events.setter
    def events(self, events) -> None:
        events = list(events)
        self.dropped = 0 if self.keep is None else max(0, len(events) - self.keep)
        self._events = events if self.keep is None else deque(events, maxlen=self.keep)

    @property
    def watched(self) -> bool:
        """Whether a :meth:`capture` or :meth:`stream` is open: someone reads every event (so work
        done only to enrich the trace, such as per-module spans, is worth doing)."""
        return bool(self._sinks)

    @property
    def recorded(self) -> int:
        """How many events were recorded: the kept ones and those the ring has dropped."""
        return len(self._events) + self.dropped

    def last(self, n: int) -> list[Event]:
        """The newest ``n`` kept events (fewer if fewer are kept), oldest first."""
        events = list(self._events)  # a copy first: another thread may record meanwhile
        return events[max(0, len(events) - n):] if n > 0 else []

    def add(self, event: Event) -> None:
        """Keep ``event`` (dropping the oldest when the ring is full) and hand it to every sink."""
        if self.keep is not None and len(self._events) >= self.keep:
            self.dropped += 1
        self._events.append(event)
        for sink in self._sinks:
            sink(event)

    @contextmanager
    def record(self, op: str, *, group: str = "world", algorithm: str = "", nbytes: int = 0,
               seq: int = 0, peer: int | None = None, kind: str = "collective", label: str = ""):
        """Time the body of the ``with`` block as one event (``label``: its call site's purpose)."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(Event(op, group, algorithm, nbytes, start, time.perf_counter(), seq, self.rank, peer, kind,
                           threading.get_ident(), label))

    @contextmanager
    def _sink(self, sink):
        """Inside the block, ``sink(event)`` is called with every event recorded."""
        self._sinks = self._sinks + (sink,)
        try:
            yield
        finally:
            self._sinks = tuple(s for s in self._sinks if s is not sink)

    @contextmanager
    def capture(self):
        """``with trace.capture() as events``: ``events`` is a list that receives every event recorded
        inside the block, however few the trace keeps (``--explain`` reads a whole step this way)."""
        events: list[Event] = []
        with self._sink(events.append):
            yield events

    @contextmanager
    def stream(self, path, flush_every: int = 256):
        """Inside the block, write this rank's events to ``path`` in the compact format
        (``trace_events.CompactWriter``: JSON lines, repeated texts as ids, times in nanoseconds;
        what :meth:`load` and ``python -m minidist.inspect`` read): first the events kept when it
        opens, then each one as it is recorded. At most ``flush_every`` events wait in the file's
        buffer, so memory stays flat and a crashed run loses at most that many; the file is complete
        when the block ends."""
        lock, unflushed, writer = threading.Lock(), [0], CompactWriter()
        with create(path, text=True) as f:  # never through a link planted at ``path``
            def write(event: Event) -> None:
                with lock:  # a communication thread may record while the main thread does; one writer's ids
                    f.write(writer.line(event))
                    unflushed[0] += 1
                    if unflushed[0] >= flush_every:
                        f.flush()
                        unflushed[0] = 0
            with self._sink(write):
                for event in self.last(len(self._events)):
                    write(event)
                yield

    def clear(self) -> None:
        """Forget the kept events and reset ``recorded`` (open captures and streams go on)."""
        self.events = []

    def summary(self) -> list[dict]:
        """Per (op, group): calls, bytes and seconds, in order of first appearance."""
        rows: dict[tuple[str, str], dict] = {}
        for e in list(self.events):  # a copy: a ring must not change under a Python loop
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
        """The events in the plain format (``trace_events.plain_line``: one JSON object per line,
        UTF-8): what :meth:`save` writes and what ranks send each other (``ProcessGroup.gather_bytes``)."""
        return "".join(plain_line(e) for e in list(self.events)).encode()

    @classmethod
    def from_bytes(cls, data: bytes, rank: int | None = None) -> "Trace":
        """The trace encoded by :meth:`to_bytes` (or written by :meth:`stream`: either format);
        ``rank`` defaults to the events' rank."""
        read = TraceReader()
        events = [e for line in data.decode().splitlines() if line.strip() and (e := read(line)) is not None]
        trace = cls(rank if rank is not None else (events[0].rank if events else 0))
        trace.events = events
        return trace

    def save(self, path) -> None:
        """Write the events as JSON lines (:meth:`to_bytes`) to ``path``."""
        with create(path) as f:
            f.write(self.to_bytes())

    @classmethod
    def load(cls, path, rank: int | None = None) -> "Trace":
        """Read a trace written by :meth:`save` or :meth:`stream`; ``rank`` defaults to the events' rank."""
        with open(path, "rb") as f:
            return cls.from_bytes(f.read(), rank)

    def to_chrome(self, origin: float | None = None) -> list[dict]:
        """Chrome trace 'complete' events (ph 'X') in microseconds: one process (pid) per rank, and
        within it one row (tid) per kind, so communication overlapping compute shows as two rows."""
        if origin is None:
            origin = min((e.start for e in self.events), default=0.0)
        out = []
        for e in list(self.events):
            args = {k: v for k, v in event_dict(e).items() if k not in ("start", "end", "op")}
            out.append(dict(name=e.op, cat=e.kind, ph="X", pid=e.rank, tid=KINDS.index(e.kind),
                            ts=(e.start - origin) * 1e6, dur=e.duration * 1e6, args=args))
        return out


def gather_traces(group, trace: Trace, root: int = 0) -> list[Trace] | None:
    """Every rank's ``trace`` on ``root``: copies, in rank order (None on the other ranks). Sends
    each rank's events as JSON lines (``Trace.to_bytes``) in one ``group.gather_bytes`` to ``root``.
    ``time.perf_counter`` is one clock for all processes of a machine, so the spans line up; ranks
    on several machines would need their clocks aligned first."""
    gathered = group.gather_bytes(trace.to_bytes(), dst=root, label="setup: every rank's trace, to the root")
    if gathered is None:
        return None
    return [Trace.from_bytes(data, rank) for rank, data in enumerate(gathered)]


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
    with create(path, text=True) as f:
        json.dump(dict(traceEvents=meta + events, displayTimeUnit="ms"), f)
