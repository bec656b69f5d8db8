"""Train a GPT: ``python -m minidist.train``.

The script is four steps, each one function, so later lessons can swap one of them (data-parallel
batches, a tensor-parallel model, a ZeRO optimizer) and keep the rest:

    parse_args -> TrainConfig       the command line as one dataclass
    check_config(cfg, world_size)   every rank rejects a bad layout before anything is sent
    load_data(cfg)                  train / validation tokens (memmapped uint8 files)
    build_parallel(cfg, mesh)       this rank's model part, optimizer, gradient sync, pipeline engine
    train(cfg)                      the loop: batch -> forward -> backward -> clip -> lr -> step
                                    (one step under any layout: minidist/parallel/step.py)

Parallel runs start the same script under MPI, e.g. 4 ranks as 2 data-parallel replicas of a 2-way
tensor-parallel model, each step's batch cut into 2 micro-batches:

    mpiexec -n 4 python -m minidist.train --dp 2 --tp 2 --micro-batches 2

or 8 ranks in 3D: 2 replicas of a 2-stage pipeline (1F1B over 8 micro-batches) whose stages are
2-way tensor-parallel, optimizer states sharded over the replicas (ZeRO stage 1):

    mpiexec -n 8 python -m minidist.train --dp 2 --pp 2 --tp 2 --schedule 1f1b --micro-batches 8 --zero 1

Every layout trains to the same numbers as one process on the full batch (tests/test_train_parallel*.py,
tests/test_train_zero.py, tests/test_train_pipeline.py).

Also: ``--ckpt-dir D --save-every N`` saves sharded checkpoints and ``--resume`` continues from the
newest valid one in any layout (minidist/checkpoint/training.py; ``python -m minidist.run`` restarts
a failed job with it); ``--mode ps --servers K`` trains with parameter servers instead of
collectives; ``--dtype float16 | bfloat16`` trains in mixed precision (float32 masters, loss
scaling); ``--explain`` prints what every rank holds and sends in its first step; ``--trace DIR``
leaves a run directory for ``python -m minidist.inspect DIR``.

With no arguments it trains a 2-layer, 64-wide GPT on the generated default corpus (English-like
sentences, see minidist/data/corpus.py) for 800 steps: about a minute on one CPU core, validation loss
5.50 -> 0.62, and the sample printed at the end reads like the corpus. ``--out DIR`` writes one JSON
object per step to DIR/metrics.jsonl (step, loss, lr, tokens_per_s, grad_norm; val_loss on
evaluation steps).
"""
import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from minidist.amp import COMPUTE_DTYPES, DynamicLossScaler, MixedPrecision
from minidist.autograd import no_grad
from minidist.checkpoint import save_state_dict
from minidist.checkpoint.training import TrainingCheckpoints, crash_here
from minidist.comm import LocalTransport, ProcessGroup, init
from minidist.data import (ByteTokenizer, default_corpus, get_batch, inputs_and_targets, load_tokens,
                           train_val_split)
from minidist.explain import print_explanation
from minidist.inspect.write import model_state_bytes, write_memory_report, write_trace
from minidist.model import GPT, GPTConfig
from minidist.optim import SGD, AdamW, lr_at
from minidist.parallel.accounting import format_memory_table
from minidist.parallel.consolidate import consolidated_state_dict, full_state_dict
from minidist.parallel.data_parallel import DataParallel
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.param_server import check_parameter_server, train_parameter_server
from minidist.parallel.pipeline import SCHEDULES, PipelineEngine, PipelineStage
from minidist.parallel.recompute import recompute_blocks
from minidist.parallel.sampler import DistributedSampler, micro_batches
from minidist.parallel.step import forward_backward, train_step  # noqa: F401 (forward_backward: public here)
from minidist.parallel.tp_model import build_tp_gpt
from minidist.parallel.zero import ZeroOptimizer, check_zero_layout

ADAMW_BETAS = (0.9, 0.95)


