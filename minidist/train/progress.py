"""What rank 0 shows while a run trains: a tqdm bar on a terminal, log lines everywhere else.

Under ``mpiexec`` (or piped into a file) the ranks' stderr is not a terminal and a bar draws
nothing, so there rank 0 prints a line every ``every_s`` seconds, at the first step and at the
last, as nanoGPT does::

    1/200 steps  loss 5.5312  812.4 ms/step  79 tok/s  ETA 2:41
    9/200 steps  loss 3.9044  254.1 ms/step  252 tok/s  ETA 0:48

ms/step and tokens/s are wall time over the steps since the previous line (evaluation and
checkpoints included), so the ETA is what the rest of the run will take at that pace. On a terminal
the bar shows the same (its postfix: loss, tokens/s) and the lines are not printed.
"""
from __future__ import annotations

import sys
import time

from tqdm import tqdm


def eta(seconds: float) -> str:
    """``seconds`` as H:MM:SS, or M:SS under an hour (161 -> "2:41")."""
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """The progress of steps ``start .. steps - 1``, ``tokens_per_step`` tokens each.

    Iterate over it for the steps; call :meth:`update` after each and :meth:`write` for any other
    line (it goes above the bar). ``enabled`` False (other ranks, tests): no bar, no lines, but
    :meth:`write` still prints. ``terminal`` None asks whether stderr is one (where tqdm draws).
    ``every_s`` is the seconds between lines (0: one line per step); ``clock`` the time it reads."""

    def __init__(self, start: int, steps: int, tokens_per_step: int, every_s: float = 5.0, enabled: bool = True,
                 terminal: bool | None = None, clock=time.perf_counter):
        terminal = sys.stderr.isatty() if terminal is None else terminal
        self.start, self.steps, self.tokens_per_step, self.every_s, self.clock = start, steps, tokens_per_step, every_s, clock
        self.bar = tqdm(range(start, steps), dynamic_ncols=True) if enabled and terminal else None
        self.lines = enabled and not terminal
        self.last_step, self.last_time = start - 1, clock()  # the previous line's: its step, when
        self.waited = 0.0  # seconds the steps since the previous line waited for their batches

    def __iter__(self):
        return iter(self.bar if self.bar is not None else range(self.start, self.steps))

    def update(self, step: int, loss: float, data_wait_s: float = 0.0) -> None:
        """Step ``step`` (0-based) is done with training loss ``loss``, having waited ``data_wait_s``
        for its batch: the bar's postfix, or a line when ``every_s`` has passed since the last one, at
        the first step and at the last."""
        now = self.clock()
        self.waited += data_wait_s
        done, seconds = step - self.last_step, now - self.last_time
        wait = f"{1e3 * self.waited / done:.1f}"  # ms per step waited for data since the previous line
        per_step = seconds / done  # the pace since the previous line (the bar's: since the previous step)
        tokens_per_s = f"{self.tokens_per_step * done / seconds:,.0f}" if seconds > 0 else "-"
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=tokens_per_s, data_ms=wait)
        elif self.lines and (step == self.start or step == self.steps - 1 or seconds >= self.every_s):
            self.write(f"{step + 1}/{self.steps} steps  loss {loss:.4f}  {1e3 * per_step:.1f} ms/step  "
                       f"{tokens_per_s} tok/s  data wait {wait} ms/step  ETA {eta(per_step * (self.steps - 1 - step))}")
        else:
            return  # no line yet: the pace goes on counting from the previous one
        self.last_step, self.last_time, self.waited = step, now, 0.0

    def write(self, line: str) -> None:
        """Print ``line`` now: above the bar on a terminal, flushed where stdout is a pipe (mpiexec
        forwards what a rank flushes)."""
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)
