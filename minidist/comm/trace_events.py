"""A trace event, and how events are written to a file and read back: both formats, writer beside reader.

**Plain** (``Trace.save`` and ``Trace.to_bytes``: what ranks send each other, what a test or a lesson
writes): one JSON object per line, every field by name (:func:`plain_line`)::

    {"op": "all_reduce", "group": "tp[dp0,pp0]", "algorithm": "ring", "nbytes": 4096, "start": 41525.4977, ...}

**Compact** (``Trace.stream``: the trainer's ``--trace DIR``, hundreds of thousands of events a run):
one JSON array per line, the values in :data:`FIELDS` order, about a fifth of the bytes
(:class:`CompactWriter`)::

    {"minidist trace": "compact 1", "t0": 41525497750677, "fields": ["op", ...], "about": "..."}
    [[0,"all_reduce"],[1,"tp[dp0,pp0]"],[2,"ring"],4096,0,1204,7,0,null,[3,"collective"],[4,140671446104960],...]
    [0,1,2,4096,1830442,1187,8,0,null,3,4,5]

- a text field (:data:`REPEATED`: op, group, algorithm, kind, thread, label; the few values a run
  repeats) is written once per segment as ``[id, value]``, then as its ``id``;
- start and end are whole nanoseconds (what ``time.perf_counter()`` reads): start after the
  segment's ``t0``, end after start. A time that is not a whole number of nanoseconds keeps its
  seconds (both times written as floats), so every event reads back equal to the one written;
- every :data:`SEGMENT_BYTES` a new segment starts (a header line; the ids forgotten), so the end
  of a file, read alone, decodes from its first header on.

Each line stands alone given its segment's header and the lines that defined its ids: a line lost
(a crash cut the last one, an editor garbled one) loses its event and the ids it defined, and an
event using one of those says so ("id 5 is not defined"), never reads as another event.
:class:`TraceReader` reads both formats, mixed in one file too.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields

from minidist.untrusted import parse_json

KINDS = ("compute", "collective", "p2p", "wait", "data")  # "wait": blocked on a peer (parameter server); "data": a
# batch read from disk (on the reader thread) and the step's wait for it (train/feed.py)


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
    thread: int | None = None  # the recording thread's ident: a call on the thread of a compute span blocked it
    label: str = ""  # why the call site sent it, "<purpose>: <what>" (PURPOSES); "" when the caller gave none

    @property
    def duration(self) -> float:
        return self.end - self.start


FIELDS = tuple(f.name for f in fields(Event))
REPEATED = ("op", "group", "algorithm", "kind", "thread", "label")  # compact: written once per segment, then an id
HEADER, VERSION = "minidist trace", "compact 1"  # a compact segment's header: {"minidist trace": "compact 1", ...}
COMPACT_START = json.dumps({HEADER: VERSION})[:-1].encode()  # the first bytes of a compact file
SEGMENT_BYTES = 1 << 15  # a compact file starts a new segment after this many bytes (inspect reads a file's end)
_REPEATED_AT = [FIELDS.index(name) for name in REPEATED]
_OTHERS_AT = [i for i, name in enumerate(FIELDS) if name not in REPEATED]
_START, _END = FIELDS.index("start"), FIELDS.index("end")
ABOUT = ("one event per line, the values in 'fields' order; a repeated field is [id, value] the first time in a "
         "segment, then id; start: nanoseconds after t0, end: nanoseconds after start (or both seconds, floats)")


def event_dict(e: Event) -> dict:
    """``e`` as a flat dict, field by field (``dataclasses.asdict`` without its deep copies)."""
    return {name: getattr(e, name) for name in FIELDS}


def plain_line(e: Event) -> str:
    """``e`` as one line of the plain format: a JSON object, every field by name, and a newline."""
    return json.dumps(event_dict(e)) + "\n"


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2**63


def _time(v) -> bool:  # a perf_counter reading: finite, and within 30,000 years of its origin
    return (_whole(v) or isinstance(v, float) and math.isfinite(v)) and abs(v) <= 1e12


VALID = {  # what each field of an event read from JSON may hold
    "op": lambda v: isinstance(v, str), "group": lambda v: isinstance(v, str),
    "algorithm": lambda v: isinstance(v, str), "nbytes": lambda v: _whole(v) and v >= 0, "start": _time,
    "end": _time, "seq": _whole, "rank": _whole, "peer": lambda v: v is None or _whole(v),
    "kind": lambda v: v in KINDS, "thread": lambda v: v is None or _whole(v), "label": lambda v: isinstance(v, str),
}


def event_from_dict(d: dict) -> Event:
    """The :class:`Event` whose fields ``d`` names; ValueError saying what is wrong when a field is
    missing or unknown, or holds what it cannot (:data:`VALID`: a time that is not finite...)."""
    missing, unknown = sorted(set(FIELDS[:8]) - d.keys()), sorted(d.keys() - set(FIELDS))
    if missing or unknown:
        raise ValueError(f"{'no field' if missing else 'an unknown field'} {(missing or unknown)[0][:40]!r}")
    for name, value in d.items():
        if not VALID[name](value):
            raise ValueError(f"field {name!r} holds {value!r}"[:200])
    return Event(**d)


def event_from_json(line) -> Event:
    """The :class:`Event` in one line of the plain format (str or bytes); ValueError saying what is
    wrong when it holds none: not JSON (nested too deep included), not an object, or not an event
    (:func:`event_from_dict`)."""
    d = parse_json(line)
    if not isinstance(d, dict):
        raise ValueError(f"a JSON {type(d).__name__}, not an event object")
    return event_from_dict(d)


def _ns(t) -> int | None:
    """``t`` seconds as whole nanoseconds when they read back as exactly ``t``, else None."""
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or abs(t) > 1e12:
        return None
    ns = round(t * 1e9)
    return ns if ns / 1e9 == t else None


class CompactWriter:
    """Events as compact lines (the module docstring): ``writer.line(event)`` is the text to append
    for ``event``: its line, after a new segment's header when the segment is full."""

    def __init__(self, segment_bytes: int | None = None):
        self.segment_bytes = SEGMENT_BYTES if segment_bytes is None else segment_bytes
        self.written = self.segment_bytes  # the bytes of the current segment: "full", so the first event opens one
        self.ids: dict = {}
        self.t0 = 0

    def line(self, e: Event) -> str:
        start, end = _ns(e.start), _ns(e.end)
        head = ""
        if self.written >= self.segment_bytes:
            self.ids, self.t0, self.written = {}, start if start is not None else 0, 0
            head = json.dumps({HEADER: VERSION, "t0": self.t0, "fields": FIELDS, "about": ABOUT}) + "\n"
        values = []
        for name in FIELDS:
            value = getattr(e, name)
            if name in REPEATED:
                key = (type(value), value)
                if key not in self.ids:
                    self.ids[key] = len(self.ids)
                    value = [self.ids[key], value]
                else:
                    value = self.ids[key]
            elif name == "start":
                value = start - self.t0 if start is not None and end is not None else e.start
            elif name == "end":
                value = end - start if start is not None and end is not None else e.end
            values.append(value)
        text = head + json.dumps(values, separators=(",", ":")) + "\n"
        self.written += len(text)
        return text


