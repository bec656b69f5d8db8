"""Train a GPT: the loop of ``python -m minidist.train`` (its entry point: train/entry.py).

The script reads top to bottom as parse -> validate -> build -> loop -> outputs, each step in a file
named after it, so later lessons can swap one of them (data-parallel batches, a tensor-parallel
model, a ZeRO optimizer) and keep the rest:

    parse_args -> TrainConfig       the command line as one dataclass        (train/cli.py)
    check_config(cfg, world_size)   every rank rejects a bad layout before anything is sent
    load_data(cfg)                  train / validation tokens: a file or shards, read by pread  (train/build.py)
    build_parallel(cfg, mesh)       this rank's model part, optimizer, gradient sync, pipeline engine
    train(cfg)                      the loop: batch -> forward -> backward -> clip -> lr -> step
                                    (one step under any layout: minidist/parallel/step.py)
    write_outputs, sample           export, trace files, generated text       (train/outputs.py)

Parallel runs start the same script under MPI, e.g. 4 ranks as 2 data-parallel replicas of a 2-way
tensor-parallel model, each step's batch cut into 2 micro-batches:

    mpiexec -n 4 python -m minidist.train --dp 2 --tp 2 --micro-batches 2

or 8 ranks in 3D: 2 replicas of a 2-stage pipeline (1F1B over 8 micro-batches) whose stages are
2-way tensor-parallel, optimizer states sharded over the replicas (ZeRO stage 1):

    mpiexec -n 8 python -m minidist.train --dp 2 --pp 2 --tp 2 --schedule 1f1b --micro-batches 8 --zero 1

Every layout trains to the same numbers as one process on the full batch (tests/test_train_parallel*.py,
tests/test_train_zero.py, tests/test_train_pipeline.py).

``--device cuda`` keeps parameters, gradients, optimizer states and batches on the GPU (CuPy arrays,
one GPU per rank); everything else, and every number, stays as it is (tests/test_device_training.py).

Also: ``--ckpt-dir D --save-every N`` saves sharded checkpoints and ``--resume`` continues from the
newest valid one in any layout (minidist/checkpoint/training.py; ``python -m minidist.run`` restarts
a failed job with it); ``--mode ps --servers K`` trains with parameter servers instead of
collectives (train/ps.py); ``--dtype float16 | bfloat16`` trains in mixed precision (float32 masters, loss
scaling); ``--explain`` prints what every rank holds and sends in its first step; ``--trace DIR``
leaves a run directory for ``python -m minidist.inspect DIR``. A run whose loss or gradient norm
becomes NaN or inf stops with exit status 5, naming the step and the newest valid checkpoint, and no
checkpoint of it is written (train/divergence.py).

With no arguments it trains a 2-layer, 64-wide GPT on the generated default corpus (English-like
sentences, see minidist/data/corpus.py) for 800 steps: about a minute on one CPU core, validation loss
5.50 -> 0.62, and the sample printed at the end reads like the corpus. ``--out DIR`` writes one JSON
object per step to DIR/metrics.jsonl (step, loss, lr, tokens_per_s, grad_norm; val_loss on
evaluation steps; with --n-experts the routing: expert_load per MoE block, expert_imbalance, dropped,
aux_loss).
"""
import time

from minidist.checkpoint.identity import run_identity
from minidist.checkpoint.training import TrainingCheckpoints, crash_here
from minidist.comm.machines import machines_of
from minidist.data import ByteTokenizer
from minidist.data.prefetch import Prefetcher
from minidist.optim import lr_at
from minidist.parallel.data.sampler import DistributedSampler
from minidist.parallel.expert.experts import expert_load
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.step import loss_scaler, train_step
from minidist.train.build import build_parallel, load_data, select_device, with_hf_model, world_of_one
from minidist.train.config import check_config, fault_injection_armed, runs_zero_optimizer
from minidist.train.describe import describe_data, describe_layout, memory_table
from minidist.train.divergence import DivergenceWatch
from minidist.train.feed import dropout_key, next_batch, rank_spans, read_batch
from minidist.train.folders import held_folders
from minidist.train.outputs import estimate_val_loss, explain_step, metrics_line, open_metrics, trace_file, write_outputs
from minidist.train.progress import Progress
from minidist.train.stopping import Stopping


