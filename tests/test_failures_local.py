"""Failing fast and clearly: bad arguments are refused before anything is sent, a missing peer ends
in an error that names the call and the peer, and debug mode catches ranks that disagree."""
import io
import sys
import threading
import time

import numpy as np
import pytest

from minidist import run_local
from minidist.comm import CollectiveMismatchError, CommTimeoutError, PeerExited
from minidist.comm.flight_recorder import FlightRecorder


def read_only(x):
    x.flags.writeable = False
    return x


BAD_CALLS = {  # every rank makes the same bad call
    "unknown op": lambda g: g.all_reduce(np.zeros(4), op="mean"),
    "unsupported dtype": lambda g: g.all_reduce(np.zeros(4, dtype=np.complex64)),
    "not an array": lambda g: g.all_reduce([1.0, 2.0]),
    "non-contiguous": lambda g: g.all_reduce(np.zeros((4, 4))[:, 0]),
    "read-only": lambda g: g.broadcast(read_only(np.zeros(4))),
    "unknown algorithm": lambda g: g.all_reduce(np.zeros(4), algorithm="tree"),
    "src out of range": lambda g: g.broadcast(np.zeros(4), src=g.size),
    "negative dst": lambda g: g.reduce(np.zeros(4), dst=-1),
    "out of the wrong size": lambda g: g.reduce_scatter(np.zeros(4 * g.size), out=np.zeros(3)),
    "out of the wrong dtype": lambda g: g.all_gather(np.zeros(2), out=np.zeros(2 * g.size, np.float32)),
    "shard length vs count": lambda g: g.all_gather(np.zeros(3), count=2 * g.size),
    "0-d reduce_scatter": lambda g: g.reduce_scatter(np.zeros(())),
    "p2p tag reserved for collectives": lambda g: g.send(np.zeros(1), dst=0, tag=40000),
    "p2p peer out of range": lambda g: g.recv(np.zeros(1), src=g.size),
}


@pytest.mark.parametrize("call", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_bad_arguments_raise_value_error_on_every_rank_before_sending(call):
    def fn(g):
        with pytest.raises(ValueError, match=f"^rank {g.rank}: "):
            call(g)
        nothing_happened = (g.seq, g.p2p_seq, g.trace.events) == (0, 0, [])
        return nothing_happened, g.all_reduce(np.ones(3))  # no half-sent message confuses what follows

    for nothing_happened, total in run_local(fn, 3, timeout=5.0):
        assert nothing_happened
        np.testing.assert_array_equal(total, [3.0, 3.0, 3.0])


def test_a_rank_that_skips_a_collective_ends_in_a_timeout_naming_call_rank_and_peer():
    timed_out = threading.Semaphore(0)  # released by each waiting rank once its time-out has been raised

    def fn(g):
        g.all_reduce(np.ones(4))  # collective #1: everyone
        if g.rank == 1:  # rank 1 skips #2, alive but silent until both others have timed out
            assert all(timed_out.acquire(timeout=60) for _ in range(2))  # 60 s: a safety net only
            return None
        try:
            with pytest.raises(CommTimeoutError) as info:
                g.all_reduce(np.ones(4))
        finally:
            timed_out.release()
        return info.value

    for rank, error in enumerate(run_local(fn, 3, timeout=1.0)):  # 1 s: collective #1 on a loaded machine
        if rank != 1:  # recursive doubling on 3 ranks: both others wait on rank 1 directly
            assert (error.op, error.seq, error.rank, error.peer, error.group) == ("all_reduce", 2, rank, 1, "world")
            assert error.waited >= 1.0
            assert str(error).startswith(f"all_reduce #2 on group 'world': rank {rank} waited")


def test_a_rank_that_has_returned_is_noticed_at_once():
    def fn(g):
        if g.rank == 0:
            with pytest.raises(CommTimeoutError) as info:
                g.broadcast(np.zeros(4), src=1)
            return info.value

    error = run_local(fn, 2, timeout=30.0)[0]
    assert (error.op, error.seq, error.peer) == ("broadcast", 1, 1)
    assert isinstance(error.__cause__, PeerExited)  # ended by rank 1's exit, not by the 30 s deadline


def test_a_point_to_point_wait_times_out_as_comm_timeout_error():
    timed_out = threading.Event()  # rank 1 stays alive, sending nothing, until rank 0 has timed out

    def fn(g):
        if g.rank == 1:
            assert timed_out.wait(timeout=60)  # a safety net only
            return None
        request = g.irecv(np.zeros(1), src=1)
        try:
            with pytest.raises(CommTimeoutError) as info:
                request.wait()
        finally:
            timed_out.set()
        return info.value

    error = run_local(fn, 2, timeout=0.2)[0]
    assert (error.op, error.seq, error.rank, error.peer) == ("irecv", 1, 0, 1)
    assert not isinstance(error.__cause__, PeerExited)  # the deadline ended it: rank 1 was still there


def test_debug_mode_names_the_ranks_that_called_something_else_on_every_rank():
    def fn(g):
        g.all_reduce(np.ones(2))
        g.barrier()  # collectives #1 and #2 agree
        with pytest.raises(CollectiveMismatchError) as info:
            if g.rank == 1:
                g.reduce_scatter(np.ones(10))
            else:
                g.all_reduce(np.ones(12))
        return str(info.value)

    assert run_local(fn, 3, debug=True, timeout=5.0) == [
        "all_reduce #3 on group 'world': rank 1 called reduce_scatter with count 10 "
        "while rank 0 called all_reduce with count 12"] * 3


def test_debug_mode_catches_a_different_root_and_dtype():
    def fn(g):
        x = np.zeros(4, np.float32 if g.rank == 2 else np.float64)
        with pytest.raises(CollectiveMismatchError) as info:
            g.broadcast(x, src=min(g.rank, 1))
        return str(info.value)

    assert run_local(fn, 3, debug=True, timeout=5.0) == [
        "broadcast #1 on group 'world': rank 1 called broadcast with root 1 while rank 0 called broadcast "
        "with root 0; rank 2 called broadcast with dtype float32, root 1 while rank 0 called broadcast "
        "with dtype float64, root 0"] * 3


def test_run_local_reraises_the_first_error_and_the_others_do_not_hang():
    def fn(g):
        if g.rank == 2:
            raise RuntimeError("boom")
        g.all_reduce(np.ones(4))

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="boom") as info:
        run_local(fn, 4, timeout=300.0)
    assert time.monotonic() - start < 300.0  # a safety net, not a speed: nobody waited out its deadline
    if sys.version_info >= (3, 11):  # exception notes exist from 3.11
        assert [note.split(":")[0] for note in info.value.__notes__] == [f"rank {r} also failed" for r in (0, 1, 3)]
        for note in info.value.__notes__:  # each learned of rank 2's exit from the census
            assert "rank 2 never arrived at all_reduce #1: it raised RuntimeError: boom" in note, note