@dataclasses.dataclass
class TrainConfig:
    """Everything a run depends on. The defaults train visibly in about a minute on one CPU core."""
    steps: int = 800
    batch_size: int = 16
    seed: int = 0
    dtype: str = "float32"
    loss_scale: str = "dynamic"
    loss_scale_window: int = 2000
    # optimizer and schedule
    optimizer: str = "adamw"
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 20
    momentum: float = 0.9
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # model
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64
    # data, evaluation, output
    data: str | None = None
    data_dir: str | None = None
    eval_every: int = 100
    eval_iters: int = 8
    sample_tokens: int = 200
    out: str | None = None
    # parallelism (world size = dp * pp * tp; --mode ps: servers + workers) and what it writes
    mode: str = "collective"
    servers: int = 1
    staleness: int = -1
    straggler: float = 0.0
    dp: int = 1
    pp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    micro_batches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    zero: int = 0
    recompute: bool = False
    bucket_mb: float = 1.0
    export: str | None = None
    trace: str | None = None
    explain: bool = False
    # checkpoints, restarts, and a crash on purpose to test them
    ckpt_dir: str | None = None
    save_every: int = 0
    keep: int = 2
    resume: bool = False
    async_save: bool = False
    fail_at_step: int = -1
    fail_rank: int = 0


class ConfigError(ValueError):
    """A configuration that cannot run. Found from the config alone, identically on every rank,
    before any communication."""


