"""This process's share of its host's cores for BLAS and OpenMP threads.

NumPy's BLAS (OpenBLAS, MKL) starts a pool of threads as large as the machine. One process is right
to; eight ranks of one job on two cores are not: each starts its pool, sixteen threads spin against
each other, and a job runs several times slower than with one thread each. So each entry point (the
trainer's ``main``, every lesson through ``launch_check.check_launch``) calls
:func:`limit_blas_threads` once, before any work, with the ``OMP_NUM_THREADS`` it read: a user who
set it has chosen, and nothing changes.

    limit_blas_threads(os.environ.get("OMP_NUM_THREADS"), ranks_here=machines.host_size(rank))  # mpiexec ranks
    limit_blas_threads(os.environ.get("OMP_NUM_THREADS"), ranks_here=4)  # 4 ranks as threads of this process
"""
from __future__ import annotations

import os

import numpy  # noqa: F401 -- loads the BLAS whose pool is limited: threadpoolctl sees only loaded libraries
from threadpoolctl import threadpool_info, threadpool_limits


def machine_cores() -> int:
    """The cores this process may run on: its CPU affinity (what ``taskset`` or a batch system
    gives it), ``os.cpu_count()`` where the system has no such mask."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def blas_threads(cores: int, ranks_here: int) -> int:
    """Threads per rank when ``ranks_here`` ranks share ``cores`` cores: each its whole share, at
    least one (8 ranks on 2 cores: 1; 4 ranks on 16 cores: 4; 3 ranks on 16 cores: 5)."""
    return max(1, cores // max(1, ranks_here))


def limit_blas_threads(omp_num_threads: str | None, ranks_here: int = 1, announce: bool = True,
                       cores: int | None = None) -> int | None:
    """Limit this process's BLAS and OpenMP thread pools to its share of ``cores`` (None: this
    machine's, :func:`machine_cores`) and return the limit, or None where nothing changed.

    ``ranks_here`` are the ranks sharing the machine, which the entry point knows: the job's ranks
    on it (``minidist.comm.machines``: MPI's shared-memory split), or the ranks this process runs as
    threads (``--local N``). ``omp_num_threads`` is the ``OMP_NUM_THREADS`` the entry point read:
    when set, the user chose and nothing is changed. With ``announce`` (rank 0 of a job) it says so
    in one line, only when a pool was larger than the limit: "8 ranks share this machine's 2 cores:
    1 BLAS thread each (set OMP_NUM_THREADS to choose)". Sends nothing."""
    if omp_num_threads is not None and omp_num_threads.strip():
        return None
    ranks_here, cores = max(1, ranks_here), machine_cores() if cores is None else cores
    limit = blas_threads(cores, ranks_here)
    if all(pool["num_threads"] <= limit for pool in threadpool_info()):
        return None  # already within its share (one rank per core, or a pool the user sized)
    threadpool_limits(limits=limit)  # every loaded BLAS and OpenMP runtime, for the rest of the process
    if announce:
        print(f"{ranks_here} ranks share this machine's {cores} cores: {limit} BLAS thread{'s' * (limit > 1)} "
              f"each (set OMP_NUM_THREADS to choose)", flush=True)
    return limit