def test_run_local_refuses_the_mpi_backend():
    with pytest.raises(ValueError, match="mpiexec"):
        run_local(lambda g: None, 2, backend="mpi")


def test_a_sleeping_rank_is_named_by_every_rank_that_waited_not_just_the_neighbour_it_waited_on():
    recorder = FlightRecorder(stream=io.StringIO())
    together, timed_out = threading.Barrier(3), threading.Semaphore(0)

    def fn(g):
        g.all_reduce(np.ones(4))
        if g.rank == 2:  # stopped: alive but silent, never calls #2, until every waiting rank has timed out
            assert all(timed_out.acquire(timeout=60) for _ in range(3))  # 60 s: a safety net only
            return None
        try:
            together.wait()  # the waiting ranks enter #2 together: their census windows (1 s) meet
            with pytest.raises(CommTimeoutError) as info:
                g.all_reduce(np.ones(1 << 15), algorithm="ring")  # rank 0 waits on rank 3, which waits on rank 2
        finally:
            timed_out.release()
        return info.value, recorder.dump(g.trace, info.value)

    results = run_local(fn, 4, timeout=1.0)
    for r in (0, 1, 3):
        error, dump = results[r]
        assert error.missing == [2], error
        assert ("rank 2 never arrived at all_reduce #2 (no answer in 1.0s: stopped, hung or busy elsewhere); "
                "ranks 0,1,3 waited in it") in str(error)
        assert str(error) in dump.splitlines()[0]  # the flight recorder shows the census
    assert results[0][0].peer != 2  # rank 0 itself waited on a neighbour that was waiting too


def test_comm_timeout_flag_reaches_init_and_a_bad_value_is_refused_with_the_rest(monkeypatch, capsys):
    import minidist.train.entry as train_module
    from minidist.train.build import world_of_one
    from minidist.train.config import ConfigError, TrainConfig, check_config
    from minidist.train.cli import parse_args

    class Started(Exception):
        pass

    seen = {}

    def fake_init(backend, **kwargs):
        seen.update(kwargs)
        if kwargs["timeout"] == 7.5:
            raise Started
        return world_of_one()  # a bad value: MPI starts with the default, check_config refuses it with the rest

    monkeypatch.setattr(train_module, "init", fake_init)
    with pytest.raises(Started):
        train_module.main(["--comm-timeout", "7.5"])
    assert seen["timeout"] == 7.5 and parse_args([]).comm_timeout == 300.0
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(SystemExit) as exit_info:
            train_module.main(["--comm-timeout", bad])
        assert exit_info.value.code == 2 and seen["timeout"] == 300.0
        assert f"--comm-timeout must be a positive, finite number of seconds, got {float(bad)}" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--comm-timeout"):
        check_config(TrainConfig(comm_timeout=0.0), 1)


def test_a_bad_timeout_is_refused():
    with pytest.raises(ValueError, match="timeout must be a positive, finite number of seconds, got 0"):
        run_local(lambda g: None, 2, timeout=0)