def check_config(cfg, world_size: int) -> None:
    """Raise :class:`ConfigError` listing everything wrong with running ``cfg`` on ``world_size`` ranks."""
    problems = []
    for name in ("dp", "pp", "tp", "micro_batches", "virtual_stages"):
        if getattr(cfg, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
    axes = ("dp", "pp", "tp") if cfg.pp > 1 else ("dp", "tp")
    n = cfg.dp * cfg.pp * cfg.tp
    if cfg.mode == "ps":
        problems += parameter_server_problems(cfg, world_size)
    elif world_size != n:
        problems.append(f"world size {world_size} != {' * '.join(axes)} = "
                        f"{' * '.join(str(getattr(cfg, a)) for a in axes)} = {n} (start {n} ranks: mpiexec -n {n} ...)")
    if cfg.n_embd % cfg.n_head:
        problems.append(f"n_embd {cfg.n_embd} is not divisible by n_head {cfg.n_head}")
    if cfg.n_head % cfg.tp:
        problems.append(f"n_head {cfg.n_head} is not divisible by tp {cfg.tp} (each tp rank holds whole heads)")
    if cfg.batch_size % (cfg.dp * cfg.micro_batches):
        problems.append(f"batch_size {cfg.batch_size} is not divisible by dp * micro_batches = "
                        f"{cfg.dp} * {cfg.micro_batches} (every micro-batch of every dp rank has equal rows)")
    if cfg.sequence_parallel and cfg.tp == 1:
        problems.append("--sequence-parallel needs --tp > 1")
    if cfg.sequence_parallel and cfg.block_size % cfg.tp:
        problems.append(f"block_size {cfg.block_size} is not divisible by tp {cfg.tp} (sequence parallelism "
                        f"splits the sequence over the tp ranks)")
    if cfg.bucket_mb <= 0:
        problems.append(f"--bucket-mb must be positive, got {cfg.bucket_mb}")
    if cfg.schedule not in SCHEDULES:
        problems.append(f"--schedule must be one of {', '.join(SCHEDULES)}, got {cfg.schedule!r}")
    if cfg.pp * cfg.virtual_stages > cfg.n_layer:
        problems.append(f"pp * virtual_stages = {cfg.pp} * {cfg.virtual_stages} pipeline stages need at least "
                        f"as many blocks, n_layer is {cfg.n_layer}")
    if cfg.virtual_stages > 1 and cfg.schedule != "interleaved":
        problems.append(f"--virtual-stages {cfg.virtual_stages} needs --schedule interleaved")
    if cfg.schedule == "interleaved" and cfg.micro_batches % cfg.pp:
        problems.append(f"the interleaved schedule needs micro_batches ({cfg.micro_batches}) to be a multiple "
                        f"of pp ({cfg.pp})")
    try:
        check_zero_layout(cfg.zero, cfg.pp)
    except ValueError as e:
        problems.append(str(e))
    if cfg.zero >= 2 and cfg.sequence_parallel:
        problems.append(f"--zero {cfg.zero} with --sequence-parallel is not supported: the sequence-parallel "
                        "gradient sync adds up full gradients, which ZeRO stages 2 and 3 do not keep (use --zero 1)")
    if cfg.zero == 3 and cfg.recompute:
        problems.append("--recompute with --zero 3 is redundant: ZeRO-3 already recomputes every block in backward")
    problems += checkpoint_problems(cfg, world_size) + mixed_precision_problems(cfg)
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def parameter_server_problems(cfg, world_size: int) -> list[str]:
    """What is wrong with running ``cfg`` in ``--mode ps`` on ``world_size`` ranks (servers + workers,
    whole models: the collective layouts' flags do not apply)."""
    staleness = None if cfg.staleness < 0 else cfg.staleness
    try:
        check_parameter_server(world_size, cfg.servers, staleness, cfg.straggler, cfg.batch_size)
    except ValueError as e:
        problems = [str(e)]
    else:
        problems = []
    collective = [f"--{name.replace('_', '-')}" for name in ("dp", "pp", "tp", "micro_batches", "zero", "ckpt_dir",
                                                             "explain", "sequence_parallel", "recompute")
                  if getattr(cfg, name) not in (1, 0, None, False)]
    if collective:
        problems.append(f"--mode ps trains whole models on its workers: {', '.join(collective)} do not apply")
    return problems


def mixed_precision_problems(cfg) -> list[str]:
    """What mixed precision (--dtype float16 / bfloat16) cannot be combined with, yet."""
    if cfg.dtype not in COMPUTE_DTYPES:
        return []
    problems = []
    if cfg.loss_scale != "dynamic":
        try:
            if not float(cfg.loss_scale) > 0:
                problems.append(f"--loss-scale must be 'dynamic' or a positive number, got {cfg.loss_scale}")
        except ValueError:
            problems.append(f"--loss-scale must be 'dynamic' or a positive number, got {cfg.loss_scale!r}")
    if cfg.zero:
        problems.append(f"--dtype {cfg.dtype} with --zero {cfg.zero} is not supported: ZeRO shards the model's "
                        "own parameters, not float32 master copies")
    if cfg.dtype == "float16" and cfg.tp > 1:
        problems.append("--dtype float16 with --tp > 1 is not supported (use --dtype bfloat16)")
    if cfg.pp > 1:
        problems.append(f"--dtype {cfg.dtype} with --pp > 1 is not supported: the pipeline engine seeds its own "
                        "backward, without the loss scale")
    if cfg.ckpt_dir is not None:
        problems.append(f"--ckpt-dir with --dtype {cfg.dtype} is not supported yet: checkpoints do not save the "
                        "float32 masters and the loss scaler")
    return problems


def checkpoint_problems(cfg, world_size: int) -> list[str]:
    """What is wrong with the checkpoint and fault-injection flags of ``cfg``."""
    problems = []
    if (cfg.save_every or cfg.resume) and cfg.ckpt_dir is None:
        problems.append("--save-every and --resume need --ckpt-dir (where the checkpoints live)")
    if cfg.save_every < 0:
        problems.append(f"--save-every must be >= 0 (0: never), got {cfg.save_every}")
    if cfg.keep < 1:
        problems.append(f"--keep must be >= 1, got {cfg.keep}")
    if cfg.fail_at_step >= 0 and not 0 <= cfg.fail_rank < world_size:
        problems.append(f"--fail-rank {cfg.fail_rank} is not a rank of the {world_size}-rank world")
    return problems


def parse_args(argv=None):
    """The command line as a :class:`TrainConfig` (flags are the field names with dashes)."""
    defaults = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m minidist.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    choices = {"mode": ["collective", "ps"], "dtype": ["float32", "float64", "float16", "bfloat16"], "optimizer": ["sgd", "adamw"], "schedule": list(SCHEDULES),
               "zero": [0, 1, 2, 3]}
    helps = {
        "steps": "optimizer steps", "batch_size": "sequences per step (the global batch)",
        "seed": "seeds the weights and the batches",
        "dtype": "parameter and activation dtype; float16 / bfloat16 (emulated): mixed precision, float32 masters",
        "loss_scale": "mixed precision: 'dynamic' (float16) or a fixed scale", "loss_scale_window":
        "dynamic loss scaling: clean steps before the scale doubles",
        "optimizer": "update rule",
        "lr": "peak learning rate", "min_lr": "learning rate at the end of the cosine decay",
        "warmup": "linear warmup steps", "momentum": "SGD momentum",
        "weight_decay": "decay of >= 2-D parameters", "grad_clip": "max global grad norm (0: off)",
        "data": "a text file to train on (default: the generated corpus)",
        "data_dir": "cache folder of the generated corpus (None: ~/.cache/minidist)",
        "eval_every": "steps between validation-loss estimates",
        "eval_iters": "validation batches per estimate", "sample_tokens": "tokens sampled at the end",
        "out": "directory for metrics.jsonl",
        "n_layer": "transformer blocks", "n_head": "attention heads", "n_embd": "embedding width",
        "block_size": "context length T",
        "mode": "collective (all-reduce and friends) or ps (parameter servers: ranks 0..K-1 serve, the rest work)",
        "servers": "--mode ps: parameter-server ranks", "staleness": "--mode ps: asynchronous with this "
        "staleness bound (-1: synchronous)", "straggler": "--mode ps: seconds of sleep added to every step of worker 0",
        "dp": "data-parallel replicas", "pp": "pipeline stages per replica",
        "tp": "tensor-parallel ranks per pipeline stage",
        "sequence_parallel": "also split LayerNorm/dropout activations along the sequence over tp",
        "micro_batches": "micro-batches per step and dp rank (gradient accumulation; the pipeline's units)",
        "schedule": "pipeline schedule", "virtual_stages": "model chunks per pipeline rank (interleaved schedule)",
        "zero": "ZeRO stage: shard optimizer states (1), + gradients (2), + parameters (3) over dp",
        "recompute": "recompute each block's activations in backward instead of keeping them",
        "bucket_mb": "data-parallel gradient bucket size in MiB",
        "export": "write the consolidated full-model state_dict here (.npz) at the end",
        "trace": "run directory for python -m minidist.inspect: DIR/trace/rank<r>.jsonl, DIR/memory/rank<r>.json",
        "explain": "print each rank's first step: what it holds, what it sends to whom",
        "ckpt_dir": "directory of sharded checkpoints (step-<n>/ folders)",
        "save_every": "steps between checkpoints (0: none)", "keep": "newest checkpoints kept",
        "resume": "continue from the newest valid checkpoint in --ckpt-dir (in any layout)",
        "async_save": "write checkpoints in a background thread while training goes on",
        "fail_at_step": "fault injection: rank --fail-rank kills itself at the start of this step (-1: never; "
                        "not when resuming)",
        "fail_rank": "the rank --fail-at-step kills",
    }
    for field in dataclasses.fields(TrainConfig):
        default = getattr(defaults, field.name)
        flag = "--" + field.name.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", help=helps[field.name])
            continue
        kind = type(default) if default is not None else str
        p.add_argument(flag, type=kind, default=default, choices=choices.get(field.name), help=helps[field.name])
    return TrainConfig(**vars(p.parse_args(argv)))


def load_data(cfg):
    """(train, val) token arrays: ``cfg.data`` if given (a UTF-8 text file is a token file), else
    the default corpus, generated and cached on first use. The last 10% is validation."""
    path = cfg.data if cfg.data is not None else default_corpus(cfg.data_dir)
    return train_val_split(load_tokens(path), val_fraction=0.1)


def build_model(cfg, tp_group=None):
    """A byte-level GPT (vocab 256) of the configured size, initialised from ``cfg.seed``; with
    ``cfg.tp > 1`` this rank's tensor-parallel shard of it over ``tp_group``."""
    config = GPTConfig(vocab_size=ByteTokenizer.vocab_size, block_size=cfg.block_size,
                       n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd)
    dtype = np.dtype(COMPUTE_DTYPES.get(cfg.dtype, cfg.dtype)).name  # mixed precision: how the weights are stored
    if cfg.tp == 1:
        return GPT(config, seed=cfg.seed, dtype=dtype)
    return build_tp_gpt(config, cfg.seed, dtype, tp_group, sequence_parallel=cfg.sequence_parallel)


def build_optimizer(model, cfg, named_parameters=None):
    """AdamW (betas 0.9, 0.95) or SGD with momentum over the model's named parameters (or over
    ``named_parameters``: mixed precision's float32 masters)."""
    params = named_parameters if named_parameters is not None else model.named_parameters()
    if cfg.optimizer == "adamw":
        return AdamW(params, lr=cfg.lr, betas=ADAMW_BETAS, weight_decay=cfg.weight_decay)
    return SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def build_mixed_precision(cfg, model, world):
    """--dtype float16 / bfloat16: float32 masters of ``model`` and the loss scaler (over ``world``:
    every rank must skip an overflowing step together); dynamic for float16 unless --loss-scale
    fixes it, a fixed scale (default 1) for bfloat16. None for float32 / float64."""
    if cfg.dtype not in COMPUTE_DTYPES:
        return None
    if cfg.dtype == "float16" and cfg.loss_scale == "dynamic":
        scaler = DynamicLossScaler(growth_interval=cfg.loss_scale_window, group=world)
    else:
        scaler = DynamicLossScaler.static(1.0 if cfg.loss_scale == "dynamic" else float(cfg.loss_scale), group=world)
    return MixedPrecision(model, cfg.dtype, scaler)


def build_parallel(cfg, mesh):
    """This rank's part of the run: (model, optimizer, dp, engine, amp). Collective over ``mesh``.

    ``model``: the GPT, its tensor-parallel shard over ``mesh.tp_group``, and with ``cfg.pp > 1`` the
    PipelineStage of this pp rank (blocks recomputed in backward with ``cfg.recompute``).
    ``optimizer``: with ``cfg.zero`` a ZeroOptimizer over ``mesh.dp_group``, which then syncs the
    gradients itself (``dp`` None); else SGD / AdamW and ``dp`` a DataParallel. ``engine``: the
    PipelineEngine running ``cfg.schedule`` (None without pipeline parallelism). ``amp``: with
    ``--dtype float16 / bfloat16`` the MixedPrecision whose float32 masters the optimizer updates."""
    model = build_model(cfg, mesh.tp_group)
    if cfg.recompute:
        recompute_blocks(model)
    if cfg.pp > 1:
        model = PipelineStage(model, mesh.pp_rank, cfg.pp, cfg.virtual_stages)
    if cfg.zero > 0:
        dp = None
        hyper = {"betas": ADAMW_BETAS} if cfg.optimizer == "adamw" else {"momentum": cfg.momentum}
        optimizer = ZeroOptimizer(model, mesh.dp_group, cfg.zero, cfg.optimizer, lr=cfg.lr,
                                  weight_decay=cfg.weight_decay, tp_group=mesh.tp_group, pp_group=mesh.pp_group,
                                  **hyper)
    else:
        dp = DataParallel(model, mesh.dp_group, bucket_bytes=int(cfg.bucket_mb * 2**20))
    amp = build_mixed_precision(cfg, model, mesh.world)
    if not cfg.zero:
        optimizer = build_optimizer(model, cfg, amp.master_parameters() if amp else None)
    engine = None
    if cfg.pp > 1:
        engine = PipelineEngine(model, mesh, cfg.schedule, cfg.micro_batches, cfg.virtual_stages,
                                no_sync=dp.no_sync if dp else None)
    return model, optimizer, dp, engine, amp


def describe_layout(cfg, mesh, model) -> str:
    """Who holds what, one line per rank: its (dp, pp, tp) coordinates, the blocks of its pipeline
    stage(s), and what tensor parallelism and ZeRO cut further."""
    shape = mesh.shape
    counts = model.layers_per_stage if cfg.pp > 1 else [cfg.n_layer]
    starts = np.cumsum([0] + counts)
    held = []
    for pp_rank in range(shape.pp):
        stages = [c * shape.pp + pp_rank for c in range(cfg.virtual_stages)]
        parts = ["embeddings"] if 0 in stages else []
        parts += [f"blocks {starts[s]}-{starts[s + 1] - 1}" if counts[s] > 1 else f"block {starts[s]}"
                  for s in stages]
        parts += ["ln_f, lm_head"] if len(counts) - 1 in stages else []
        held.append(", ".join(parts))
    sharded = ["optimizer states", "gradients and optimizer states", "parameters, gradients and optimizer states"]
    cut = ([f"1/{shape.tp} of its matrices (tp)"] if shape.tp > 1 else []) + (
        [f"1/{shape.dp} of their {sharded[cfg.zero - 1]} (ZeRO-{cfg.zero})"] if cfg.zero else [])
    pipeline = f", {cfg.schedule} schedule" if cfg.pp > 1 else ""
    lines = [f"mesh: dp {shape.dp} x pp {shape.pp} x tp {shape.tp} = {shape.world} ranks, "
             f"per dp rank {cfg.micro_batches} micro-batch(es) x {cfg.batch_size // (cfg.dp * cfg.micro_batches)} "
             f"row(s){pipeline}"]
    for rank in range(shape.world):
        d, p, t = shape.coords(rank)
        lines.append(f"  rank {rank}: dp {d} pp {p} tp {t}  holds {held[p]}" + "".join(f"; {c}" for c in cut))
    return "\n".join(lines)


def memory_table(optimizer) -> str:
    """ZeRO's model-state bytes on this rank: the paper's formula beside what the arrays hold."""
    rows = [{"label": f"ZeRO-{optimizer.stage} formula", **optimizer.formula()},
            {"label": "measured on rank 0", **optimizer.model_state_bytes()}]
    return format_memory_table([dict(r, total=sum(v for k, v in r.items() if k != "label")) for r in rows])


def estimate_val_loss(model, val_tokens, cfg, engine=None):
    """Mean loss over ``cfg.eval_iters`` validation batches, the same batches at every evaluation
    (through the pipeline ``engine``'s forward-only schedule when there is one)."""
    model.eval()
    with no_grad():
        losses = []
        for i in range(cfg.eval_iters):
            batch = get_batch(val_tokens, i, cfg.batch_size, cfg.block_size, cfg.seed)  # (B, T+1)
            if engine is not None:
                losses.append(engine.evaluate(micro_batches(batch, cfg.micro_batches)))
            else:
                idx, targets = inputs_and_targets(batch)
                losses.append(model(idx, targets)[1].item())
    model.train()
    return float(np.mean(losses))


def open_metrics(out, start: int = 0):
    """DIR/metrics.jsonl opened for writing (DIR created), or a no-op context when ``out`` is None.
    Resuming at step ``start``, the rows of steps before it are kept and later ones dropped (the
    resumed run writes them again), so the file reads as one uninterrupted run."""
    if out is None:
        return contextlib.nullcontext()
    Path(out).mkdir(parents=True, exist_ok=True)
    path = Path(out) / "metrics.jsonl"
    kept = []
    if start > 0 and path.exists():
        kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < start]
    path.write_text("".join(line + "\n" for line in kept))
    return open(path, "a")


