"""One Chrome trace for the whole run: every rank a process, its compute / collective / p2p rows
threads, each call's label (why its call site sent it) among its args. Open ``RUN_DIR/trace.json``
in https://ui.perfetto.dev (or chrome://tracing)."""
from __future__ import annotations

from pathlib import Path

from minidist.comm.trace import write_chrome_trace


def merge_chrome_trace(run, path=None) -> Path:
    """Write the traces of ``run`` (a ``load.Run``) as one Chrome trace JSON at ``path`` (default
    ``RUN_DIR/trace.json``) and return the path. Raw clocks (one machine) keep the ranks aligned
    in time."""
    path = Path(path) if path is not None else run.path / "trace.json"
    write_chrome_trace(run.traces, path, shared_clock=True)
    return path
