"""Rank script: what happens when ranks disagree. ``python failures.py skip|mismatch|crash``.

skip      The last rank skips one all_reduce. Every other rank must raise CommTimeoutError naming
          the op, its sequence number, itself and a peer, within the (short) timeout; then the job
          ends normally. Each rank prints one ``TIMEOUT rank=.. op=.. seq=.. peer=..`` line.
mismatch  In debug mode rank 0 all-reduces 10 elements while the others all-reduce 11. Every rank
          must raise CollectiveMismatchError before anything is sent and print ``MISMATCH rank=..``.
crash     Rank 1 raises an uncaught exception while the others wait in an all_reduce with a long
          timeout. The exception hook must print the traceback and abort the job: mpiexec exits
          non-zero within seconds, not after the timeout.
"""
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

elif mode == "crash":
    group = minidist.init(backend="ring", timeout=120.0)
    if group.rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    group.all_reduce(np.ones(10, np.float32))
    raise AssertionError("the all_reduce completed although rank 1 never joined")

else:
    raise SystemExit(f"unknown mode {mode!r}")
