"""The processes of a job, so the launcher can end all of them.

``mpiexec`` starts in its own process group, but MPICH's hydra starts every rank in a session of its
own (``setsid``), so signalling mpiexec's group does not reach the ranks. What ties them together is
ancestry: the ranks descend from mpiexec (through ``hydra_pmi_proxy``). This module lists a process's
descendants from Linux's ``/proc`` and signals and waits for them. A process is named by its pid and
its start time, so a pid reused by an unrelated process after ours ended is never signalled.
Without ``/proc`` (macOS) the lists are empty and the launcher relies on the process group and on
mpiexec forwarding the signal.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import NamedTuple

PROC = Path("/proc")


class Process(NamedTuple):
    """A process as /proc sees it: pid, parent pid, state letter (R, S, Z, ...) and start time (ticks)."""
    pid: int
    ppid: int
    state: str
    start: int


def read_process(pid: int) -> Process | None:
    """The /proc record of ``pid``, or None when it has gone (or there is no /proc)."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (command name)": state, ppid, ... starttime
    return Process(pid, int(fields[1]), fields[0], int(fields[19]))


def all_processes() -> list[Process]:
    """Every process /proc lists (empty without /proc)."""
    found = []
    for entry in PROC.glob("[0-9]*") if PROC.is_dir() else []:
        process = read_process(int(entry.name))
        if process is not None:
            found.append(process)
    return found


def descendants(pid: int) -> list[Process]:
    """The children of ``pid``, their children, and so on (not ``pid`` itself)."""
    children = {}
    for process in all_processes():
        children.setdefault(process.ppid, []).append(process)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child.pid)
    return found


def started(pid: int, program: str | None = None) -> bool | None:
    """Whether process ``pid`` has started a process: a child of it (``program`` None), or a
    descendant running ``program`` (its ``argv[0]``: a job's rank). Read from the few small files
    ``/proc/<pid>/task/*/children`` (cheap enough to ask every few milliseconds), else from the whole
    table (:func:`descendants`); None without /proc (not known)."""
    if not PROC.is_dir():
        return None
    if not (PROC / str(os.getpid()) / "task" / str(os.getpid()) / "children").exists():  # an older kernel
        found = [p.pid for p in descendants(pid)]
        return bool(found) if program is None else any(_argv0(k) == program for k in found)
    todo = [pid]
    while todo:
        kids = _children(todo.pop())
        if kids and program is None or any(_argv0(k) == program for k in kids):
            return True
        todo += kids
    return False


def _children(pid: int) -> list[int]:
    try:
        return [int(k) for task in (PROC / str(pid) / "task").iterdir() for k in (task / "children").read_text().split()]
    except (OSError, ValueError):  # gone meanwhile
        return []


def _argv0(pid: int) -> str | None:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return None


def is_running(process: Process) -> bool:
    """Whether ``process`` (the same pid AND start time) still runs: a zombie (ended, not yet
    reaped) does not."""
    now = read_process(process.pid)
    return now is not None and now.start == process.start and now.state not in ("Z", "X")


def signal_processes(processes, signum: int) -> None:
    """Send ``signum`` to each of ``processes`` that still runs."""
    for process in processes:
        if is_running(process):
            try:
                os.kill(process.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass


def wait_gone(processes, seconds: float) -> list[Process]:
    """Wait up to ``seconds`` for ``processes`` to end; returns those still running."""
    deadline = time.monotonic() + seconds
    left = [p for p in processes if is_running(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if is_running(p)]
    return left
