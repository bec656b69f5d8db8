"""Train a GPT: the loop of ``python -m minidist.train`` (its entry point: train/entry.py).

The script reads top to bottom as parse -> validate -> build -> loop -> outputs, each step in a file
named after it, so later lessons can swap one of them (data-parallel batches, a tensor-parallel
model, a ZeRO optimizer) and keep the rest:

    parse_args -> TrainConfig       the command line as one dataclass        (train/cli.py)
    Run(cfg, world)                 the run's start (train/life.py): every rank rejects a bad layout
                                    before anything is sent (check_flags), reads the train / validation
                                    tokens (load_data, train/build.py), builds this rank's model part,
                                    its state (parallel/state.py) and pipeline engine (build_parallel)
    run.advance(cfg.steps)          the loop: batch -> forward -> backward -> clip -> lr -> step
                                    (one step under any layout: minidist/parallel/step.py)
    run.finish(), sample            export, trace files, generated text       (train/outputs.py)

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
from minidist.train.life import Run


def train(cfg, progress=True, world=None, keep_history=True, memory_bytes=None, progress_every=5.0, stopping=None):
    """Run the training of ``cfg`` on ``world`` (a ProcessGroup of dp * pp * cp * tp ranks; None: one
    process), its whole life (train/life.py: start, steps, stop). Returns (model, history): this
    rank's model (or pipeline stage) and one dict per step run here (the same on every rank; with
    ``keep_history=False`` only the last, so a long run's memory stays flat); global rank 0 writes
    ``cfg.out``, ``cfg.export``, and prints; with ``cfg.trace`` every rank streams its trace events to
    disk as they happen. With ``cfg.ckpt_dir`` it saves checkpoints and ``cfg.resume`` continues from
    the newest. A run that diverges raises :class:`~minidist.train.divergence.Diverged` on every rank
    at the same step (train/divergence.py), after that step's metrics line and before any checkpoint
    of it. A run that cannot fit in ``memory_bytes`` (what the entry point read; None: int64's sizes)
    is refused (train/memory.py). ``progress``: rank 0 shows a bar on a terminal, else a line every
    ``progress_every`` seconds (train/progress.py). ``stopping`` (train/stopping.py) learns how many
    steps are done."""
    with Run(cfg, world, memory_bytes=memory_bytes, stopping=stopping, progress=progress,
             progress_every=progress_every, keep_history=keep_history) as run:
        history = run.advance(run.cfg.steps)
        run.finish()
    return run.model, history