class TraceReader:
    """Reads a trace file's lines, either format, one at a time: ``reader(line)`` is the
    :class:`Event` on the line (str or bytes), or None for a compact segment's header; ValueError
    saying what is wrong with a line that holds neither. ``from_middle``: the lines are a file's end,
    read alone; compact events before its first header are passed over (None), their ids unknown."""

    def __init__(self, from_middle: bool = False):
        self.from_middle = from_middle
        self.t0: int | None = None  # the current segment's; None before the first header
        self.ids: dict = {}  # the current segment's: id -> value
        self.checked: dict = {}  # id -> the indices of the fields its value was found valid for

    def __call__(self, line) -> Event | None:
        d = parse_json(line)
        if isinstance(d, dict) and HEADER in d:
            if d[HEADER] != VERSION or not _whole(d.get("t0")):
                raise ValueError(f"a trace header of an unknown format ({str(d[HEADER])[:40]!r}) or without t0")
            self.t0, self.ids, self.checked = d["t0"], {}, {}
            return None
        if isinstance(d, dict):
            return event_from_dict(d)
        if not isinstance(d, list):
            raise ValueError(f"a JSON {type(d).__name__}, not an event")
        if self.t0 is None:
            if self.from_middle:
                return None
            raise ValueError("a compact event before any trace header")
        return self._compact(d)

    def _compact(self, values: list) -> Event:
        """The event of a compact line's values, each checked (:data:`VALID`; a repeated field's
        value once per id and field: the ids of a segment repeat thousands of times). The ids the
        line defines count from the next line on, and only if the whole line holds an event."""
        if len(values) != len(FIELDS):
            raise ValueError(f"{len(values)} values, not the {len(FIELDS)} fields of an event")
        out, new = list(values), {}
        for i in _REPEATED_AT:
            v = values[i]
            if isinstance(v, list) and len(v) == 2 and _whole(v[0]):
                new[v[0]], v = (v[1], set()), v[0]
            elif not (_whole(v) and (v in new or v in self.ids)):
                raise ValueError(f"field {FIELDS[i]!r} holds {v!r}: not an id defined before in its segment"[:200])
            out[i], checked = new[v] if v in new else (self.ids[v], self.checked[v])
            if i not in checked:
                if not VALID[FIELDS[i]](out[i]):
                    raise ValueError(f"field {FIELDS[i]!r} holds {out[i]!r}"[:200])
                checked.add(i)
        if _whole(out[_START]) and _whole(out[_END]):
            out[_START], out[_END] = (self.t0 + out[_START]) / 1e9, (self.t0 + out[_START] + out[_END]) / 1e9
        for i in _OTHERS_AT:
            if not VALID[FIELDS[i]](out[i]):
                raise ValueError(f"field {FIELDS[i]!r} holds {out[i]!r}"[:200])
        for k, (value, checked) in new.items():
            self.ids[k], self.checked[k] = value, checked
        return Event(*out)
