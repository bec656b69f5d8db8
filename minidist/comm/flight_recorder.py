"""The flight recorder: when a collective times out, print what this rank did last.

A hang in a distributed job is almost always one rank that called something different (skipped a
collective, called them in another order, died). The timeout error names the operation and the peer
that never answered; the flight recorder adds the context: this rank's last N recorded calls, oldest
first, the one that timed out marked. Put the dumps of all ranks side by side and the rank whose
sequence numbers stop early, or whose ops differ, is the culprit (PyTorch's NCCL flight recorder
does the same for NCCL).

    recorder = FlightRecorder(last=32, directory="flight")
    try:
        train(...)
    except CommTimeoutError as e:
        recorder.dump(group.trace, e)     # stderr, and flight/flight_rank<r>.txt
        raise

The header is the error itself: for a collective, its census (``census.py``) already names the ranks
that never arrived, so each dump says who the culprit is, not only whom this rank waited for.

It reads the rank's :class:`~minidist.comm.trace.Trace` (every call is recorded when it ends, the
failed one included), so it costs nothing until it dumps.
"""
from __future__ import annotations

import sys

from minidist.files import create, real_folder


class FlightRecorder:
    """Dumps the last ``last`` events of a rank's trace when a collective fails; to ``stream``
    (default stderr) and, with ``directory``, to ``directory/flight_rank<r>.txt``."""

    def __init__(self, last: int = 32, directory=None, stream=None):
        self.last, self.directory, self.stream = last, directory, stream

    def dump(self, trace, error=None) -> str:
        """Write and return the table of ``trace``'s last events, headed by ``error`` (e.g. a
        CommTimeoutError, whose op/seq/group mark the call that failed)."""
        text = format_events(trace, error, self.last)
        print(text, file=self.stream or sys.stderr, flush=True)
        if self.directory is not None:
            with create(real_folder(self.directory) / f"flight_rank{trace.rank}.txt", text=True) as f:
                f.write(text + "\n")
        return text


def format_events(trace, error=None, last: int = 32) -> str:
    """``trace``'s last ``last`` events as a table (seq, op, kind, group, peer, bytes, start and end
    in ms relative to the first event shown, duration), the failed call marked with ``<-- TIMED OUT``."""
    events = trace.last(last)  # the trace may keep only its newest calls: a ring does not slice
    origin = events[0].start if events else 0.0
    failed = (getattr(error, "op", None), getattr(error, "seq", None), getattr(error, "group", None))
    lines = [f"flight recorder, rank {trace.rank}: last {len(events)} of {trace.recorded} calls"
             + (f" before: {type(error).__name__}: {error}" if error is not None else ""),
             f"{'seq':>6} {'op':<15} {'kind':<10} {'group':<16} {'peer':>4} {'bytes':>12} "
             f"{'start ms':>10} {'end ms':>10} {'ms':>9}"]
    for e in events:
        mark = "  <-- TIMED OUT" if (e.op, e.seq, e.group) == failed else ""
        peer = "-" if e.peer is None else str(e.peer)
        lines.append(f"{e.seq:>6} {e.op:<15} {e.kind:<10} {e.group:<16} {peer:>4} {e.nbytes:>12} "
                     f"{1e3 * (e.start - origin):>10.3f} {1e3 * (e.end - origin):>10.3f} "
                     f"{1e3 * e.duration:>9.3f}{mark}")
    return "\n".join(lines)