def world_of_one(timeout: float = 60.0) -> ProcessGroup:
    """A one-rank world without MPI: what ``train`` runs on when it is given no world."""
    return ProcessGroup(LocalTransport.world(1, timeout)[0])


def train(cfg, progress=True, world=None):
    """Run the training loop of ``cfg`` on ``world`` (a ProcessGroup of dp * pp * tp ranks; None:
    one process). Returns (model, history): this rank's model (or pipeline stage) and one dict per
    step run here (the same on every rank); global rank 0 writes ``cfg.out``, ``cfg.export``, and
    prints. With ``cfg.ckpt_dir`` it saves checkpoints and ``cfg.resume`` continues from the newest."""
    world = world if world is not None else world_of_one()
    check_config(cfg, world.size)
    lead = world.rank == 0
    mesh = DeviceMesh(world, dp=cfg.dp, pp=cfg.pp, tp=cfg.tp)
    train_tokens, val_tokens = load_data(cfg)
    sampler = DistributedSampler(train_tokens, cfg.batch_size, cfg.block_size, cfg.seed, mesh.dp_rank, cfg.dp)
    model, optimizer, dp, engine, amp = build_parallel(cfg, mesh)
    if lead:
        n_params = (sum(s.unit.numel for s in optimizer.shards) if cfg.zero  # ZeRO-3 holds shards only
                    else sum(p.data.size for p in model.parameters()))
        print(f"{n_params:,} parameters on rank 0, {len(train_tokens):,} train / {len(val_tokens):,} val "
              f"tokens, {cfg.batch_size} x {cfg.block_size} tokens per step, {mesh!r}")
        if world.size > 1:
            print(describe_layout(cfg, mesh, model))
    ckpts = (TrainingCheckpoints(cfg.ckpt_dir, mesh, save_every=cfg.save_every, keep=cfg.keep,
                                 async_save=cfg.async_save) if cfg.ckpt_dir else None)
    start = ckpts.resume(model, optimizer)[0] if cfg.resume else 0
    history = []
    with open_metrics(cfg.out if lead else None, start) as metrics_file:
        bar = tqdm(range(start, cfg.steps), disable=not (progress and lead), dynamic_ncols=True)
        for step in bar:
            if step == cfg.fail_at_step and not cfg.resume and mesh.rank == cfg.fail_rank:
                crash_here()
            lr = lr_at(step, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr)
            t0 = time.perf_counter()
            first_event = len(world.trace.events)
            batch = sampler.batch(step)   # (B/dp, T+1): this rank's rows of the global batch
            loss_scale = amp.scaler.scale if amp else None  # the scale this step's backward uses
            loss, grad_norm = train_step(model, optimizer, batch, lr, cfg.grad_clip, dp=dp, engine=engine,
                                         mesh=mesh, n_micro=cfg.micro_batches,
                                         sequence_parallel=cfg.sequence_parallel, trace=world.trace, amp=amp)
            tokens_per_s = cfg.batch_size * cfg.block_size / (time.perf_counter() - t0)
            if step == start and cfg.explain:
                explain_step(cfg, mesh, model, world.trace.events[first_event:], batch.shape)
            if step == start and cfg.zero and lead:  # after a step: every model state exists, at its size
                bar.write(memory_table(optimizer))
            record = {"step": step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_s, "grad_norm": grad_norm}
            if amp:
                record.update(loss_scale=loss_scale, skipped=grad_norm is None)
            if step % cfg.eval_every == 0 or step == cfg.steps - 1:
                record["val_loss"] = estimate_val_loss(model, val_tokens, cfg, engine)
                if lead:
                    bar.write(f"step {step:5d}  train loss {loss:.4f}  val loss {record['val_loss']:.4f}")
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:.0f}")
            history.append(record)
            if metrics_file is not None:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
            if ckpts is not None:
                ckpts.after_step(step, model, optimizer, {"seed": cfg.seed})
    if ckpts is not None:
        ckpts.wait()
    write_outputs(cfg, model, optimizer, mesh, amp)
    return model, history


