"""Write a run directory for ``python -m minidist.inspect`` (the layout is in ``load.py``).

Each rank writes its own files, so nothing is sent: ``write_trace`` the trace events it holds (plain
JSON lines), ``stream_trace`` every event of a run as it happens (the compact format, a fifth of the
bytes; memory stays flat however long the run),
``write_memory_report`` the bytes it holds.
"""
from __future__ import annotations

import json
from contextlib import contextmanager

from minidist.files import create, real_folder
from minidist.inspect.load import memory_path, trace_path
from minidist.inspect.timeline import step_window
from minidist.inspect.accounting import unique_nbytes
from minidist.inspect.spans import is_module_span, peak_held_bytes


def write_trace(run_dir, trace) -> None:
    """Save ``trace`` (one rank's) as ``run_dir/trace/rank<r>.jsonl``."""
    path = trace_path(run_dir, trace.rank)
    real_folder(path.parent)
    trace.save(path)


@contextmanager
def stream_trace(run_dir, trace):
    """Inside the block, write every event ``trace`` records (after the ones it keeps already) to
    ``run_dir/trace/rank<r>.jsonl`` as it happens (``Trace.stream``, in the compact format): the
    file :func:`write_trace` writes in the plain one, complete when the block ends, with only a
    bounded buffer in memory."""
    path = trace_path(run_dir, trace.rank)
    real_folder(path.parent)
    with trace.stream(path):
        yield path


def write_memory_report(run_dir, rank: int, rows: list[dict]) -> None:
    """Save rank ``rank``'s memory rows as ``run_dir/memory/rank<r>.json``. Each row is a dict with
    a ``label`` and byte counts (the same keys in every row), e.g. ``model_state_bytes``' dict
    with a label."""
    for row in rows:
        if "label" not in row:
            raise ValueError(f"memory row {row} has no 'label'")
    path = memory_path(run_dir, rank)
    real_folder(path.parent)
    with create(path, text=True) as f:
        json.dump({"rank": rank, "rows": rows}, f)


def model_state_bytes(model, optimizer) -> dict:
    """Bytes this rank holds in parameters, gradients and optimizer state (a plain ``Optimizer``
    with its ``state`` slots), measured from the live arrays; the keys of
    ``ZeroOptimizer.model_state_bytes``, so both fill the same memory table."""
    params = list(model.parameters())
    return {"parameters": unique_nbytes([p.data for p in params]),
            "gradients": unique_nbytes([p.grad for p in params]),
            "optimizer": unique_nbytes([a for slot in optimizer.state.values() for a in slot.values()])}


DEVICE = ("parameters", "gradients", "optimizer")  # a memory row's device columns (host, disk: elsewhere)


def step_peak_bytes(trace, held: dict) -> int:
    """The most device bytes this rank held during the last step in ``trace`` (cut by its
    "optimizer" spans, ``timeline.step_window``): the largest a module span (inspect/spans.py) saw
    of parameters, gradients and live activations, plus the optimizer state of ``held`` (a memory
    row, measured after the step; the state does not change size within it), and never less than
    ``held``'s own device total: the end of the step is a moment of it."""
    end = sum(held.get(k, 0) for k in DEVICE)
    window = step_window([trace], -1) if any(e.op == "optimizer" for e in trace.events) else None
    events = [e for e in trace.events if is_module_span(e) and (window is None or window[0] <= e.start <= window[1])]
    sampled = peak_held_bytes(events) + held.get("optimizer", 0) if events else 0
    return max(end, sampled)
