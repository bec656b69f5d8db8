"""A group's communication stream: one thread runs its queued collectives in issue order, and a
training loop reuses that thread step after step rather than starting one per step (under MPICH
every new OS thread leaves a few hundred bytes behind for good: benchmarks/memory_long_run.py).

The rules: work submitted while the thread is alive, or within ``linger`` seconds of its last work,
runs on the same thread; an idle stream ends its thread after ``linger`` seconds.
"""
import threading

from minidist.comm.work import CommStream


def test_work_a_step_apart_runs_on_one_thread():
    stream = CommStream("dp")
    threads = [stream.submit(threading.current_thread, "who").wait() for _ in range(50)]
    assert len(set(threads)) == 1 and threads[0] is not threading.current_thread()


def test_an_idle_stream_ends_its_thread():
    stream = CommStream("idle")
    stream.linger = 0.05
    first = stream.submit(threading.current_thread, "who").wait()
    first.join(timeout=60)  # a safety net against a thread that never ends: it ends after linger, 50 ms
    assert not first.is_alive()
    assert stream.submit(lambda: 7, "after").wait() == 7  # a new thread starts for new work