def explain_step(cfg, mesh, model, events, batch_shape):
    """``--explain``: every rank's story of the step just run, printed by rank 0 in rank order
    (collective over the world). An activation is one micro-batch's (b, T, C), T cut by tp under
    sequence parallelism."""
    rows = batch_shape[0] // cfg.micro_batches
    seq = cfg.block_size // cfg.tp if cfg.sequence_parallel else cfg.block_size
    print_explanation(mesh, model, events, batch_shape=batch_shape, activation_shape=(rows, seq, cfg.n_embd))


def write_outputs(cfg, model, optimizer, mesh, amp=None):
    """``--export``: the consolidated full state_dict (collective over the mesh, ZeRO-3's parameters
    gathered first; written by global rank 0) as .npz, or as safetensors when the path ends in
    ``.safetensors``. ``--trace DIR``: this rank's trace events and memory rows for
    ``python -m minidist.inspect DIR`` (each rank writes its own files). Under mixed precision the
    export holds the float32 masters."""
    if cfg.export is not None:
        with optimizer.full_parameters() if cfg.zero else masters_in_model(amp) if amp else contextlib.nullcontext():
            state = full_state_dict(model, mesh)
        if mesh.rank == 0:
            export(state, cfg.export)
    if cfg.trace is not None:
        write_trace(cfg.trace, mesh.world.trace)
        held = optimizer.model_state_bytes() if cfg.zero else model_state_bytes(model, optimizer)
        write_memory_report(cfg.trace, mesh.rank, [dict(label="after last step", **held)])


