"""Build what a training run needs, from its :class:`~minidist.train_config.TrainConfig`: the
device, the data, the model (or this rank's shard / pipeline stage of it), the optimizer, the
gradient sync, the pipeline engine and mixed precision; and describe the layout that results.
"""
import socket
from pathlib import Path

import numpy as np

from minidist.amp import COMPUTE_DTYPES, DynamicLossScaler, MixedPrecision
from minidist.comm import LocalTransport, ProcessGroup, Trace
from minidist.comm.trace import KEEP_RECENT
from minidist.data import ByteTokenizer, default_corpus, load_tokens, train_val_split
from minidist.device import require_cupy, use_gpu
from minidist.model import GPT, GPTConfig
from minidist.optim import SGD, AdamW
from minidist.parallel.accounting import format_memory_table
from minidist.parallel.data_parallel import DataParallel
from minidist.parallel.pipeline import PipelineEngine, PipelineStage
from minidist.parallel.recompute import recompute_blocks
from minidist.parallel.tp_model import build_tp_gpt
from minidist.parallel.zero import ZeroOptimizer
from minidist.train_config import ConfigError

ADAMW_BETAS = (0.9, 0.95)


def world_of_one(timeout: float = 60.0) -> ProcessGroup:
    """A one-rank world without MPI: what ``train`` runs on when it is given no world. Its trace
    keeps the last ``KEEP_RECENT`` events, as ``init()``'s does, so a long run's memory stays flat."""
    return ProcessGroup(LocalTransport.world(1, timeout)[0], trace=Trace(0, keep=KEEP_RECENT))


def select_device(cfg, world) -> None:
    """``--device cuda``: CuPy and a GPU must be there (else a :class:`ConfigError` saying so, on
    every rank, before anything is sent), and this rank takes GPU ``local_rank % gpu_count`` of its
    machine (with ``--backend nccl`` the NCCL group has chosen it already). Nothing for ``cpu``."""
    if cfg.device != "cuda":
        return
    try:
        require_cupy("--device cuda")
    except (ImportError, RuntimeError) as e:
        raise ConfigError(str(e)) from e
    if cfg.backend != "nccl":
        use_gpu(local_rank(world))


def local_rank(world) -> int:
    """This rank's index among the ranks of ``world`` that run on its machine, in global rank order.
    Collective over ``world``: one ``gather_bytes`` of every host name to rank 0, one broadcast of
    every rank's local index (int64) from it."""
    hosts = world.gather_bytes(socket.gethostname().encode(), dst=0)
    local = np.zeros(world.size, dtype=np.int64)  # (world,)
    if hosts is not None:
        count = {}
        for rank, host in enumerate(hosts):
            local[rank] = count.get(host, 0)
            count[host] = local[rank] + 1
    world.broadcast(local, src=0)
    return int(local[world.rank])


def load_data(cfg):
    """(train, val) token arrays: ``cfg.data`` if given (a UTF-8 text file is a token file), else
    the default corpus, generated and cached on first use. The last 10% is validation.

    Each part must hold one window of ``block_size + 1`` tokens: else a :class:`ConfigError` naming
    the file, its token counts and the length needed. The verdict depends on the file alone, so every
    rank reaches it before anything is sent (call this before building the mesh)."""
    path = Path(cfg.data) if cfg.data is not None else default_corpus(cfg.data_dir)
    if not path.is_file():
        raise ConfigError(f"--data {path}: {'not a file' if path.exists() else 'no such file'}")
    tokens = load_tokens(path) if path.stat().st_size else np.zeros(0, np.uint8)  # (an empty file cannot be mapped)
    train, val = train_val_split(tokens, val_fraction=0.1)
    need = cfg.block_size + 1
    if min(len(train), len(val)) < need:
        raise ConfigError(f"--data {path}: {len(tokens)} tokens, {len(train)} for training and {len(val)} for "
                          f"validation; each needs at least block_size + 1 = {need} (one window). The last 10% "
                          f"validates: give at least {10 * need} tokens, or a smaller --block-size")
    return train, val


def build_model(cfg, tp_group=None):
    """A byte-level GPT (vocab 256) of the configured size, initialised from ``cfg.seed``; with
    ``cfg.tp > 1`` this rank's tensor-parallel shard of it over ``tp_group``. Initialised on the host
    (the same values on any device), then moved to ``cfg.device``."""
    config = GPTConfig(vocab_size=ByteTokenizer.vocab_size, block_size=cfg.block_size,
                       n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd)
    dtype = np.dtype(COMPUTE_DTYPES.get(cfg.dtype, cfg.dtype)).name  # mixed precision: how the weights are stored
    if cfg.tp == 1:
        return GPT(config, seed=cfg.seed, dtype=dtype).to(cfg.device)
    return build_tp_gpt(config, cfg.seed, dtype, tp_group, sequence_parallel=cfg.sequence_parallel).to(cfg.device)


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
