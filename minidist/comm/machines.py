"""Which machine each rank runs on, as MPI itself says: the shared-memory split.

``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`` groups the ranks that can share memory, which are the
ranks the launcher placed on one machine: hydra's hostfile lines (``mpiexec -f hosts``), Open MPI's
``--host a:2,b:2``, Slurm's nodes under ``srun``. A hostfile that names one machine twice makes two
"machines" of it, as far as MPI (and so minidist) is concerned, which is how the tests rehearse a
cluster on one computer. Hostfile names are not asked: two names can be one machine, and one name
(``localhost``) every machine. Each machine's own host name (``MPI_Get_processor_name``) is asked,
only to say when machines are rehearsed on one host, and to count the cores a host's ranks share.

Three things follow from the answer, all from :func:`machines_of` (or :func:`from_mpi`):

- the GPU of a rank: its index among the ranks of its machine (``local_rank``), under ``--device
  cuda`` and the NCCL backend;
- its share of its host's cores for BLAS threads (``host_size``: ``minidist/threads.py``; the same
  as ``local_size`` but when several "machines" are rehearsed on one host);
- the mesh's report of which axes' groups stay inside a machine and which cross machines
  (``parallel/mesh.py``), said by the trainer at start-up and by ``--explain``.

    ranks:    0 1 2 3      hostfile:  a:2
    machine:  0 0 1 1                 b:2
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Machines:
    """The machine of every rank of a world (``of_rank[r]``), machines numbered in the order of
    their lowest rank: rank 0 is always on machine 0; and each machine's host name (``hosts[m]``;
    empty: not asked, each machine its own host)."""
    of_rank: tuple[int, ...]
    hosts: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return len(set(self.of_rank))

    def ranks_on(self, machine: int) -> list[int]:
        """The ranks of ``machine``, in rank order."""
        return [r for r, m in enumerate(self.of_rank) if m == machine]

    def local_rank(self, rank: int) -> int:
        """``rank``'s index among the ranks of its machine, in rank order (which GPU it takes)."""
        return self.ranks_on(self.of_rank[rank]).index(rank)

    def local_size(self, rank: int) -> int:
        """How many ranks share ``rank``'s machine."""
        return self.of_rank.count(self.of_rank[rank])

    def host_size(self, rank: int) -> int:
        """How many ranks share ``rank``'s host (its cores): the ranks of every machine of its host name."""
        if not self.hosts:
            return self.local_size(rank)
        host = self.hosts[self.of_rank[rank]]
        return sum(self.hosts[m] == host for m in self.of_rank)

    def rehearsed(self) -> list[str]:
        """The host names that several machines share (a cluster rehearsed on one computer): empty
        for a real cluster, or when the names were not asked."""
        return sorted(h for h in set(self.hosts) if self.hosts.count(h) > 1)

    def of_ranks(self, ranks) -> "Machines":
        """The machines of a group of ``ranks`` (a population member's), its ranks numbered from 0 in
        the order given, its machines in the order of their lowest rank: asked of nothing, sent nothing."""
        mine = [self.of_rank[r] for r in ranks]
        order = list(dict.fromkeys(mine))
        return Machines(tuple(order.index(m) for m in mine), tuple(self.hosts[m] for m in order) if self.hosts else ())

    def spanned(self, ranks) -> list[int]:
        """The machines that ``ranks`` run on, in order: one for a group inside a machine."""
        return sorted({self.of_rank[r] for r in ranks})

    def __str__(self) -> str:
        """``2 machines: ranks 0-1 on machine 0, ranks 2-3 on machine 1``; rehearsed on one host:
        ``2 machines (rehearsed on one host, vm): ...``."""
        parts = [f"ranks {_ranges(self.ranks_on(m))} on machine {m}" for m in range(self.count)]
        shared = self.rehearsed()
        how = ("" if not shared else f" (rehearsed on one host, {shared[0]})" if len(set(self.hosts)) == 1
               else f" (some rehearsed on one host: {', '.join(shared)})")
        return f"{self.count} machine{'s' * (self.count > 1)}{how}: " + ", ".join(parts)


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    runs, start = [], ranks[0]
    for prev, r in zip(ranks, ranks[1:] + [None]):
        if r != prev + 1:
            runs.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = r
    return ", ".join(runs)


def one_machine(size: int) -> Machines:
    """``size`` ranks on one machine: the thread ranks of one process (``run_local``), or a process alone."""
    return Machines((0,) * size)


def from_mpi(comm) -> Machines:
    """The machines of ``comm``'s ranks (an mpi4py communicator). Collective over ``comm``: one
    ``Split_type(COMM_TYPE_SHARED)``, one broadcast of the machine's lowest rank inside it, and one
    ``allgather`` of that rank and this rank's host name (an int and a short string per rank) over ``comm``."""
    from mpi4py import MPI
    if comm.Get_size() == 1:
        return one_machine(1)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())  # the ranks of this machine
    lowest = node.bcast(comm.Get_rank(), root=0)  # key = rank: the split's rank 0 is its lowest rank
    node.Free()
    every = comm.allgather((lowest, MPI.Get_processor_name()))
    number = {r: m for m, r in enumerate(sorted({r for r, _ in every}))}
    hosts = {number[r]: host for r, host in every}
    return Machines(tuple(number[r] for r, _ in every), tuple(hosts[m] for m in range(len(number))))


def machines_of(world) -> Machines:
    """The machines of a :class:`~minidist.comm.group.ProcessGroup`'s ranks: over MPI, from its
    communicator (:func:`from_mpi`, collective: every rank calls it); thread ranks share this
    machine (:func:`one_machine`), nothing sent."""
    comm = getattr(world.transport, "comm", None)  # MPITransport's communicator; threads have none
    return from_mpi(comm) if comm is not None else one_machine(world.size)
