"""How much Python a call runs, counted in line events (``sys.settrace``): a measure of work that
does not depend on the machine or its load, so a test can bound a call's work, or compare two calls',
without timing anything (a timed assertion fails by chance on a busy machine).

    with python_lines(limit=100_000) as lines:   # TooMuchWork past 100,000 lines
        read_hf_config(path)
    lines.count                                  # the lines run in this thread
"""
import sys


class TooMuchWork(BaseException):
    """More lines ran than the limit allowed. A BaseException, so that no ``except Exception`` in the
    code being counted turns it into its own error."""


class python_lines:
    """A context that counts the Python lines this thread runs inside it (``count``), and stops the
    code with :class:`TooMuchWork` once more than ``limit`` (None: no limit) have run."""

    def __init__(self, limit: int | None = None):
        self.limit, self.count, self._before = limit, 0, None

    def _line(self, frame, event, arg):
        if event == "line":
            self.count += 1
            if self.limit is not None and self.count > self.limit:
                raise TooMuchWork(f"more than {self.limit:,} Python lines ran")
        return self._line

    def _call(self, frame, event, arg):
        return self._line

    def __enter__(self):
        self._before = sys.gettrace()
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc):
        sys.settrace(self._before)
