"""Asynchronous collectives: a per-group communication thread and the :class:`Work` it hands back.

``group.all_reduce(x, async_op=True)`` does not run the all-reduce: it checks the arguments, queues
the call on the group's :class:`CommStream` and returns a :class:`Work` at once. The stream's thread
runs the queued collectives one after another, in the order they were issued (like a CUDA stream,
or NCCL's one stream per communicator), while the caller goes on computing: this is how data
parallelism hides gradient all-reduces under the backward pass.

Order is what makes it safe. Every rank issues the same collectives in the same order, each group
has one stream, and a blocking collective first waits for the stream's queue to drain; so the
collectives of a group run in one order on every rank, exactly as if they were all blocking.

    work = group.all_reduce(grads, op="avg", async_op=True)   # returns at once
    loss = more_compute()                                      # overlaps the all-reduce
    work.wait()                                                # grads now hold the average

The thread exists only while the group is busy: it starts on the first submit, and once the queue
is empty it waits ``linger`` seconds for more before it ends, so a training loop reuses one thread
step after step (a new OS thread per step costs memory for good under MPICH, which keeps a few
hundred bytes per thread it has seen) and idle groups hold no threads.
"""
from __future__ import annotations

import threading
from collections import deque

from minidist.waiting import wait_event


class Work:
    """A queued collective. ``wait()`` blocks until it has run and returns its result (the array the
    blocking call would have returned), re-raising its error if it failed (e.g.
    :class:`~minidist.comm.transport.CommTimeoutError`); ``is_completed()`` polls."""

    def __init__(self, description: str):
        self.description = description
        self._done = threading.Event()
        self._result = None
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        state = "failed" if self._error else "completed" if self._done.is_set() else "pending"
        return f"Work({self.description}, {state})"

    def is_completed(self) -> bool:
        """True once the collective has run (successfully or not); never blocks."""
        return self._done.is_set()

    def wait(self):
        """Block until the collective has run; return its result or raise its error. The transport's
        deadline bounds every message, so this cannot wait forever; a stop signal interrupts it at once
        (minidist/waiting.py)."""
        wait_event(self._done)
        if self._error is not None:
            raise self._error
        return self._result

    def _run(self, fn) -> None:
        try:
            self._result = fn()
        except BaseException as e:  # noqa: BLE001 -- handed to whoever waits
            self._error = e
        finally:
            self._done.set()


class CommStream:
    """One group's queue of collectives and the thread that runs them in issue order; the thread
    ends after ``linger`` seconds without work."""

    linger = 2.0  # seconds an idle thread waits for more work: far longer than a training step

    def __init__(self, name: str):
        self.name = name
        self._queue: deque = deque()  # (fn, work), oldest first
        self._lock = threading.Lock()
        self._more = threading.Condition(self._lock)  # notified on submit, for a waiting thread
        self._thread: threading.Thread | None = None
        self._last: Work | None = None  # the most recently submitted work

    def submit(self, fn, description: str) -> Work:
        """Queue ``fn`` (a collective with its arguments bound) behind everything queued before it."""
        work = Work(description)
        with self._lock:
            self._queue.append((fn, work))
            self._last = work
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name=f"comm {self.name}", daemon=True)
                self._thread.start()
            else:
                self._more.notify()
        return work

    def synchronize(self) -> None:
        """Wait until everything submitted so far has run (errors stay with their Work)."""
        last = self._last
        if last is not None:
            wait_event(last._done)

    def _drain(self) -> None:
        """The stream's thread: run queued work in order; end when the queue has stayed empty for
        ``linger`` seconds."""
        while True:
            with self._lock:
                if not self._queue:
                    self._more.wait(self.linger)
                if not self._queue:
                    self._thread = None
                    return
                fn, work = self._queue.popleft()
            work._run(fn)
