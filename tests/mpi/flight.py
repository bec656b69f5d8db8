"""Rank script: a hung peer. ``python flight.py DIR``: the last rank hangs (sleeps) instead of
joining the third all_reduce; every other rank times out (1 s), and the group's flight recorder (on by
default under ``minidist.init``) dumps its record to stderr and DIR/flight_rank<r>.txt before the
error reaches this script, which prints ``DUMPED rank=..``. Then the hung rank wakes and all end."""
import sys
import time

import numpy as np
from mpi4py import MPI

import minidist
from minidist.comm.transport import CommTimeoutError

group = minidist.init(backend="ring", timeout=1.0, flight_dir=sys.argv[1])
x = np.ones(1000, np.float32)
group.all_reduce(x)
group.barrier()
if group.rank == group.size - 1:
    time.sleep(3)  # hung: never calls the third collective in time
else:
    try:
        group.all_reduce(x)
        raise AssertionError("all_reduce returned although a rank hung")
    except CommTimeoutError:
        print(f"DUMPED rank={group.rank}", flush=True)
MPI.COMM_WORLD.Barrier()
