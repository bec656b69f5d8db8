"""Train a GPT: ``python -m minidist.train``.

The script is four steps, each one function, so later lessons can swap one of them (data-parallel
batches, a tensor-parallel model, a ZeRO optimizer) and keep the rest:

    parse_args -> TrainConfig       the command line as one dataclass
    check_config(cfg, world_size)   every rank rejects a bad layout before anything is sent
    load_data(cfg)                  train / validation tokens (memmapped uint8 files)
    build_model(cfg), build_optimizer(model, cfg)
    train(cfg)                      the loop: batch -> forward -> backward -> clip -> lr -> step

Parallel runs start the same script under MPI, e.g. 4 ranks as 2 data-parallel replicas of a 2-way
tensor-parallel model, each step's batch cut into 2 micro-batches:

    mpiexec -n 4 python -m minidist.train --dp 2 --tp 2 --micro-batches 2

Every layout trains to the same numbers as one process on the full batch (tests/test_train_parallel.py).

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

from minidist.autograd import no_grad
from minidist.comm import LocalTransport, ProcessGroup, Trace, init, write_chrome_trace
from minidist.data import (ByteTokenizer, default_corpus, get_batch, inputs_and_targets, load_tokens,
                           train_val_split)
from minidist.model import GPT, GPTConfig
from minidist.optim import SGD, AdamW, clip_grad_norm, lr_at
from minidist.parallel.clip import clip_grad_norm_parallel
from minidist.parallel.consolidate import consolidated_state_dict
from minidist.parallel.data_parallel import DataParallel
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.sampler import DistributedSampler, micro_batches
from minidist.parallel.tensor_parallel import sync_sequence_parallel_grads
from minidist.parallel.tp_model import build_tp_gpt


@dataclasses.dataclass
class TrainConfig:
    """Everything a run depends on. The defaults train visibly in about a minute on one CPU core."""
    steps: int = 800
    batch_size: int = 16
    seed: int = 0
    dtype: str = "float32"
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
    # parallelism (world size = dp * tp) and what it writes
    dp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    micro_batches: int = 1
    bucket_mb: float = 1.0
    export: str | None = None
    trace: str | None = None


class ConfigError(ValueError):
    """A configuration that cannot run. Found from the config alone, identically on every rank,
    before any communication."""


def check_config(cfg, world_size: int) -> None:
    """Raise :class:`ConfigError` listing everything wrong with running ``cfg`` on ``world_size`` ranks."""
    problems = []
    for name in ("dp", "tp", "micro_batches"):
        if getattr(cfg, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
    if world_size != cfg.dp * cfg.tp:
        problems.append(f"world size {world_size} != dp * tp = {cfg.dp} * {cfg.tp} = {cfg.dp * cfg.tp} "
                        f"(start {cfg.dp * cfg.tp} ranks: mpiexec -n {cfg.dp * cfg.tp} ...)")
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
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def parse_args(argv=None):
    """The command line as a :class:`TrainConfig` (flags are the field names with dashes)."""
    defaults = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m minidist.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    choices = {"dtype": ["float32", "float64"], "optimizer": ["sgd", "adamw"]}
    helps = {
        "steps": "optimizer steps", "batch_size": "sequences per step (the global batch)",
        "seed": "seeds the weights and the batches", "dtype": "parameter and activation dtype",
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
        "dp": "data-parallel replicas", "tp": "tensor-parallel ranks per replica",
        "sequence_parallel": "also split LayerNorm/dropout activations along the sequence over tp",
        "micro_batches": "gradient-accumulation micro-batches per step (per dp rank)",
        "bucket_mb": "data-parallel gradient bucket size in MiB",
        "export": "write the consolidated full-model state_dict here (.npz) at the end",
        "trace": "directory for per-rank Chrome traces (trace_rank<r>.json)",
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
    if cfg.tp == 1:
        return GPT(config, seed=cfg.seed, dtype=cfg.dtype)
    return build_tp_gpt(config, cfg.seed, cfg.dtype, tp_group, sequence_parallel=cfg.sequence_parallel)


def build_optimizer(model, cfg):
    """AdamW (betas 0.9, 0.95) or SGD with momentum over the model's named parameters."""
    if cfg.optimizer == "adamw":
        return AdamW(model.named_parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    return SGD(model.named_parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def estimate_val_loss(model, val_tokens, cfg):
    """Mean loss over ``cfg.eval_iters`` validation batches, the same batches at every evaluation."""
    model.eval()
    with no_grad():
        losses = []
        for i in range(cfg.eval_iters):
            idx, targets = inputs_and_targets(get_batch(val_tokens, i, cfg.batch_size, cfg.block_size, cfg.seed))
            losses.append(model(idx, targets)[1].item())
    model.train()
    return float(np.mean(losses))


def forward_backward(model, batches, no_sync=contextlib.nullcontext, trace=None):
    """Forward and backward over ``batches`` (micro-batches of (b, T+1) rows), accumulating
    gradients. Each micro-batch's mean loss is scaled by 1/len(batches) before backward, so the
    accumulated gradient is that of the mean over all rows. All backward passes but the last run
    inside ``no_sync()`` (data parallelism communicates once, after the last). Returns the mean
    loss. (A pipeline engine replaces exactly this function.)"""
    trace = trace or Trace(enabled=False)
    m, losses = len(batches), []
    for i, batch in enumerate(batches):
        idx, targets = inputs_and_targets(batch)          # (b/m, T), (b/m, T)
        with no_sync() if i < m - 1 else contextlib.nullcontext():
            with trace.record("forward", kind="compute"):
                _, loss = model(idx, targets)
            with trace.record("backward", kind="compute"):
                loss.backward(np.full_like(loss.data, 1.0 / m))
        losses.append(loss.item())
    return float(np.mean(losses))


def train_step(model, optimizer, batch, lr, grad_clip, *, dp=None, mesh=None, n_micro=1,
               sequence_parallel=False, trace=None):
    """One step on this rank's (b, T+1) rows: forward and backward per micro-batch, gradient
    averaging, clip, update. Returns (loss, grad norm); the norm is measured before clipping, and
    ``grad_clip <= 0`` measures without clipping.

    With ``dp`` (a DataParallel) gradients are averaged over its group and the loss over the dp
    ranks; with ``mesh`` the norm spans the whole model (tp shards, pp stages). Without them: one
    process, plain arrays."""
    (dp or optimizer).zero_grad()
    loss = forward_backward(model, micro_batches(batch, n_micro), dp.no_sync if dp else contextlib.nullcontext,
                            trace)
    if dp:
        dp.finish()
        loss = float(dp.group.all_reduce(np.array([loss]), op="avg")[0])
    if sequence_parallel:
        sync_sequence_parallel_grads(model, mesh.tp_group)
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    if mesh:
        grad_norm = clip_grad_norm_parallel(model.parameters(), max_norm, mesh)
    else:
        grad_norm = clip_grad_norm(model.parameters(), max_norm)
    optimizer.lr = lr
    with (trace or Trace(enabled=False)).record("optimizer", kind="compute"):
        optimizer.step()
    return loss, grad_norm


def open_metrics(out):
    """DIR/metrics.jsonl opened for writing (DIR created), or a no-op context when ``out`` is None."""
    if out is None:
        return contextlib.nullcontext()
    Path(out).mkdir(parents=True, exist_ok=True)
    return open(Path(out) / "metrics.jsonl", "w")


def world_of_one(timeout: float = 60.0) -> ProcessGroup:
    """A one-rank world without MPI: what ``train`` runs on when it is given no world."""
    return ProcessGroup(LocalTransport.world(1, timeout)[0])


def train(cfg, progress=True, world=None):
    """Run the training loop of ``cfg`` on ``world`` (a ProcessGroup of dp * tp ranks; None: one
    process). Returns (model, history), history one dict per step (the same on every rank);
    global rank 0 writes ``cfg.out``, ``cfg.export``, and prints."""
    world = world if world is not None else world_of_one()
    check_config(cfg, world.size)
    lead = world.rank == 0
    mesh = DeviceMesh(world, dp=cfg.dp, tp=cfg.tp)
    train_tokens, val_tokens = load_data(cfg)
    sampler = DistributedSampler(train_tokens, cfg.batch_size, cfg.block_size, cfg.seed, mesh.dp_rank, cfg.dp)
    model = build_model(cfg, mesh.tp_group)
    dp = DataParallel(model, mesh.dp_group, bucket_bytes=int(cfg.bucket_mb * 2**20))
    optimizer = build_optimizer(model, cfg)
    if lead:
        n_params = sum(p.data.size for p in model.parameters())
        print(f"{n_params:,} parameters on rank 0, {len(train_tokens):,} train / {len(val_tokens):,} val "
              f"tokens, {cfg.batch_size} x {cfg.block_size} tokens per step, {mesh!r}")
    history = []
    with open_metrics(cfg.out if lead else None) as metrics_file:
        bar = tqdm(range(cfg.steps), disable=not (progress and lead), dynamic_ncols=True)
        for step in bar:
            lr = lr_at(step, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr)
            t0 = time.perf_counter()
            batch = sampler.batch(step)   # (B/dp, T+1): this rank's rows of the global batch
            loss, grad_norm = train_step(model, optimizer, batch, lr, cfg.grad_clip, dp=dp, mesh=mesh,
                                         n_micro=cfg.micro_batches, sequence_parallel=cfg.sequence_parallel,
                                         trace=world.trace)
            tokens_per_s = cfg.batch_size * cfg.block_size / (time.perf_counter() - t0)
            record = {"step": step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_s, "grad_norm": grad_norm}
            if step % cfg.eval_every == 0 or step == cfg.steps - 1:
                record["val_loss"] = estimate_val_loss(model, val_tokens, cfg)
                if lead:
                    bar.write(f"step {step:5d}  train loss {loss:.4f}  val loss {record['val_loss']:.4f}")
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:.0f}")
            history.append(record)
            if metrics_file is not None:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
    write_outputs(cfg, model, mesh)
    return model, history


def write_outputs(cfg, model, mesh):
    """``--export``: the consolidated full state_dict as .npz (collective over tp; written by global
    rank 0). ``--trace``: this rank's Chrome trace as DIR/trace_rank<r>.json."""
    if cfg.export is not None:
        state = consolidated_state_dict(model, mesh)
        if mesh.rank == 0:
            Path(cfg.export).parent.mkdir(parents=True, exist_ok=True)
            np.savez(cfg.export, **state)
    if cfg.trace is not None:
        Path(cfg.trace).mkdir(parents=True, exist_ok=True)
        write_chrome_trace([mesh.world.trace], Path(cfg.trace) / f"trace_rank{mesh.rank}.json")


def sample(model, prompt, max_new_tokens, seed=0):
    """Text generated by ``model`` after ``prompt`` (temperature 0.8, top-k 20)."""
    tok = ByteTokenizer()
    idx = tok.encode(prompt).astype(np.int64)[None, :]                                    # (1, T)
    out = model.generate(idx, max_new_tokens, temperature=0.8, top_k=20, rng=np.random.default_rng(seed))
    return tok.decode(out[0])


def main(argv=None):
    """Entry point of ``python -m minidist.train``."""
    cfg = parse_args(argv)
    world = init()  # the MPI world: under mpiexec, its ranks; run alone, a world of one
    try:
        model, history = train(cfg, world=world)
    except ConfigError as e:
        if world.rank == 0:
            print(f"python -m minidist.train: {e}", file=sys.stderr)
        sys.exit(2)
    if world.rank == 0:
        print(f"\nfinal: train loss {history[-1]['loss']:.4f}, val loss {history[-1]['val_loss']:.4f}")
        if cfg.sample_tokens > 0 and cfg.tp == 1:  # a tensor-parallel model has no generate()
            model.eval()
            print("sample:\n" + sample(model, "The ", cfg.sample_tokens, seed=cfg.seed))


if __name__ == "__main__":
    main()
