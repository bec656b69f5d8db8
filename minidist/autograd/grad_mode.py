"""Grad mode: whether operations record a graph for backward.

As in PyTorch the switch is per thread, so ranks simulated as threads in one process (the in-process
transport) do not turn each other's graph recording on and off.
"""
import threading

_state = threading.local()


def is_grad_enabled() -> bool:
    """True unless the calling thread is inside a ``no_grad()`` block."""
    return getattr(_state, "enabled", True)


class no_grad:
    """Context manager: operations inside build no graph (outputs have ``requires_grad=False``).

    >>> with no_grad():
    ...     y = model(idx)   # inference: nothing is saved for backward
    """

    def __enter__(self):
        self._prev = is_grad_enabled()
        _state.enabled = False

    def __exit__(self, *exc):
        _state.enabled = self._prev
        return False
