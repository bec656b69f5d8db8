"""Rank script for tests/test_fault_tolerance.py: a rank dies, the survivors shrink and go on.

    mpiexec --with-ft ulfm --mca mpi_ft_detector true -n 4 python tests/mpi/fault_tolerance.py MODE

``problem``: print what ``ulfm_problem()`` says. TIMEOUT: the group's deadline (default 30 s). ``kill``: rank 2 SIGKILLs itself before the second
all-reduce (``hang``: sleeps HANG_S seconds instead, its MPI silent, then leaves); every survivor prints the error it got (FAILED ...), shrinks (SHRUNK ...), checks the
hand-written all-reduces on the new world against exact sums (OK ...), and prints how long detection
and the shrink took (TIMES ...). ``spare``: as ``kill``, then the survivors start one new rank
(``grow``), which joins them (its ``minidist.init`` is the grown world: JOINED ...), and all four check the collectives (GREW ...).
"""
import os
import signal
import sys
import time

import numpy as np

import minidist
from minidist.comm.fault_tolerance import grow, leave, shrink, spawned, ulfm_problem
from minidist.comm.transport import CommTimeoutError

DIES = 2
HANG_S = 6.0
mode = sys.argv[1]


def check(group) -> int:
    """The hand-written all-reduces and reduce-scatters on ``group``, against exact sums; how many."""
    checks = 0
    for algorithm in ("ring", "doubling", "halving"):
        for count in (0, 1, 2, 3, 1000, 65537):
            y = np.arange(count, dtype=np.float64) * (group.rank + 1)  # integer-valued: the sums are exact
            group.all_reduce(y, algorithm=algorithm, label="metric: a test's all-reduce")
            assert np.array_equal(y, np.arange(count) * sum(range(1, group.size + 1))), (algorithm, count)
            checks += 1
    for count in (0, 5, 1001):
        part = group.reduce_scatter(np.full(count, float(group.rank)), label="metric: a test's reduce-scatter")
        assert np.array_equal(part, np.full(len(part), float(sum(range(group.size))))), count
        checks += 1
    return checks


if mode == "joined":  # a spare that the survivors started
    assert spawned()
    grown = minidist.init(timeout=30.0)
    print(f"JOINED rank={grown.rank} size={grown.size} OK {check(grown)} checks", flush=True)
    leave(grown)
world = minidist.init(timeout=float(sys.argv[2]) if len(sys.argv) > 2 else 30.0)  # [TIMEOUT]: the group's
if mode == "problem":
    print(f"PROBLEM rank={world.rank} {ulfm_problem()}", flush=True)
    sys.exit(0)

assert ulfm_problem() is None, ulfm_problem()
x = np.ones(1000)
world.all_reduce(x, algorithm="ring", label="test: before the death")
if world.rank == DIES and mode in ("kill", "spare"):
    os.kill(os.getpid(), signal.SIGKILL)
if world.rank == DIES and mode == "hang":
    time.sleep(HANG_S)  # alive, but silent: no MPI call, so no heartbeat; the others drop it meanwhile
    os._exit(0)  # the job ends only when every process has
start = time.monotonic()
try:
    world.all_reduce(np.ones(1 << 15), algorithm="ring", label="test: a peer dies")
    raise SystemExit(f"rank {world.rank}: the all-reduce with a dead peer returned")
except CommTimeoutError as e:  # ProcessFailedError (MPI said so), or the group's own deadline passed first
    detected = time.monotonic() - start
    print(f"FAILED rank={world.rank} {type(e).__name__} op={e.op} seq={e.seq} dead={e.missing} "
          f"revoked={getattr(e, 'revoked', None)} :: {e}".splitlines()[0], flush=True)
start = time.monotonic()
shrunk = shrink(world)
shrank = time.monotonic() - start
new = shrunk.world
print(f"SHRUNK rank={world.rank} new={new.rank} size={new.size} gone={list(shrunk.gone)} "
      f"map={sorted(shrunk.rank_map.items())}", flush=True)
checks = check(new)
print(f"OK rank={new.rank} {checks} checks on {new.size} ranks", flush=True)
print(f"TIMES rank={new.rank} detect_s={detected:.4f} shrink_s={shrank:.4f}", flush=True)
if mode == "spare":  # one new rank joins the survivors
    start = time.monotonic()
    new = grow(new, 1, [sys.executable, __file__, "joined"])
    print(f"GREW rank={new.rank} size={new.size} in {time.monotonic() - start:.3f}s OK {check(new)} checks", flush=True)
leave(new)