def train(cfg, progress=True, world=None, keep_history=True, memory_bytes=None, progress_every=5.0, stopping=None,
          stop_at=None, explored=(), quiet=False):
    """Run the training loop of ``cfg`` on ``world`` (a ProcessGroup of dp * pp * cp * tp ranks; None:
    one process). Returns (model, history): this rank's model (or pipeline stage) and one dict per
    step run here (the same on every rank; with ``keep_history=False`` only the last, so a long run's
    memory stays flat); global rank 0 writes ``cfg.out``, ``cfg.export``, and prints; with
    ``cfg.trace`` every rank streams its trace events to disk as they happen. With ``cfg.ckpt_dir``
    it saves checkpoints and ``cfg.resume`` continues from the newest. A run that diverges raises
    :class:`~minidist.train.divergence.Diverged` on every rank at the same step (train/divergence.py),
    after that step's metrics line and before any checkpoint of it. A run that cannot fit in
    ``memory_bytes`` (what the entry point read; None: int64's sizes) is refused (train/memory.py).
    ``progress``: rank 0 shows a bar on a terminal, else a line every ``progress_every`` seconds
    (train/progress.py). ``stopping`` (train/stopping.py) learns how many steps are done. ``stop_at``:
    the run stops before this step (a segment of a population member: train/pbt.py), evaluating the
    step before it; ``explored``: the hyper-parameters its checkpoints' identity leaves out; ``quiet``:
    it prints nothing (its metrics are still written)."""
    world = world if world is not None else world_of_one()
    cfg = with_hf_model(cfg)  # --init-from-hf: the model's size from the folder (checked: nothing sent yet)
    check_config(cfg, world.size, memory_bytes)  # every output path too, before the first step
    cfg, corpus = load_data(cfg)  # may refuse the data: before anything is sent; the data's vocabulary
    if cfg.vocab_size != ByteTokenizer.vocab_size:
        check_config(cfg, world.size, memory_bytes)  # the memory of its embeddings
    machines = machines_of(world)  # which machine each rank is on: its GPU, its folders, the mesh's report
    with held_folders(cfg, world, machines):  # --ckpt-dir, --offload-dir: this run's alone until it ends
        return _train_held(cfg, world, machines, corpus, progress, keep_history, progress_every,
                           stopping if stopping is not None else Stopping(), stop_at or cfg.steps, explored, quiet)


