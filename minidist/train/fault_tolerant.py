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
"""
from __future__ import annotations

import dataclasses
import time

from minidist.comm.fault_tolerance import leave, shrink, ulfm_problem
from minidist.comm.mpi_transport import MPITransport
from minidist.parallel.data.sampler import DistributedSampler
from minidist.parallel.drop_replicas import drop_replicas
from minidist.parallel.zero.shard_copies import ShardCopies
from minidist.train.build import build_parallel
from minidist.train.feed import rank_spans


class FaultTolerance:
    """A run's way through the loss of replicas: ``run`` is the :class:`~minidist.train.life.Run` it
    belongs to. ``able``: whether this job can drop a replica (None where the MPI cannot, after it said
    why); ``dropped``: the world ranks lost so far (their old numbers, in the order they went)."""

    def __init__(self, run):
        self.run, self.dropped, self.copies = run, [], None
        mpi = isinstance(run.world.transport, MPITransport)
        problem = ulfm_problem() if mpi else "ranks that are threads of one process cannot lose one another"
        if problem is not None:
            if run.speaks:
                print(f"--fault-tolerant: {problem}", flush=True)
            return
        self.copies = ShardCopies(run.state)  # (train/config.py allows ZeRO-1 and 2 only)
        self.copies.save()  # the first step's start

    @property
    def able(self) -> bool:
        return self.copies is not None

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
        run.survived()
        if run.world.rank == 0:
            print(f"step {step + 1:5d}  ranks {', '.join(map(str, shrunk.gone))} lost ({error.__class__.__name__}); "
                  f"going on with dp {cfg.dp} on {run.world.size} ranks, the step redone "
                  f"({time.monotonic() - start:.3f} s)", flush=True)

    def leave(self, code: int = 0) -> None:
        """A job whose world shrank ends here, without MPI_Finalize (comm/fault_tolerance.py's ``leave``);
        nothing when no rank was lost."""
        if self.dropped:
            leave(self.run.world, code)
