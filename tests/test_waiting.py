"""minidist/waiting.py: a stop signal that another thread takes still interrupts the main thread's wait.

Each case runs in a fresh interpreter. Its main thread waits for something that never happens; once
the main thread is inside the wait, a thread of its own sends SIGTERM to itself
(``signal.pthread_kill``), so the kernel cannot hand the signal to the main thread. With a plain
``Event.wait()`` the main thread would sleep forever (Python only marks the signal pending); each
wait of minidist/waiting.py must let the handler run and stop. The subprocess's timeout only catches
a hang; no time is asserted.
"""
import subprocess
import sys

import pytest

from tests.mpi.harness import REPO

WAITS = {
    "wait_event": "waiting.wait_event(threading.Event())",
    "join": "waiting.join(daemon(threading.Event().wait))",
    "result": "waiting.result(concurrent.futures.Future())",
    "until": "waiting.until(lambda: False, lambda timeout: None)",
}

SCRIPT = """
import concurrent.futures, signal, sys, threading
from minidist import waiting

class Stop(BaseException):
    pass

def stop(signum, frame):
    raise Stop

def daemon(target):
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread

def waiting_now():
    frame = sys._current_frames()[threading.main_thread().ident]
    while frame is not None and not frame.f_code.co_filename.endswith("waiting.py"):
        frame = frame.f_back
    return frame is not None

def signal_this_thread_once_main_waits():
    while not waiting_now():
        pass
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

signal.signal(signal.SIGTERM, stop)
sender = threading.Thread(target=signal_this_thread_once_main_waits, daemon=True)
try:
    sender.start()  # (its start waits for the thread to run: not yet a wait of waiting.py)
    {wait}
except Stop:
    print("stopped")
"""


@pytest.mark.parametrize("wait", sorted(WAITS))
def test_a_signal_taken_by_another_thread_stops_the_main_threads_wait(wait):
    script = SCRIPT.format(wait=WAITS[wait])
    try:
        done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"waiting.{wait} slept on through a signal that another thread took")
    assert done.stdout.strip() == "stopped", done.stdout + done.stderr


def test_a_wait_returns_what_it_waited_for():
    import concurrent.futures
    import threading

    from minidist import waiting

    event = threading.Event()
    event.set()
    waiting.wait_event(event)
    future = concurrent.futures.Future()
    future.set_result(7)
    assert waiting.result(future) == 7
    failed = concurrent.futures.Future()
    failed.set_exception(ValueError("its error"))
    with pytest.raises(ValueError, match="its error"):
        waiting.result(failed)
    thread = threading.Thread(target=lambda: None)
    thread.start()
    waiting.join(thread)
    assert not thread.is_alive()