def _train_held(cfg, world, machines, corpus, progress: bool, keep_history: bool,
                progress_every: float, stopping: Stopping, stop: int, explored, quiet: bool):
    """The run of :func:`train` once its folders are held."""
    select_device(cfg, machines.local_rank(world.rank))
    lead = world.rank == 0
    speaks = lead and not quiet  # a population member's segments print nothing (train/pbt.py)
    mesh = DeviceMesh(world, dp=cfg.dp, pp=cfg.pp, tp=cfg.tp, cp=cfg.cp, ep=cfg.ep, machines=machines)
    sampler = DistributedSampler(corpus.train, cfg.batch_size, cfg.block_size, cfg.seed, mesh.dp_rank, cfg.dp,
                                 spans=rank_spans(cfg, mesh))  # this rank's rows, and of each only what it uses
    model, optimizer, dp, engine, amp = build_parallel(cfg, mesh)
    scaler = loss_scaler(optimizer, amp)  # mixed precision's, or None
    if speaks:
        n_params = (sum(s.unit.numel for s in optimizer.shards) if runs_zero_optimizer(cfg)  # ZeRO-3 holds shards only
                    else sum(p.data.size for p in model.parameters()))
        print(f"{n_params:,} parameters on rank 0, {len(corpus.train):,} train / {len(corpus.val):,} val "
              f"tokens, {cfg.batch_size} x {cfg.block_size} tokens per step, {mesh!r}")
        print(describe_data(cfg, corpus))
        if world.size > 1:
            print(describe_layout(cfg, mesh, model))
    ckpts = (TrainingCheckpoints(cfg.ckpt_dir, mesh, run_identity(cfg, corpus.identity, explored), save_every=cfg.save_every,
                                 keep=cfg.keep, async_save=cfg.async_save, quiet=quiet) if cfg.ckpt_dir else None)
    start = ckpts.resume(model, optimizer, amp, scaler)[0] if cfg.resume else 0
    history, watch = [], DivergenceWatch(mixed_precision=scaler is not None)
    close = optimizer.close if runs_zero_optimizer(cfg) else None  # offload: its files go however the run ends
    try:
        reads = Prefetcher(lambda s: read_batch(sampler, s, cfg.device), range(start, stop), not cfg.no_prefetch)
        with open_metrics(cfg.out if lead else None, start) as metrics_file, trace_file(cfg, world.trace), reads:
            # rank 0's progress: a bar on a terminal; under mpiexec or piped, a line every few seconds
            shown = Progress(start, stop, cfg.batch_size * cfg.block_size, every_s=progress_every,
                             enabled=progress and lead)
            for step in shown:
                if step == cfg.fail_at_step and fault_injection_armed(cfg) and mesh.rank == cfg.fail_rank:
                    crash_here()
                lr = lr_at(step, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr)
                t0 = time.perf_counter()
                with world.trace.capture() as step_events:  # every event of the step, for --explain
                    batch, data_wait_s = next_batch(reads, step, world.trace)  # (B/dp, T+1): this rank's rows
                    loss_scale = scaler.scale if scaler else None  # the scale this step's backward uses
                    loss, grad_norm = train_step(model, optimizer, batch, lr, cfg.grad_clip, dp=dp, engine=engine,
                                                 mesh=mesh, n_micro=cfg.micro_batches,
                                                 trace=world.trace, amp=amp,
                                                 dropout=dropout_key(cfg, step, sampler))
                tokens_per_s = cfg.batch_size * cfg.block_size / (time.perf_counter() - t0)
                if step == start and cfg.explain:
                    explain_step(cfg, mesh, model, step_events, batch.shape, optimizer)
                if step == start and runs_zero_optimizer(cfg) and speaks:  # after a step: each model state at its size
                    shown.write(memory_table(optimizer))
                record = {"step": step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_s, "grad_norm": grad_norm,
                          "data_wait_s": data_wait_s}
                if cfg.n_experts:  # the routing's load per expert (one small all-reduce)
                    record.update(expert_load(model, mesh, cfg.micro_batches))
                if scaler:
                    record.update(loss_scale=loss_scale, skipped=grad_norm is None)
                if step % cfg.eval_every == 0 or step in (cfg.steps - 1, stop - 1):
                    record["val_loss"] = estimate_val_loss(model, corpus.val, cfg, engine, sampler.spans)
                    if speaks:
                        # counted as the progress line and the checkpoints count: steps done
                        shown.write(f"step {step + 1:5d}  train loss {loss:.4f}  val loss {record['val_loss']:.4f}")
                shown.update(step, loss, data_wait_s)
                if not keep_history:
                    history.clear()  # only the last record: memory stays flat however long the run
                history.append(record)
                if metrics_file is not None:
                    metrics_file.write(metrics_line(record))
                    metrics_file.flush()
                with watch.stops(ckpts):
                    watch.after_step(step, loss, grad_norm)  # before the save: a diverged step is never saved
                    if ckpts is not None:
                        saved = ckpts.after_step(step, model, optimizer, {"seed": cfg.seed}, amp, scaler)
                        if saved and speaks:
                            shown.write(saved)
                stopping.done = step + 1  # what a stop signal reports (train/stopping.py)
        if ckpts is not None:
            with watch.stops(ckpts):
                ckpts.wait()
        write_outputs(cfg, model, optimizer, mesh, amp, quiet)
    finally:  # diverged, stopped by a signal, failed: no offload file and no unfinished save is left behind
        if close is not None:
            close()
        if ckpts is not None:
            ckpts.abandon()  # (a run that ended has no save in flight: nothing to remove)
    return model, history