@contextlib.contextmanager
def masters_in_model(amp):
    """Inside the block the model's parameters hold mixed precision's float32 masters (for export)."""
    stored = [p.data for _, p in amp.pairs]
    for (_, p), master in zip(amp.pairs, amp.masters):
        p.data = master.data
    try:
        yield
    finally:
        for (_, p), data in zip(amp.pairs, stored):
            p.data = data


def export(state: dict, path: str) -> None:
    """Write a full state_dict ({GPT-2 name: array}) to ``path``: safetensors when it ends in
    ``.safetensors``, else .npz (NumPy's zip of arrays; neither pickles)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if path.endswith(".safetensors"):
        save_state_dict(state, path)
    else:
        np.savez(path, **state)


def train_ps(cfg, world):
    """``--mode ps``: train with parameter servers (minidist/parallel/param_server.py) on ``world``.
    Returns (model, history); on rank 0 the model holds the final weights and history one row per
    step (synchronous) or per applied update (asynchronous: with worker and staleness), the last
    row with val_loss; rank 0 writes ``cfg.out`` and ``cfg.export``."""
    check_config(cfg, world.size)
    train_tokens, val_tokens = load_data(cfg)
    model = build_model(cfg)
    history = train_parameter_server(world, model, cfg, train_tokens, servers=cfg.servers,
                                     staleness=None if cfg.staleness < 0 else cfg.staleness, straggler=cfg.straggler)
    if world.rank == 0:
        history[-1]["val_loss"] = estimate_val_loss(model, val_tokens, cfg)
        with open_metrics(cfg.out) as metrics_file:
            for record in history if metrics_file is not None else []:
                metrics_file.write(json.dumps(record) + "\n")
        if cfg.export is not None:  # the whole model is on rank 0: a mesh of one consolidates it
            export(consolidated_state_dict(model, DeviceMesh(world_of_one(), dp=1, pp=1, tp=1)), cfg.export)
    return model, history


def sample(model, prompt, max_new_tokens, seed=0):
    """Text generated by ``model`` after ``prompt`` (temperature 0.8, top-k 20)."""
    tok = ByteTokenizer()
    idx = tok.encode(prompt).astype(np.int64)[None, :]                                    # (1, T)
    out = model.generate(idx, max_new_tokens, temperature=0.8, top_k=20, rng=np.random.default_rng(seed))
    return tok.decode(out[0])


def main(argv=None):
    """Entry point of ``python -m minidist.train``."""
    cfg = parse_args(argv)
    # the MPI world: under mpiexec, its ranks; run alone, a world of one. A timeout's flight record
    # lands in the run directory.
    world = init(flight_dir=cfg.out or cfg.trace)
    try:
        model, history = (train_ps if cfg.mode == "ps" else train)(cfg, world=world)
    except ConfigError as e:
        if world.rank == 0:
            print(f"python -m minidist.train: {e}", file=sys.stderr)
        sys.exit(2)
    if world.rank == 0 and history:
        print(f"\nfinal: train loss {history[-1]['loss']:.4f}, val loss {history[-1]['val_loss']:.4f}")
        if cfg.sample_tokens > 0 and cfg.tp == cfg.pp == 1 and cfg.zero < 3:
            model.eval()
            print("sample:\n" + sample(model, "The ", cfg.sample_tokens, seed=cfg.seed))
        elif cfg.sample_tokens > 0:  # generate() needs the whole model on one rank
            print("(no sample: the model is split over ranks by tp, pp or ZeRO-3)")


if __name__ == "__main__":
    main()
