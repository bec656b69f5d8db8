"""A stop signal ends a run at once and quietly: Ctrl-C (SIGINT), ``kill`` (SIGTERM), a closed terminal (SIGHUP).

Left to Python, Ctrl-C under ``mpiexec`` prints a ``KeyboardInterrupt`` traceback from every rank, and
SIGTERM or SIGHUP kill each rank outright, which MPICH's ``mpiexec`` reports as a "BAD TERMINATION" of
the application. Instead the entry point (``main`` in train/entry.py) holds :class:`Stopping` around
the run: the first stop signal raises :class:`Stopped` in the main thread wherever it is (a wait on a
peer polls in Python, and a wait for another thread wakes every 0.1 s, minidist/waiting.py; so it is
interrupted at once, whichever thread the kernel gave the signal to) and later ones are ignored; the
run's ``with`` blocks unwind (its folders' locks released, metrics and trace files closed), rank 0
prints one line (:func:`stop_line`), and every rank exits with status 128 + the signal's number, as a
shell reports a process a signal ended::

    python -m minidist.train: stopped by SIGINT after 37 of 800 steps; the newest checkpoint is
    ckpt/step-000030: --resume continues from it

What MPICH's ``mpiexec`` (hydra) does with the signals and the ranks' exits, and so what a job shows:

- SIGINT (Ctrl-C reaches ``mpiexec``, the terminal's foreground process; each rank runs in a session
  of its own): hydra forwards it to every rank and first prints two lines of its own, which no rank
  can prevent: ``[mpiexec@host] Sending Ctrl-C to processes as requested`` and ``[mpiexec@host] Press
  Ctrl-C again to force abort`` (a second Ctrl-C ends ``mpiexec`` at once with status 1).
- SIGTERM: forwarded to every rank, silently.
- The job's status is the bitwise OR of its ranks' wait statuses: every rank exits with the same
  128 + n, so ``mpiexec`` does too. A rank a signal killed instead makes hydra print its
  "BAD TERMINATION ... This typically refers to a problem with your application" banner and exit with
  the signal's number; that is why each rank exits rather than dying of the signal.
- SIGHUP to ``mpiexec`` (its terminal closed) is hydra's to handle: usually ``mpiexec`` dies of it
  (status 128 + 1, as the shell says) and its proxies then SIGKILL the ranks, so nothing is printed,
  by hydra or by a rank; once in a test run the job trained on instead. SIGHUP sent to the ranks themselves (a batch system, ``python -m minidist.run``)
  stops them like SIGTERM.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
from pathlib import Path

import numpy as np

from minidist.checkpoint.format import SaveStopped
from minidist.checkpoint.reader import latest_valid
from minidist.comm.transport import CommTimeoutError
from minidist.train.population import POPULATION

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """A stop signal arrived; ``status`` is the exit status it asks for, 128 + its number. A
    BaseException, like KeyboardInterrupt, so no ``except Exception`` on the way out catches it."""

    def __init__(self, signum: int):
        self.signum, self.status = signum, 128 + signum
        super().__init__(signal.Signals(signum).name)


def stop_signal(error: BaseException | None) -> int:
    """The number of the stop signal that ``error`` (an exception ending a run, or None) stands
    for: a :class:`Stopped`, or a save a peer's stop interrupted (SaveStopped); 0 for anything else."""
    return error.signum if isinstance(error, (Stopped, SaveStopped)) else 0


def as_stop(error: BaseException) -> Stopped:
    """``error`` as this rank's stop: a :class:`Stopped` as it is; a save that a peer's stop signal
    interrupted (SaveStopped, writer.py: the peer was stopped first, the same signal on its way here)
    as that signal's stop, after which the stop signals are ignored, as after the first one (in the
    main thread)."""
    if isinstance(error, Stopped):
        return error
    _ignore_stop_signals()
    return Stopped(error.signum)


