"""Start a group: :func:`init` under ``mpiexec``, :func:`run_local` with ranks as threads in this process.

    # train.py, run with: mpiexec -n 4 python train.py
    group = minidist.init()
    group.all_reduce(grads)

    # a test or a notebook, no MPI needed
    minidist.run_local(lambda group: group.all_reduce(np.ones(3)), world_size=4)
"""
from __future__ import annotations

import threading
import time

from minidist.comm.flight_recorder import FlightRecorder
from minidist.comm.group import ProcessGroup
from minidist.comm.local_transport import LocalTransport
from minidist.comm.machines import from_mpi
from minidist.comm.trace import KEEP_RECENT, Trace
from minidist.waiting import join


def init(backend: str = "ring", *, timeout: float = 300.0, debug: bool = False, trace: bool = True,
         trace_keep: int | None = KEEP_RECENT, threshold_bytes: int | None = None,
         segment_bytes: int | None = None, flight_dir=None, cuda_aware: bool | None = None,
         check_calls: bool = True) -> ProcessGroup:
    """The world group of an ``mpiexec`` job (this starts MPI).

    ``backend="ring"`` runs the hand-written collectives over MPI point-to-point messages, ``"mpi"``
    MPI's own collectives, ``"nccl"`` NCCL's on GPU (CuPy) arrays, with one GPU per rank: the i-th rank of
    a machine takes GPU i (``comm/machines.py``, ``nccl.select_device``). An uncaught exception on any rank aborts the
    whole job. ``trace=False`` turns recording off; the trace keeps this rank's last ``trace_keep``
    calls, so a job of any length holds the same memory (None keeps every call: it grows with the job).
    ``threshold_bytes`` overrides where all-reduce switches from recursive doubling to the
    bandwidth-optimal algorithms (Rabenseifner's, then the ring: ``ProcessGroup``) and
    ``segment_bytes`` the ring's segment size. When a call times out, the flight recorder prints this
    rank's last recorded calls to stderr (and to ``flight_dir/flight_rank<r>.txt`` if given).
    GPU (CuPy) buffers go to MPI as they are when it is CUDA-aware and through pinned host memory
    when not; ``cuda_aware=None`` asks the MPI library, True or False overrides it. ``timeout``
    (seconds; the default, 300, outlasts a slow first step or a checkpoint write yet ends a lost
    rank's job in minutes) bounds every wait on a peer: past it the call raises CommTimeoutError
    naming the rank that never arrived, and the job exits with status 3. ``check_calls`` (the
    default) has every collective compare its fingerprint with the ring neighbours first, so ranks
    that call different collectives raise CollectiveMismatchError (exit status 4) instead of mixing
    up data; ``debug=True`` compares with every rank instead."""
    from minidist.comm.mpi_transport import MPITransport  # here, so `import minidist` never starts MPI
    transport = MPITransport.world(timeout, cuda_aware=cuda_aware)
    if backend == "nccl":  # the GPU first: arrays and NCCL communicators belong to the current one
        from minidist.comm.nccl import select_device
        machines = from_mpi(transport.comm)  # which ranks share this rank's machine
        select_device(machines.local_rank(transport.rank), machines.local_size(transport.rank))
    settings = {k: v for k, v in (("threshold_bytes", threshold_bytes), ("segment_bytes", segment_bytes))
                if v is not None}
    return ProcessGroup(transport, backend=backend, trace=Trace(transport.rank, enabled=trace, keep=trace_keep),
                        debug=debug, check_calls=check_calls, flight_recorder=FlightRecorder(directory=flight_dir),
                        **settings)


def run_local(fn, world_size: int, backend: str = "ring", *, timeout: float = 60.0, debug: bool = False,
              **group_kwargs) -> list:
    """Run ``fn(group)`` on ``world_size`` threads, one rank each, and return the results in rank order.

    If any rank raises, the earliest error is re-raised once all threads are done (the other ranks'
    errors are attached as notes). A rank that has ended, normally or not, makes every wait on it fail
    at once with a message naming it, so one rank's failure never leaves the others hanging.
    ``group_kwargs`` go to :class:`ProcessGroup` (``threshold_bytes``, ``segment_bytes``, ...).
    """
    if backend in ("mpi", "nccl"):
        why = "one process per GPU" if backend == "nccl" else "MPI processes"
        raise ValueError(f"backend {backend!r} needs {why}: run under mpiexec and call "
                         f"minidist.init(backend={backend!r}), or use backend='ring' here (it takes cupy arrays too)")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    transports = LocalTransport.world(world_size, timeout)
    results: list = [None] * world_size
    errors: dict[int, tuple[float, BaseException]] = {}

    def main(rank: int) -> None:
        why = "returned (it never made this call)"
        try:
            results[rank] = fn(ProcessGroup(transports[rank], backend=backend, debug=debug, **group_kwargs))
        except BaseException as e:  # noqa: BLE001 -- handed to the caller below
            errors[rank] = (time.monotonic(), e)
            why = f"raised {type(e).__name__}: {e}"
        finally:
            transports[rank].hub.mark_exited(rank, why)

    threads = [threading.Thread(target=main, args=(rank,), name=f"rank {rank}", daemon=True)
               for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        join(thread)
    if errors:
        first_rank = min(errors, key=lambda rank: errors[rank][0])
        first = errors[first_rank][1]
        for rank, (_, e) in sorted(errors.items()):
            if rank != first_rank and hasattr(first, "add_note"):  # notes exist from Python 3.11
                first.add_note(f"rank {rank} also failed: {type(e).__name__}: {e}")
        raise first
    return results


def run_anywhere(fn, threads: int):
    """``fn(world)`` on every rank of this ``mpiexec`` job when there is one of more than one rank
    (:func:`init`), else on ``threads`` in-process ranks (:func:`run_local`): how a lesson runs both
    ways. Returns this rank's result under MPI, the list of every rank's result otherwise."""
    try:
        from mpi4py import MPI  # only to know whether mpiexec started us (it does not start MPI's world twice)
        in_mpi = MPI.COMM_WORLD.Get_size() > 1
    except ImportError:
        in_mpi = False
    return fn(init()) if in_mpi else run_local(fn, threads)
