"""The next step's batch read in the background while this step computes.

``Prefetcher(read, steps)`` keeps one reader thread. :meth:`Prefetcher.get` returns step s's batch
(read ahead while step s - 1 computed, or read now if it was not) and asks the thread for step s + 1.
A batch is a pure function of its step (data/dataset.py), so the prefetched batches are the
synchronous ones, bitwise (tests/test_data_shards.py): only *when* the bytes are read changes.

Each :meth:`~Prefetcher.get` says how long the step waited for its batch (``wait_s``: about 0 when the
read finished in time, the whole read without prefetch) and when the read ran, which the trainer
records in the trace as ``data`` spans (train/feed.py).
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import NamedTuple

from minidist.waiting import result


class Fetched(NamedTuple):
    """A step's batch, when the step asked for it and got it, and when it was read (perf_counter s)."""
    batch: object
    asked: float
    got: float
    read_start: float
    read_end: float

    @property
    def wait_s(self) -> float:
        """How long the step waited for its batch."""
        return self.got - self.asked


class Prefetcher:
    """Batches of the steps in ``steps`` (a range), each read by ``read(step)``: one step ahead in a
    thread when ``ahead``, else when asked. Use as a context manager (the thread ends with it)."""

    def __init__(self, read, steps: range, ahead: bool = True):
        self.read, self.steps, self.ahead = read, steps, ahead
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "minidist-prefetch") if ahead else None
        self._pending: dict[int, concurrent.futures.Future] = {}
        self.reader_thread = None  # the ident of the thread that reads (the trace's data row)

    def _timed_read(self, step: int):
        self.reader_thread = threading.get_ident()
        start = time.perf_counter()
        batch = self.read(step)
        return batch, (start, time.perf_counter())

    def get(self, step: int) -> Fetched:
        """``step``'s batch and its times (:class:`Fetched`); starts reading the next step's."""
        asked = time.perf_counter()
        future = self._pending.pop(step, None)
        batch, (start, end) = result(future) if future is not None else self._timed_read(step)
        got = time.perf_counter()
        following = step + 1
        if self._pool is not None and following in self.steps and following not in self._pending:
            self._pending[following] = self._pool.submit(self._timed_read, following)
        return Fetched(batch, asked, got, start, end)

    def close(self) -> None:
        """Stop the reader thread (a read in flight finishes first; its batch is dropped)."""
        if self._pool is not None:
            for future in self._pending.values():
                future.cancel()
            self._pending.clear()
            self._pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
