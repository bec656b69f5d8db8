"""Rank script for tests/test_fault_tolerance.py: a rank dies, the survivors shrink and go on.

    mpiexec --with-ft ulfm --mca mpi_ft_detector true -n 4 python tests/mpi/fault_tolerance.py MODE

``problem``: print what ``ulfm_problem()`` says. ``kill``: rank 2 SIGKILLs itself before the second
all-reduce (``hang``: sleeps HANG_S seconds instead, its MPI silent, then leaves); every survivor prints the error it got (FAILED ...), shrinks (SHRUNK ...), checks the
hand-written all-reduces on the new world against exact sums (OK ...), and prints how long detection
and the shrink took (TIMES ...).
"""
import os
import signal
import sys
import time

import numpy as np

import minidist
from minidist.comm.fault_tolerance import leave, shrink, ulfm_problem
from minidist.comm.transport import ProcessFailedError

DIES = 2
HANG_S = 6.0
mode = sys.argv[1]
world = minidist.init(timeout=30.0)
if mode == "problem":
    print(f"PROBLEM rank={world.rank} {ulfm_problem()}", flush=True)
    sys.exit(0)

assert ulfm_problem() is None, ulfm_problem()
x = np.ones(1000)
world.all_reduce(x, algorithm="ring", label="test: before the death")
if world.rank == DIES and mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if world.rank == DIES and mode == "hang":
    time.sleep(HANG_S)  # alive, but silent: no MPI call, so no heartbeat; the others drop it meanwhile
    os._exit(0)  # the job ends only when every process has
start = time.monotonic()
try:
    world.all_reduce(np.ones(1 << 15), algorithm="ring", label="test: a peer dies")
    raise SystemExit(f"rank {world.rank}: the all-reduce with a dead peer returned")
except ProcessFailedError as e:
    detected = time.monotonic() - start
    print(f"FAILED rank={world.rank} op={e.op} seq={e.seq} dead={e.missing} revoked={e.revoked} :: {e}", flush=True)
start = time.monotonic()
shrunk = shrink(world)
shrank = time.monotonic() - start
new = shrunk.world
print(f"SHRUNK rank={world.rank} new={new.rank} size={new.size} gone={list(shrunk.gone)} "
      f"map={sorted(shrunk.rank_map.items())}", flush=True)
checks = 0
for algorithm in ("ring", "doubling", "halving"):
    for count in (0, 1, 2, 3, 1000, 65537):
        y = np.arange(count, dtype=np.float64) * (new.rank + 1)  # integer-valued: the sums are exact
        new.all_reduce(y, algorithm=algorithm, label="test: after the shrink")
        assert np.array_equal(y, np.arange(count) * sum(range(1, new.size + 1))), (algorithm, count)
        checks += 1
for count in (0, 5, 1001):
    part = new.reduce_scatter(np.full(count, float(new.rank)), label="test: after the shrink")
    assert np.array_equal(part, np.full(len(part), float(sum(range(new.size))))), count
    checks += 1
print(f"OK rank={new.rank} {checks} checks on {new.size} ranks", flush=True)
print(f"TIMES rank={new.rank} detect_s={detected:.4f} shrink_s={shrank:.4f}", flush=True)
leave(new)