class Stopping:
    """What the line a stop prints needs: ``done``, the steps the run has finished (None before the
    first), which the training loop sets, and ``rank``, this process's (the entry point sets it).
    Inside ``with Stopping():`` (in the main thread: Python runs signal handlers there) the first of
    :data:`STOP_SIGNALS` raises :class:`Stopped` and later ones are ignored; the handlers before it
    come back at the end. Sends nothing."""

    def __init__(self, rank: int = 0):
        self.done, self.rank, self.previous = None, rank, {}
        self._deferring, self._pending = False, None

    def __enter__(self) -> "Stopping":
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._stop) for s in STOP_SIGNALS}
        return self

    def mpi_started(self, rank: int) -> None:
        """MPI has started: this process is its ``rank``, and the stop signals are taken back from
        whatever ``MPI_Init`` installed for them (the pip ``mpich`` wheel's UCX takes SIGHUP as its
        debugging signal, and then ignores it)."""
        self.rank = rank
        for s in self.previous:
            signal.signal(s, self._stop)

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _stop(self, signum, frame):
        _ignore_stop_signals()
        if self._deferring:
            self._pending = signum  # raised when the start-up's splits are made (deferred)
            return
        raise Stopped(signum)

    @contextlib.contextmanager
    def deferred(self):
        """A block in which a stop signal is held, and raised when the block ends: a run's start-up,
        whose communicator splits are MPI's own collectives, with no deadline and no way to leave one.
        Were a rank to stop before a split while its peers had entered it, they would wait in it for
        good; held, every rank makes every split, then all stop at once. Nested blocks hold until the
        outermost ends."""
        outer, self._deferring = self._deferring, True
        try:
            yield
        finally:
            self._deferring = outer
        if not outer and self._pending is not None:
            signum, self._pending = self._pending, None
            raise Stopped(signum)

    @contextlib.contextmanager
    def agreed(self, world):
        """A :meth:`deferred` block that every rank of ``world`` enters, or none: before a collective
        with no deadline that no rank can leave (MPI_Comm_spawn). A stop signal pending on any rank
        stops every rank here (:class:`Stopped`, the largest pending signal's); one that comes inside
        waits for the block's end. Sends one all-reduce (max) of one int64: the pending signal's number
        (0: none). A rank whose peer stopped before it sent (its all-reduce fails) and has a stop of its
        own pending stops with it."""
        with self.deferred():
            pending = np.array([self._pending or 0], np.int64)  # (1,)
            try:
                world.all_reduce(pending, op="max", label="setup: a stop signal pending on any rank")
            except CommTimeoutError:
                if self._pending is None:
                    raise
                pending[0] = self._pending
            if pending[0]:
                _ignore_stop_signals()
                self._pending = None
                raise Stopped(int(pending[0]))
            yield


def _ignore_stop_signals() -> None:
    """One stop: once a run stops, a second signal must not interrupt its way out."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def stop_line(stopped: Stopped, done: int | None, steps: int | None, ckpt_dir, population: bool = False) -> str:
    """The one line rank 0 prints when ``stopped``: how far the run got (``done`` of ``steps`` steps
    finished, None: none yet; ``steps`` None: a run that does not count them here, the parameter
    servers') and what to continue from in ``ckpt_dir`` (its files are read): the newest valid
    checkpoint, or with ``population`` (``--mode pbt``) the newest population file, which names every
    member's checkpoint of its step."""
    where = ("" if steps is None else " before it finished a step" if done is None
             else f" after {done} of {steps} steps")
    if population and ckpt_dir is not None:
        files = sorted((Path(ckpt_dir) / POPULATION).glob("step-*.json"))
        newest, what = (files[-1] if files else None), "population"
    else:
        newest, what = (latest_valid(ckpt_dir, log=lambda line: None) if ckpt_dir is not None else None), "checkpoint"
    if ckpt_dir is None:
        then = "no --ckpt-dir, so nothing to resume from"
    elif newest is None:
        then = f"no {what} in {ckpt_dir} yet, so nothing to resume from"
    else:
        then = f"the newest {what} is {newest}: --resume continues from it"
    return f"stopped by {signal.Signals(stopped.signum).name}{where}; {then}"


def exit_stopped(stopped: Stopped) -> None:
    """End this process with ``stopped.status`` (128 + the signal's number), once the run's ``with``
    blocks have unwound and its output is flushed, through ``sys.exit``: Python's finalization stops
    its daemon threads (a collective running in the background included), then mpi4py calls
    ``MPI_Finalize``, which tells hydra this rank ended as it should. ``os._exit`` would be quicker
    (0.05 s against 0.2-0.5 s for a 4-rank job on 2 cores), but hydra's proxy kills every other rank
    of its machine as soon as one exits without ``MPI_Finalize``, sometimes before rank 0 has said
    its line; and ``MPI_Finalize`` called here, while a background collective may still poll MPI,
    ends in MPICH's "Attempting to use an MPI routine ... after finalizing" and a broken job."""
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(stopped.status)
