"""``--fault-tolerant``: a run that loses whole data-parallel replicas drops them and goes on, live.

Under Open MPI 5 started with its fault tolerance (``mpiexec --with-ft ulfm --mca mpi_ft_detector
true``), a rank's death does not end the job: the survivors' next collective raises
:class:`~minidist.comm.transport.ProcessFailedError`. The run (train/life.py) then, on every survivor:

    shrink      revoke the world and the mesh's groups, agree on who is gone, build the survivors'
                world (comm/fault_tolerance.py)
    re-form     the mesh with dp - k replicas (the dead replicas' places closed up), a new model over
                the new tp group and ZeRO over the new dp group, holding the optimizer state of the
                step's start, re-cut from the copies the survivors keep (parallel/drop_replicas.py,
                zero/shard_copies.py)
    redo        the step in progress, from its start, each survivor reading its rows of the same global
                batch (dp_rows over dp - k replicas): from this step on the run is the run that had
                dp - k replicas, to float64 round-off

Each step's start is kept before it runs (``ShardCopies.save`` at the run's start and after every
step: this rank's ZeRO parts, here and on the next dp rank), so the state a death interrupted is never
needed; a replica that dies while the copies are sent, or two neighbours at once, cannot be re-cut
(the survivors say so, on every rank, and the job ends as a lost peer does: resume from a checkpoint). What runs: ZeRO-1 and 2 (each
replica's part of the optimizer state has a copy on the next), tensor parallelism inside a replica, in
float32 or float64 (train/config.py refuses the rest, and says why). Under an MPI without the interface
(MPICH) the run says so at start-up and a death ends the job as without the flag (the restarting
launcher, ``python -m minidist.run --max-restarts``, resumes it from its newest checkpoint).

Replicas also join, live. ``--spares S`` lets the run start S replicas (each of tp ranks) while it
runs: after a drop, as many as were lost join at once, and the step is redone with dp restored;
``--grow-at STEP`` has them all join at that step's start instead (dp + S). On every old rank alike,
at a step boundary (the flags, or the shrink's agreement, decide it):

    agree       no rank has a stop signal pending (one all-reduce; train/stopping.py): a stop ends
                every rank before the join, or waits for the join's end
    grow        start the new ranks, the trainer's own command (MPI_Comm_spawn), and merge them into
                the world, the old ranks first (comm/fault_tolerance.py); tell them the step, the dp
                before and after, the spares left (:class:`Joining`, one broadcast)
    re-form     the mesh with dp + k replicas, the new ones last; a new model and ZeRO over it
    hand over   every old dp rank broadcasts its part of the weights and optimizer state, and every
                rank keeps its part of the grown cut (parallel/zero/hand_over.py); bytes counted
    go on       each rank reads its rows of the same global batch (dp_rows over dp + k)

A new rank's trainer starts on the grown world (``minidist.init``), learns the :class:`Joining`, builds
its Run on it without reading a checkpoint (train/life.py) and receives the state: from that step on
the run is the run that had dp + k replicas, to float64 round-off.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import time

import numpy as np

from minidist.comm.fault_tolerance import grow, leave, shrink, ulfm_problem
from minidist.comm.machines import machines_of
from minidist.comm.mpi_transport import MPITransport
from minidist.parallel.data.sampler import DistributedSampler
from minidist.parallel.drop_replicas import drop_replicas
from minidist.parallel.zero.hand_over import hand_over
from minidist.parallel.zero.shard_copies import ShardCopies, state_arrays
from minidist.process_tree import Process, read_process, signal_processes
from minidist.train.build import build_parallel
from minidist.train.feed import rank_spans


@dataclasses.dataclass(frozen=True)
class Joining:
    """What a new replica learns as it joins: the ``step`` it starts at, the replicas before it
    (``old_dp``) and with it (``dp``), and the ``spares`` the run may still start."""
    step: int
    old_dp: int
    dp: int
    spares: int

    def config(self, cfg, new: bool = False):
        """The run's config from the join on: the grown dp, the spares left, no --grow-at still to come
        at or before this step; on a ``new`` rank also no fault injected, nothing resumed, nothing
        explained (the old ranks did those at the run's start)."""
        grown = dataclasses.replace(cfg, dp=self.dp, spares=self.spares,
                                    grow_at=cfg.grow_at if cfg.grow_at > self.step else -1)
        return dataclasses.replace(grown, fail_at_step=-1, resume=False, explain=False) if new else grown


def announced(world, joining: Joining | None = None) -> Joining:
    """Collective over the grown world: rank 0's ``joining``, on every rank (a new rank passes None).
    Sends one broadcast of four int64 from rank 0."""
    record = np.array(dataclasses.astuple(joining) if joining is not None else [0] * 4, np.int64)  # (4,)
    world.broadcast(record, src=0, label="setup: the joining replicas' step, dp before and after, spares left")
    return Joining(*map(int, record))


def refill(dp: int, lost: int, spares: int, batch_size: int) -> int:
    """How many spares join after ``lost`` replicas were dropped, leaving ``dp``: as many as were lost
    (at most ``spares``), fewer where the global batch would not divide over the replicas."""
    return next((k for k in range(min(lost, spares), 0, -1) if batch_size % (dp + k) == 0), 0)


class FaultTolerance:
    """A run's way through the loss of replicas: ``run`` is the :class:`~minidist.train.life.Run` it
    belongs to; ``command``: the trainer's own, which a spare runs (None: no spare started here);
    ``joining``: on a new rank, what it learned as it joined. ``able``: whether this job can drop a
    replica (None where the MPI cannot, after it said why); ``dropped``: the world ranks lost so far
    (their old numbers, in the order they went)."""

    def __init__(self, run, command=None, joining: Joining | None = None):
        self.run, self.dropped, self.copies, self.command = run, [], None, command
        self.spares = run.cfg.spares  # (a new rank's: those left when it joined)
        self.changed = joining is not None  # the world is not mpiexec's: it ends with leave()
        mpi = isinstance(run.world.transport, MPITransport)
        problem = ulfm_problem() if mpi else "ranks that are threads of one process cannot lose one another"
        if problem is not None:
            if run.speaks:
                print(f"--fault-tolerant: {problem}", flush=True)
            return
        if joining is not None:
            self.receive(joining)  # the state handed over by the old ranks, and the step's start kept
            return
        self.pids = self.census()
        self.copies = ShardCopies(run.state)  # (train/config.py allows ZeRO-1 and 2 only)
        self.copies.save()  # the first step's start

    @property
    def able(self) -> bool:
        return self.copies is not None

    def step_starts(self, step: int) -> bool:
        """At step ``step``'s start: with ``--grow-at`` that step, every spare left joins (:meth:`admit`).
        Returns whether the world grew (the run's mesh, model, state and rows are new)."""
        if self.able and step == self.run.cfg.grow_at and self.spares:
            return self.admit(self.spares, step)
        return False

    def census(self) -> list:
        """Every rank's process (its pid and start time, ``process_tree.Process``), by rank: one all-gather
        of two int64 over the world."""
        me = read_process(os.getpid()) or Process(os.getpid(), 0, "R", -1)  # (no /proc: never signalled)
        rows = self.run.world.all_gather(np.array([[me.pid, me.start]], np.int64), label="setup: every rank's process")
        return [Process(int(pid), 0, "R", int(start)) for pid, start in rows]  # (world, 2) rows

    def end_hung(self, gone, mesh) -> None:
        """SIGKILL the processes of the ranks ``gone`` (old numbers) that run on this rank's machine:
        a hung rank the detector declared dead is still alive, and mpiexec would wait for it (one on
        another machine is left to its launcher). Sends nothing."""
        here = mesh.machines.of_rank[mesh.rank]
        signal_processes([self.pids[r] for r in gone if mesh.machines.of_rank[r] == here], signal.SIGKILL)

    def step_ends(self) -> None:
        """Keep the next step's start (this rank's ZeRO parts, here and on the next dp rank), once a step
        has updated the state: a rank that dies at or in the next step finds its part on its neighbour.
        Sends one exchange over the dp ring (``ShardCopies.save``)."""
        if self.copies is not None:
            self.copies.save()

    def drop(self, error, step: int) -> None:
        """Every survivor, after ``error`` (a dead or hung peer) in step ``step``: shrink the world, re-form
        the run on it with the replicas left, and print (new rank 0) who went and how long it took.
        Sends what ``shrink`` and ``drop_replicas`` send, then the new run's checkpoint writer's split."""
        run, start = self.run, time.monotonic()
        mesh = run.mesh
        shrunk = shrink(mesh.world, [mesh.tp_group, mesh.cp_group, mesh.pp_group, mesh.dp_group])
        self.end_hung(shrunk.gone, mesh)
        self.pids = [self.pids[old] for old in sorted(shrunk.rank_map, key=shrunk.rank_map.get)]
        replicas = mesh.shape.dp - len({mesh.shape.coords(r).dp for r in shrunk.gone})
        cfg = dataclasses.replace(run.cfg, dp=replicas)
        built = {}

        def make_zero(new_mesh):
            built["model"], state, _ = build_parallel(cfg, new_mesh)
            return state

        run.mesh, run.state = drop_replicas(shrunk, mesh, self.copies, make_zero, batch_size=cfg.batch_size)
        run.model, run.cfg, run.world = built["model"], cfg, shrunk.world
        run.sampler = DistributedSampler(run.corpus.train, cfg.batch_size, cfg.block_size, cfg.seed, run.mesh.dp_rank,
                                         cfg.dp, spans=rank_spans(cfg, run.mesh))
        self.copies = ShardCopies(run.state)
        self.copies.save()  # the redone step's start, on the survivors' ring
        self.dropped += list(shrunk.gone)
        self.changed = True
        run.survived()
        if run.world.rank == 0:
            print(f"step {step + 1:5d}  ranks {', '.join(map(str, shrunk.gone))} lost ({error.__class__.__name__}); "
                  f"going on with dp {cfg.dp} on {run.world.size} ranks, the step redone "
                  f"({time.monotonic() - start:.3f} s)", flush=True)
        joining = refill(cfg.dp, mesh.shape.dp - cfg.dp, self.spares if self.command else 0, cfg.batch_size)
        if joining:
            self.admit(joining, step)

    def admit(self, k: int, step: int) -> bool:
        """Every old rank, at step ``step``'s start: ``k`` new replicas join (module docstring), unless a
        stop signal is pending on any rank (then every rank stops: ``Stopped``). Prints (rank 0) the
        spawn's seconds, the bytes each new rank received and the hand-over's seconds. Returns True.
        Sends: the stop's all-reduce, the spawn and merge (MPI's), which machine each rank is on, the
        :class:`Joining`'s broadcast, the grown mesh's splits, the checkpoint writer's, the hand-over's
        broadcasts, the first exchange of the ZeRO copies."""
        run = self.run
        old_mesh, old_state, cfg = run.mesh, run.state, run.cfg
        with run.stopping.agreed(run.world):  # every rank grows, or none: MPI's spawn has no deadline
            start = time.monotonic()
            grown = grow(run.world, k * old_mesh.shape.world // old_mesh.shape.dp, self.command)
            spawn_s = time.monotonic() - start
            run.machines = machines_of(grown)  # (each new rank's entry point asks the same)
            joining = announced(grown, Joining(step, cfg.dp, cfg.dp + k, self.spares - k))
            start = time.monotonic()
            parts = [state_arrays(s, old_state.optimizer.slots) for s in old_state.shards]
            old_state.close()  # its hooks off the old model: the new state's take over
            run.world, run.cfg = grown, joining.config(cfg)
            run.rebuild()  # the grown mesh, a new model and state on it, the rows, the checkpoints' writer
            nbytes, sent_s = self.receive(joining, parts, old_state.step_count)
        self.spares, self.changed = joining.spares, True
        if run.world.rank == 0:
            ranks = f"rank {grown.size - 1}" if grown.size - old_mesh.shape.world == 1 else \
                f"ranks {old_mesh.shape.world}-{grown.size - 1}"
            print(f"step {step + 1:5d}  {k} replica{'s' * (k > 1)} joined ({ranks}, started in {spawn_s:.3f} s); "
                  f"going on with dp {joining.dp} on {grown.size} ranks, the weights and optimizer state handed over "
                  f"({nbytes / 2**20:.3f} MiB to each new rank in {sent_s:.3f} s; joined in "
                  f"{time.monotonic() - start:.3f} s)", flush=True)
        return True

    def receive(self, joining: Joining, parts=None, step_count: int = 0) -> int:
        """Collective over the grown run (every rank, old and new, once its state is built): the state
        handed over (``parts``: an old rank's, None on a new one; parallel/zero/hand_over.py), then the
        next step's start kept (``ShardCopies``). Returns the bytes a new rank receives (the largest) and
        the seconds the hand-over took (the longest)."""
        run = self.run
        self.pids = self.census()
        start = time.monotonic()
        received = hand_over(parts, step_count, joining.old_dp, run.mesh.dp_group, run.state)
        counted = np.array([received, time.monotonic() - start], np.float64)  # (2,)
        run.world.all_reduce(counted, op="max", label="metric: the bytes a joining rank received, the seconds")
        self.copies = ShardCopies(run.state)
        self.copies.save()  # the step's start, on the grown ring
        return int(counted[0]), float(counted[1])

    def leave(self, code: int = 0) -> None:
        """A job whose world shrank or grew ends here (comm/fault_tolerance.py's ``leave``: the old ranks
        without MPI_Finalize); nothing when the world is still mpiexec's."""
        if self.changed:
            leave(self.run.world, code)
