"""Waits in the main thread that a stop signal always interrupts.

Python runs a signal's handler in the main thread only, between two bytecodes. A main thread blocked
in a lock (``Event.wait()``, ``Thread.join()``, ``Future.result()``) leaves that lock early only if
the kernel hands the signal to the main thread itself. A process has other threads here: a group's
communication thread (comm/work.py), the batch reader (data/prefetch.py), MPI's own. When one of them
takes the signal, Python marks it pending and the main thread sleeps on. Then Ctrl-C or SIGTERM does
not stop a rank waiting for a collective whose peer has already stopped: the handler runs only when
the collective gives up, at the transport's deadline, minutes later. (CI saw it once in
tests/test_stopping.py; that test's job, SIGHUP to both ranks of a 2-rank run, hung 3 times in 75.)

So every wait here is a loop of short waits. After each, the main thread runs Python code again, and
a pending handler runs within :data:`WAKE` seconds. A wait that ends early costs nothing: the
loop returns as soon as the event is set, the thread has ended or the future is done.

None of these sends anything.
"""
from __future__ import annotations

import concurrent.futures
import threading

WAKE = 0.1  # seconds a wait blocks before it lets a pending signal's handler run


def until(done, wait) -> None:
    """Return once ``done()`` is true; between looks, block in ``wait(WAKE)`` (a wait that may end early)."""
    while not done():
        wait(WAKE)


def wait_event(event: threading.Event) -> None:
    """Return once ``event`` is set."""
    until(event.is_set, event.wait)


def join(thread: threading.Thread) -> None:
    """Return once ``thread`` has ended."""
    until(lambda: not thread.is_alive(), thread.join)


def result(future: concurrent.futures.Future):
    """``future``'s result once it is done (its error raised)."""
    until(future.done, lambda timeout: concurrent.futures.wait([future], timeout))
    return future.result()
