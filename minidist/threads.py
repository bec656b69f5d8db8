"""This process's share of the machine's cores for BLAS and OpenMP threads.

NumPy's BLAS (OpenBLAS, MKL) starts a pool of threads as large as the machine. One process is right
to; eight ranks of one job on two cores are not: each starts its pool, sixteen threads spin against
each other, and a job runs several times slower than with one thread each. So each entry point (the
trainer's ``main``, every lesson through ``launch_check.check_launch``) calls
:func:`limit_blas_threads` once, before any work, with the ``OMP_NUM_THREADS`` it read: a user who
set it has chosen, and nothing changes.

    limit_blas_threads(os.environ.get("OMP_NUM_THREADS"))                  # mpiexec ranks: MPI says how many
    limit_blas_threads(os.environ.get("OMP_NUM_THREADS"), thread_ranks=4)  # 4 ranks as threads of this process
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


def mpi_ranks_here() -> tuple[int, int]:
    """(rank in the job, ranks of the job on this machine): the size of ``COMM_WORLD``'s
    shared-memory split (``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``). A process alone, or without
    mpi4py, is (0, 1). Collective over ``COMM_WORLD`` when the job has several ranks: every rank
    calls it. Sends only what MPI's split sends; asking starts MPI (mpi4py's import does)."""
    try:
        from mpi4py import MPI
    except ImportError:
        return 0, 1
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        return 0, 1
    node = world.Split_type(MPI.COMM_TYPE_SHARED)  # the ranks of this machine
    size = node.Get_size()
    node.Free()
    return world.Get_rank(), size


def limit_blas_threads(omp_num_threads: str | None, thread_ranks: int = 1, cores: int | None = None) -> int | None:
    """Limit this process's BLAS and OpenMP thread pools to its share of ``cores`` (None: this
    machine's, :func:`machine_cores`) and return the limit, or None where nothing changed.

    The ranks sharing the machine are the job's ranks on it (:func:`mpi_ranks_here`; collective
    under ``mpiexec``) times ``thread_ranks``, the ranks this process runs as threads (``--local
    N``). ``omp_num_threads`` is the ``OMP_NUM_THREADS`` the entry point read: when set, the user
    chose and nothing is changed or asked. Rank 0 of the job says so in one line, only when a pool
    was larger than the limit: "8 ranks share this machine's 2 cores: 1 BLAS thread each (set
    OMP_NUM_THREADS to choose)". Sends nothing but the split's own messages."""
    if omp_num_threads is not None and omp_num_threads.strip():
        return None
    rank, processes = mpi_ranks_here()
    ranks_here, cores = processes * max(1, thread_ranks), machine_cores() if cores is None else cores
    limit = blas_threads(cores, ranks_here)
    if all(pool["num_threads"] <= limit for pool in threadpool_info()):
        return None  # already within its share (one rank per core, or a pool the user sized)
    threadpool_limits(limits=limit)  # every loaded BLAS and OpenMP runtime, for the rest of the process
    if rank == 0:
        print(f"{ranks_here} ranks share this machine's {cores} cores: {limit} BLAS thread{'s' * (limit > 1)} "
              f"each (set OMP_NUM_THREADS to choose)", flush=True)
    return limit
