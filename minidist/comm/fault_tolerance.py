"""Live fault tolerance: a world that lost ranks shrinks to its survivors and goes on.

Open MPI 5 has the MPI standard's proposed fault-tolerance interface (ULFM). In a job started with
``mpiexec --with-ft ulfm --mca mpi_ft_detector true``, a request with a dead peer ends with
MPI_ERR_PROC_FAILED instead of ending the job: the MPI transport raises it as ``PeerFailed``, the group
as :class:`~minidist.comm.transport.ProcessFailedError` naming the call and the dead ranks. Every
survivor then calls :func:`shrink`. It revokes the world and the caller's other groups, so that a
survivor still waiting in any of them wakes with MPI_ERR_REVOKED and comes to shrink too. Then
MPI_Comm_shrink agrees, among the survivors, on who is gone and builds a communicator of the rest:
the same survivors on every rank. The hand-written collectives run on it as on any.

New ranks join live: :func:`grow` starts them (MPI_Comm_spawn) and merges them into the world
(MPI_Intercomm_merge); in each new process ``minidist.init`` makes the other half of the merge, so it
starts on the grown world (:func:`spawned` says it was started so).

A rank that hangs is alive to MPI. Open MPI's failure detector declares it dead once it has been
silent (no MPI call) for ``mpi_ft_detector_timeout`` seconds: launched with that set to the run's
``--comm-timeout``, a hung rank is a dead rank. Without the detector its peers time out
(CommTimeoutError) and a shrink would wait for it. :func:`ulfm_problem` says at start-up whether this MPI can shrink at all; the pip MPICH
wheel cannot (its ``MPIX_Comm_revoke`` is a stub, and ``MPIR_CVAR_ENABLE_FT=1`` fails in MPI_Init).
"""
from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

from minidist.comm.group import ProcessGroup
from minidist.comm.mpi_transport import MPITransport, loaded_libmpi

LAUNCH = "mpiexec --with-ft ulfm --mca mpi_ft_detector true"
"""How Open MPI 5 starts a job whose survivors can shrink (the detector also notices a dead rank's
silence, not only its exit)."""


@dataclass(frozen=True)
class Shrunk:
    """The survivors' new world: ``world``, the ranks that are ``gone`` (old numbers), and each
    survivor's new rank by its old one (``rank_map``)."""
    world: ProcessGroup
    gone: tuple[int, ...]
    rank_map: dict[int, int]


def ulfm_problem() -> str | None:
    """Why this job cannot drop dead ranks live, in one line; None when it can. Call once MPI has
    started: it asks the MPI library (its name, and Open MPI's ``mpi_ft_enable`` setting)."""
    from mpi4py import MPI
    version = " ".join(MPI.Get_library_version().strip("\0 \n").splitlines()[0].split())
    if not version.startswith("Open MPI"):
        return (f"this MPI ({version}) has no fault-tolerance interface (ULFM): a dead rank ends the job, and the "
                f"restarting launcher (python -m minidist.run --max-restarts N) resumes it from its last checkpoint")
    if not _openmpi_ft_enabled():
        return f"Open MPI's fault tolerance is off in this job: start it with {LAUNCH}"
    return None


def shrink(world: ProcessGroup, others=()) -> Shrunk:
    """Collective over the survivors of ``world`` (an MPI group whose call raised ProcessFailedError):
    revoke ``world`` and the groups ``others`` (this rank's sub-groups of it), build the survivors'
    communicator, and return it as a ProcessGroup with ``world``'s settings and trace.

    What it sends: MPI_Comm_revoke's notices to every rank of each group, then MPI_Comm_shrink's
    agreement among the survivors (both inside MPI; nothing of ours)."""
    from mpi4py import MPI
    for group in others:
        if group is not None and group.size > 1:
            group.transport.comm.Revoke()
    old = world.transport
    old.comm.Revoke()
    comm = old.comm.Shrink()
    mapped = MPI.Group.Translate_ranks(old.comm.Get_group(), list(range(old.size)), comm.Get_group())
    rank_map = {was: now for was, now in enumerate(mapped) if now != MPI.UNDEFINED}
    gone = tuple(r for r in range(old.size) if r not in rank_map)
    return Shrunk(_group_like(world, comm), gone, rank_map)


def grow(world: ProcessGroup, count: int, command: list[str]) -> ProcessGroup:
    """Collective over ``world``: start ``count`` new processes running ``command`` (a program and its
    arguments; each calls ``minidist.init``) and return the world with them, its own ranks first.

    What it sends: MPI_Comm_spawn's and MPI_Intercomm_merge's messages (inside MPI)."""
    inter = world.transport.comm.Spawn(command[0], args=command[1:], maxprocs=count, root=0)
    merged = inter.Merge(high=False)
    inter.Free()
    return _group_like(world, merged)


def spawned() -> bool:
    """Whether :func:`grow` started this process (MPI_Comm_spawn), so that ``minidist.init`` gave it the
    grown world (the old ranks first), not a world of its own. Asks MPI; sends nothing."""
    from mpi4py import MPI
    return MPI.Comm.Get_parent() != MPI.COMM_NULL


def _group_like(world: ProcessGroup, comm) -> ProcessGroup:
    """A ProcessGroup over the mpi4py communicator ``comm`` with ``world``'s settings and trace; MPI's
    errors raised, not fatal."""
    from mpi4py import MPI
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    old = world.transport
    transport = MPITransport(comm, old.timeout, name=old.name, cuda_aware=old.cuda_aware)
    return ProcessGroup(transport, backend=world.backend, trace=world.trace, debug=world.debug,
                        threshold_bytes=world.threshold_bytes, segment_bytes=world.segment_bytes,
                        ring_from_bytes=world.ring_from_bytes, check_calls=world.check_calls,
                        scattered_below_bytes=world.scattered_below_bytes,
                        flight_recorder=world.flight_recorder, name=world.name)


def leave(survivors: ProcessGroup, code: int = 0) -> None:
    """End this process of a world that shrank: once every survivor is here (a barrier), flush and
    exit with ``code``, without MPI_Finalize. After a failure Open MPI's finalize may wait for the
    dead rank forever (open-mpi/ompi#11404; seen here in about one run in four). A process that
    :func:`grow` started finalizes (its own job lost no rank; without it mpiexec exits 1).

    What it sends: a barrier over ``survivors``."""
    from mpi4py import MPI
    survivors.barrier(label="setup: every survivor is done")
    if MPI.Comm.Get_parent() != MPI.COMM_NULL:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _openmpi_ft_enabled() -> bool:
    """Open MPI's ``mpi_ft_enable`` control variable (``--with-ft ulfm`` sets it), read through the MPI
    tool interface (MPI_T) of the loaded ``libmpi``. False when it cannot be read."""
    for path in loaded_libmpi():
        lib = ctypes.CDLL(path)
        provided, index, count = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        handle, value = ctypes.c_void_p(), ctypes.c_uint64(0)  # the variable is a C bool: wider is safe
        if lib.MPI_T_init_thread(0, ctypes.byref(provided)) != 0:
            continue
        try:
            if (lib.MPI_T_cvar_get_index(b"mpi_ft_enable", ctypes.byref(index)) == 0
                    and lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle), ctypes.byref(count)) == 0):
                read = lib.MPI_T_cvar_read(handle, ctypes.byref(value))
                lib.MPI_T_cvar_handle_free(ctypes.byref(handle))
                return read == 0 and value.value & 0xFF != 0
        finally:
            lib.MPI_T_finalize()
    return False
