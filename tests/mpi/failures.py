"""Rank script: what happens when ranks disagree. ``python failures.py MODE``.

skip      The last rank skips one all_reduce. Every other rank must raise CommTimeoutError naming
          the op, its sequence number, itself and a peer, within the (short) timeout; then the job
          ends normally. Each rank prints one ``TIMEOUT rank=.. op=.. seq=.. peer=..`` line.
mismatch  In debug mode rank 0 all-reduces 10 elements while the others all-reduce 11. Every rank
          must raise CollectiveMismatchError before anything is sent and print ``MISMATCH rank=..``.
disagree  Without debug mode, rank 1 all-reduces 4 float64 while the others all-reduce 8 float32
          (the same bytes). The check with the ring neighbours raises CollectiveMismatchError, uncaught:
          the exception hook aborts the job with exit status 4 (EXIT_MISMATCH).
stopped   The last rank stops itself (SIGSTOP) instead of joining the third collective; the others
          time out (1 s), uncaught: the job ends with status 3 (EXIT_COMM_TIMEOUT) and the message
          names the stopped rank as the one that never arrived.
crash     Rank 1 raises an uncaught exception while the others wait in an all_reduce with a long
          timeout. The exception hook must print the traceback and abort the job: mpiexec exits
          non-zero within seconds, not after the timeout.
"""
import os
import signal
import sys

import numpy as np
from mpi4py import MPI

import minidist
from minidist.comm.transport import CollectiveMismatchError, CommTimeoutError

mode = sys.argv[1]

if mode == "skip":
    group = minidist.init(backend="ring", timeout=1.0)
    x = np.ones(1000, np.float32)
    group.all_reduce(x)  # a first call that everybody makes
    first = group.trace.events[-1].seq
    if group.rank != group.size - 1:
        try:
            group.all_reduce(x)
            raise AssertionError(f"rank {group.rank}: all_reduce returned although a rank skipped it")
        except CommTimeoutError as e:
            assert e.rank == group.rank and e.peer != group.rank and 0 <= e.peer < group.size, e
            assert e.op == "all_reduce" and e.seq == first + 1 and "all_reduce" in str(e), e
            print(f"TIMEOUT rank={e.rank} op={e.op} seq={e.seq} peer={e.peer}: {e}", flush=True)
    MPI.COMM_WORLD.Barrier()  # the skipping rank waits for the others before the job ends

elif mode == "mismatch":
    group = minidist.init(backend="ring", timeout=10.0, debug=True)
    try:
        group.all_reduce(np.ones(10 if group.rank == 0 else 11, np.float32))
        raise AssertionError(f"rank {group.rank}: a mismatched all_reduce returned")
    except CollectiveMismatchError as e:
        print(f"MISMATCH rank={group.rank}: {e}", flush=True)

elif mode == "disagree":  # optional second argument: the backend ("ring", "mpi")
    group = minidist.init(backend=sys.argv[2] if len(sys.argv) > 2 else "ring", timeout=120.0)
    group.all_reduce(np.ones(8, np.float32) if group.rank != 1 else np.ones(4, np.float64))
    raise AssertionError(f"rank {group.rank}: a mismatched all_reduce returned")

elif mode == "stopped":
    group = minidist.init(backend="ring", timeout=1.0)
    x = np.ones(1 << 16, np.float32)
    group.all_reduce(x)
    group.barrier()
    if group.rank == group.size - 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # the job's abort kills it
    group.all_reduce(x)
    raise AssertionError(f"rank {group.rank}: all_reduce returned although a rank is stopped")

elif mode == "crash":
    group = minidist.init(backend="ring", timeout=120.0)
    if group.rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    group.all_reduce(np.ones(10, np.float32))
    raise AssertionError("the all_reduce completed although rank 1 never joined")

else:
    raise SystemExit(f"unknown mode {mode!r}")
