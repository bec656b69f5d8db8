"""One run's life: its start, its steps, its stop, the same for every mode that trains a GPT collectively.

    with Run(cfg, world) as run:     start: every check once, then the folders held, the mesh and the
                                     model's state built, a checkpoint resumed
        run.advance(cfg.steps)       steps: batch -> forward -> backward -> clip -> update, its metrics,
                                     evaluations and saves (one step under any layout: parallel/step.py)
        run.finish()                 the save in flight waited for; exports and the memory report
                                                                   (leaving the block) stop: below

**Start.** Everything that can refuse the run does, on every rank, before anything is sent or
written: the flags and the layout (train/config.py, parallel/spec.py), the data (a folder's every
shard hashed), whether it fits in memory. Only then does the run send: the folders it holds
(train/folders.py), the mesh's groups, the model's state (parallel/state.py), the resumed checkpoint.
Each is made once: a population member (train/pbt.py) is a Run on its sub-group made at the start
and continued across ready points, never re-entered.

A stop signal that comes during the start-up is held until the start-up ends (train/stopping.py:
``Stopping.deferred``): the mesh's and the checkpoints' communicator splits are MPI's own collectives,
which no rank can leave, so every rank makes them all, then every rank stops.

**Stop.** However the run ends (finished, diverged, stopped by a signal, failed), leaving the block
removes what it leaves behind: the offload files, an unfinished save, the folders' locks, the open
metrics and trace files. None of it sends anything or splits a communicator, so a stop never waits
on a peer beyond the ``--comm-timeout`` of a collective already in flight.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

from minidist.checkpoint.identity import run_identity
from minidist.checkpoint.training import TrainingCheckpoints, crash_here, hang_here
from minidist.comm import CommTimeoutError
from minidist.comm.machines import machines_of
from minidist.data.prefetch import Prefetcher
from minidist.optim import lr_at
from minidist.parallel.data.sampler import DistributedSampler
from minidist.parallel.expert.experts import expert_load
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.step import train_step
from minidist.train.build import build_parallel, load_data, select_device, with_hf_model, world_of_one
from minidist.train.config import check_flags, fault_injection_armed, refuse
from minidist.train.describe import describe_data, describe_layout, memory_table
from minidist.train.divergence import DivergenceWatch
from minidist.train.fault_tolerant import FaultTolerance
from minidist.train.feed import dropout_key, next_batch, rank_spans, read_batch
from minidist.train.folders import held_folders
from minidist.train.memory import memory_problems
from minidist.train.outputs import estimate_val_loss, explain_step, metrics_line, open_metrics, trace_file, write_outputs
from minidist.train.progress import Progress
from minidist.train.stopping import Stopping, stop_signal


def started(cfg, world_size: int, memory_bytes: int | None = None):
    """(cfg, corpus): every check of a run's start, each once, on every rank alike, sending nothing:
    the flags and the layout, then (none wrong) the data (train/build.py: ``load_data``, which gives
    the model its vocabulary), then whether one rank's run fits in ``memory_bytes`` (None: int64's
    sizes; train/memory.py). A :class:`ConfigError` lists what is wrong."""
    cfg = with_hf_model(cfg)  # --init-from-hf: the model's size from the folder
    check_flags(cfg, world_size)
    cfg, corpus = load_data(cfg)
    refuse(memory_problems(cfg, memory_bytes))
    return cfg, corpus


class Run:
    """One run of ``cfg`` on ``world`` (a ProcessGroup of dp * pp * cp * tp ranks; None: one process),
    from its start to its stop (module docstring). ``machines``: which machine each rank of ``world``
    is on (None: asked of MPI here, ``comm/machines.py``). ``memory_bytes``: what this rank may hold
    (None: int64's sizes). ``stopping`` (train/stopping.py) learns how many steps are done. ``quiet``:
    it prints nothing (its metrics are still written); ``progress``: rank 0 shows a bar on a terminal,
    else a line every ``progress_every`` seconds. ``explored``: the hyper-parameters its checkpoints'
    identity leaves out (a population member's). ``keep_history`` False: :meth:`advance` returns only
    the last step's record, so a long run's memory stays flat. ``--fault-tolerant``: ``command`` is the
    trainer's own, which a spare replica runs (None: no spare started); ``joining``, on a rank that joined
    a running job, what it learned (train/fault_tolerant.py): it resumes nothing, holds no folder, and
    takes the step and the state from the old ranks.

    After the start: ``cfg`` (with the data's vocabulary), ``corpus``, ``mesh``, ``model`` (this rank's
    part), ``state`` (the model's state, parallel/state.py), ``engine`` (the pipeline's, or None) and
    ``step`` (the next step to run)."""

    def __init__(self, cfg, world=None, *, machines=None, memory_bytes=None, stopping=None, quiet=False,
                 progress=True, progress_every=5.0, explored=(), keep_history=True, command=None, joining=None):
        self.world = world if world is not None else world_of_one()
        self.cfg, self.corpus = started(cfg, self.world.size, memory_bytes)  # nothing sent before this
        self.machines = machines if machines is not None else machines_of(self.world)
        self.stopping = stopping if stopping is not None else Stopping()
        self._quiet, self.speaks = quiet, self.world.rank == 0 and not quiet
        self.progress, self.progress_every, self.keep_history = progress and self.world.rank == 0, progress_every, keep_history
        self.state = self.ckpts = None
        self._held = contextlib.ExitStack()
        try:
            with self.stopping.deferred():  # its splits are collective: a stop waits for the start-up's end
                self._build(explored, command, joining)
        except BaseException:
            self.close()
            raise

    def _build(self, explored, command, joining) -> None:
        cfg, world = self.cfg, self.world
        if joining is None:  # (a joining rank's folders are the old ranks')
            self._held.enter_context(held_folders(cfg, world, self.machines))  # --ckpt-dir, --offload-dir: this run's alone
        select_device(cfg, self.machines.local_rank(world.rank))
        self._form()
        mesh = self.mesh
        if self.speaks:
            print(f"{self.state.parameter_count():,} parameters on rank 0, {len(self.corpus.train):,} train / "
                  f"{len(self.corpus.val):,} val tokens, {cfg.batch_size} x {cfg.block_size} tokens per step, {mesh!r}")
            print(describe_data(cfg, self.corpus))
            if world.size > 1:
                print(describe_layout(cfg, mesh, self.model))
        self._identity = run_identity(cfg, self.corpus.identity, explored)
        self.ckpts = self._checkpoints()
        self.step = self.first = joining.step if joining else self.ckpts.resume(self.state)[0] if cfg.resume else 0
        self.metrics = self._held.enter_context(open_metrics(cfg.out if world.rank == 0 else None, self.step))
        self._held.enter_context(trace_file(cfg, world.trace))
        self.watch = DivergenceWatch(mixed_precision=self.state.scaler is not None)
        self.tolerance = (FaultTolerance(self, command, joining) if cfg.fault_tolerant  # its copies of the step's
                          else None)  # start (a joining rank: its state handed over first)

    def _form(self) -> None:
        """The mesh's groups split, this rank's rows, the model and its state built on ``world``.
        Sends the splits and the state's own."""
        cfg = self.cfg
        self.mesh = mesh = DeviceMesh.of(self.world, cfg, self.machines)  # its groups: the layout's (parallel/layout.py)
        self.sampler = DistributedSampler(self.corpus.train, cfg.batch_size, cfg.block_size, cfg.seed, mesh.dp_rank,
                                          cfg.dp, spans=rank_spans(cfg, mesh))  # this rank's rows, only what it uses
        self.model, self.state, self.engine = build_parallel(cfg, mesh)

    def rebuild(self) -> None:
        """On a grown world (train/fault_tolerant.py set ``world``, ``cfg`` and ``machines``): the mesh,
        model, state and rows formed again, then what :meth:`survived` makes again. Sends what each sends."""
        self._form()
        self.survived()

    def _checkpoints(self):
        """The run's checkpoints (``--ckpt-dir``), on its mesh, or None; building it is collective."""
        cfg = self.cfg
        return (TrainingCheckpoints(cfg.ckpt_dir, self.mesh, self._identity, save_every=cfg.save_every, keep=cfg.keep,
                                    async_save=cfg.async_save, quiet=self._quiet) if cfg.ckpt_dir else None)

    def survived(self) -> None:
        """After lost replicas were dropped or new ones joined (train/fault_tolerant.py re-formed the world,
        mesh, model, state and sampler): what else depends on the world, made again on it: who speaks, the
        checkpoints' writer, and the metrics file on the new rank 0 (the earlier steps' rows kept)."""
        self.speaks = self.world.rank == 0 and not self._quiet
        self.ckpts = self._checkpoints()
        if self.world.rank == 0 and self.metrics is None:
            self.metrics = self._held.enter_context(open_metrics(self.cfg.out, self.step))

    def advance(self, until: int) -> list[dict]:
        """Run steps ``step`` .. ``until - 1`` (evaluating the last), saving when due. Returns one dict
        per step (the same on every rank; with ``keep_history`` False only the last). Raises
        :class:`~minidist.train.divergence.Diverged` on every rank at the same step, after its metrics
        line and before any checkpoint of it."""
        cfg, world, mesh, state = self.cfg, self.world, self.mesh, self.state
        history = []
        reads = Prefetcher(lambda s: read_batch(self.sampler, s, cfg.device), range(self.step, until), not cfg.no_prefetch)
        with reads:  # (after a drop the run reads its new rows itself: reads None)
            # rank 0's progress: a bar on a terminal; under mpiexec or piped, a line every few seconds
            shown = Progress(self.step, until, cfg.batch_size * cfg.block_size, every_s=self.progress_every,
                             enabled=self.progress)
            for step in shown:
                if self.tolerance is not None and self.tolerance.step_starts(step):  # --grow-at: spares joined
                    cfg, world, mesh, state, reads = self.cfg, self.world, self.mesh, self.state, None
                if step == cfg.fail_at_step and fault_injection_armed(cfg) and mesh.rank == cfg.fail_rank:
                    hang_here() if cfg.fail_hang else crash_here()
                lr = lr_at(step, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr)
                while True:  # once; again after lost replicas were dropped (--fault-tolerant)
                    t0 = time.perf_counter()
                    try:
                        with world.trace.capture() as step_events:  # every event of the step, for --explain
                            batch, data_wait_s = (next_batch(reads, step, world.trace) if reads is not None  # (B/dp, T+1)
                                                  else (read_batch(self.sampler, step, cfg.device)[0], 0.0))
                            loss_scale = state.scaler.scale if state.scaler else None  # this step's backward's
                            loss, grad_norm = train_step(self.model, state, batch, lr, cfg.grad_clip, engine=self.engine,
                                                         mesh=mesh, n_micro=cfg.micro_batches, trace=world.trace,
                                                         dropout=dropout_key(cfg, step, self.sampler))
                        break
                    except CommTimeoutError as lost:  # a dead peer (ProcessFailedError), or a hung one
                        if self.tolerance is None or not self.tolerance.able:
                            raise
                        self.tolerance.drop(lost, step)  # the survivors' world, mesh, model, state and rows (and spares)
                        cfg, world, mesh, state, reads = self.cfg, self.world, self.mesh, self.state, None
                if self.tolerance is not None:
                    self.tolerance.step_ends()  # the next step's start, kept here and on the next replica
                tokens_per_s = cfg.batch_size * cfg.block_size / (time.perf_counter() - t0)
                if step == self.first and cfg.explain:
                    explain_step(mesh, self.model, step_events, batch.shape, state)
                if step == self.first and self.speaks and state.memory_rows():  # after a step: each state at its size
                    shown.write(memory_table(state))
                record = {"step": step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_s, "grad_norm": grad_norm,
                          "data_wait_s": data_wait_s}
                if cfg.n_experts:  # the routing's load per expert (one small all-reduce)
                    record.update(expert_load(self.model, mesh, cfg.micro_batches))
                if state.scaler:
                    record.update(loss_scale=loss_scale, skipped=grad_norm is None)
                if step % cfg.eval_every == 0 or step in (cfg.steps - 1, until - 1):
                    record["val_loss"] = estimate_val_loss(self.model, self.corpus.val, cfg, self.engine,
                                                           self.sampler.spans)
                    if self.speaks:  # counted as the progress line and the checkpoints count: steps done
                        shown.write(f"step {step + 1:5d}  train loss {loss:.4f}  val loss {record['val_loss']:.4f}")
                shown.update(step, loss, data_wait_s)
                if not self.keep_history:
                    history.clear()  # only the last record: memory stays flat however long the run
                history.append(record)
                if self.metrics is not None:
                    self.metrics.write(metrics_line(record))
                    self.metrics.flush()
                self.step = step + 1
                with self.watch.stops(self.ckpts):
                    self.watch.after_step(step, loss, grad_norm)  # before the save: a diverged step is never saved
                    if self.ckpts is not None:
                        saved = self.ckpts.after_step(step, state, {"seed": cfg.seed})
                        if saved and self.speaks:
                            shown.write(saved)
                self.stopping.done = step + 1  # what a stop signal reports (train/stopping.py)
        return history

    def explore(self, hparams: dict) -> None:
        """A population member's new hyper-parameters (lr, min_lr, grad_clip: read each step;
        weight_decay: the optimizer's) from the next step on; sends nothing."""
        self.cfg = dataclasses.replace(self.cfg, **hparams)
        self.state.set_weight_decay(self.cfg.weight_decay)

    def reload(self) -> None:
        """Continue from the newest checkpoint in the run's folder (a population member's, after its
        donor's was copied there): the model's state read in place, nothing rebuilt, nothing sent."""
        self.step = self.ckpts.resume(self.state)[0]
        self.watch = DivergenceWatch(mixed_precision=self.state.scaler is not None)

    def finish(self, **outputs) -> None:
        """The end of the steps: the save in flight waited for, then ``--export`` / ``--export-hf`` and
        the memory report (train/outputs.py; collective over the mesh). ``outputs``: other paths for
        them than the config's (a population member writes its own in its checkpoint folder)."""
        if self.ckpts is not None:
            with self.watch.stops(self.ckpts):
                self.ckpts.wait()
        write_outputs(dataclasses.replace(self.cfg, **outputs), self.model, self.state, self.mesh, quiet=not self.speaks)

    def close(self, signum: int = 0) -> None:
        """The stop (module docstring): offload files, an unfinished save, locks and open files, each
        removed or closed here; sends nothing. ``signum``: the stop signal that ended the run, if one
        did (a save it interrupted tells the other ranks, writer.py). Safe to call twice."""
        try:
            if self.state is not None:
                self.state.close()
            if self.ckpts is not None:
                self.ckpts.abandon(signum)  # (a run that finished has no save in flight: nothing to remove)
        finally:
            self._held.close()

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.close(stop_signal(error))
