"""Rank script: jobs that end in the ways the launcher (``python -m minidist.run``) must tell apart.

    python launcher_job.py sleep DIR [--ignore-signals]   each rank writes DIR/rank<r>.pid, then sleeps
                                                          600 s (a long run to stop); with
                                                          --ignore-signals it ignores SIGTERM, SIGHUP
                                                          and SIGINT (only SIGKILL ends it)
    python launcher_job.py timeout DIR                    rank 1 hangs; rank 0's all_reduce times out
                                                          (CommTimeoutError, uncaught: exit status 3)
    python launcher_job.py mismatch DIR                   the ranks all-reduce different lengths in
                                                          debug mode (CollectiveMismatchError: exit 4)

Every mode first appends a line to DIR/attempts on rank 0, so a test can count the launches.
"""
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import minidist

mode, out = sys.argv[1], Path(sys.argv[2])
world = minidist.init(timeout=1.0, debug=mode == "mismatch")
if world.rank == 0:
    with open(out / "attempts", "a") as f:
        f.write(f"{mode}\n")

if mode == "sleep":
    if "--ignore-signals" in sys.argv:
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
    (out / f"rank{world.rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)
elif mode == "timeout":
    if world.rank == 1:
        time.sleep(60)  # hung: never joins the all_reduce (the abort ends it)
    world.all_reduce(np.ones(4))
elif mode == "mismatch":
    world.all_reduce(np.ones(10 if world.rank == 0 else 11))
