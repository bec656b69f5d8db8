"""What a training run is: :class:`TrainConfig`, the command line that fills it, and the checks.

A bad configuration is found from the config and the world size alone, so every rank reaches the
same verdict before any communication, and ``python -m minidist.train`` prints one clear message
listing every problem (:class:`ConfigError`) instead of hanging halfway through a collective.
"""
import argparse
import dataclasses
from pathlib import Path

from minidist.amp import COMPUTE_DTYPES
from minidist.checkpoint.paths import ckpt_dir_problems
from minidist.device import DEVICES
from minidist.parallel.context.context_parallel import ALGORITHMS, tokens_multiple
from minidist.parallel.zero.offload import CHOICES as OFFLOAD_CHOICES
from minidist.parallel.ps.param_server import check_parameter_server
from minidist.parallel.pipeline import SCHEDULES


@dataclasses.dataclass
class TrainConfig:
    """Everything a run depends on. The defaults train visibly in about a minute on one CPU core."""
    steps: int = 800
    batch_size: int = 16
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
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
    n_experts: int = 0  # > 0: mixture-of-experts MLPs (minidist/moe.py)
    top_k: int = 2
    moe_every: int = 1
    capacity_factor: float = 0.0
    aux_loss_coef: float = 0.01
    # data, evaluation, output
    data: str | None = None
    data_dir: str | None = None
    eval_every: int = 100
    eval_iters: int = 8
    sample_tokens: int = 200
    out: str | None = None
    # parallelism (world size = dp * pp * cp * tp; --mode ps: servers + workers) and what it writes
    mode: str = "collective"
    backend: str = "ring"
    comm_timeout: float = 300.0
    system_allocator: bool = False
    servers: int = 1
    staleness: int = -1
    straggler: float = 0.0
    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    cp_algorithm: str = "ring"
    ep: int = 1
    sequence_parallel: bool = False
    micro_batches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    zero: int = 0
    offload: str = "none"
    offload_dir: str | None = None
    recompute: bool = False
    bucket_mb: float = 1.0
    export: str | None = None
    export_hf: str | None = None
    init_from_hf: str | None = None
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


def runs_zero_optimizer(cfg) -> bool:
    """Whether ``cfg`` trains with ZeRO's optimizer (minidist/parallel/zero/optimizer.py): a ZeRO stage, or
    offload, which moves ZeRO's shards (with ``--zero 0`` every rank offloads the whole state)."""
    return cfg.zero > 0 or cfg.offload != "none"


class ConfigError(ValueError):
    """A configuration that cannot run. Found from the config alone, identically on every rank,
    before any communication."""


# The values each numeric flag may take, as an interval: "[" and "]" include the bound, "(" and ")"
# exclude it, so an open end at inf refuses inf too, and nan is in no interval. (--save-every, --keep,
# --comm-timeout and --fail-rank against the world are checked with their features, below.)
RANGES = {
    "steps": "[1, inf)", "batch_size": "[1, inf)", "seed": "[0, inf)", "loss_scale_window": "[1, inf)",
    "lr": "(0, inf)", "min_lr": "[0, inf)", "warmup": "[0, inf)", "momentum": "[0, 1)",
    "weight_decay": "[0, inf)", "grad_clip": "[0, inf)",
    "n_layer": "[1, inf)", "n_head": "[1, inf)", "n_embd": "[1, inf)", "block_size": "[1, inf)",
    "n_experts": "[0, inf)", "top_k": "[1, inf)", "moe_every": "[1, inf)", "capacity_factor": "[0, inf)",
    "aux_loss_coef": "[0, inf)", "ep": "[1, inf)",
    "eval_every": "[1, inf)", "eval_iters": "[1, inf)", "sample_tokens": "[0, inf)",
    "servers": "[1, inf)", "staleness": "[-1, inf)", "straggler": "[0, inf)",
    "dp": "[1, inf)", "pp": "[1, inf)", "tp": "[1, inf)", "cp": "[1, inf)", "micro_batches": "[1, inf)", "virtual_stages": "[1, inf)",
    "bucket_mb": "(0, inf)", "fail_at_step": "[-1, inf)", "fail_rank": "[0, inf)", "zero": "[0, 3]",
}


def in_interval(value, interval: str) -> bool:
    """Whether ``value`` lies in ``interval``, e.g. ``"[0, 1)"`` (see :data:`RANGES`)."""
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    above = low <= value if interval[0] == "[" else low < value
    below = value <= high if interval[-1] == "]" else value < high
    return above and below


def in_words(interval: str) -> str:
    """``"(0, inf)"`` -> "positive", ``"[1, inf)"`` -> ">= 1", ``"[0, 1)"`` -> "in [0, 1)"."""
    low, high = interval[1:-1].split(", ")
    if high != "inf":
        return f"in {interval}"
    if interval[0] == "(":
        return "positive" if low == "0" else f"> {low}"
    return f">= {low}"


def range_problems(cfg) -> list[str]:
    """Every flag of ``cfg`` outside its range in :data:`RANGES`, and --min-lr above --lr."""
    problems = []
    for name, interval in RANGES.items():
        value = getattr(cfg, name)
        if not in_interval(value, interval):
            finite = " and finite" if value == float("inf") else ""
            problems.append(f"--{name.replace('_', '-')} must be {in_words(interval)}{finite}, got {value}")
    if not problems and cfg.min_lr > cfg.lr:
        problems.append(f"--min-lr {cfg.min_lr} is larger than --lr {cfg.lr} (the cosine decays from --lr to --min-lr)")
    return problems


def fault_injection_armed(cfg) -> bool:
    """Whether rank --fail-rank crashes on purpose at --fail-at-step: only in a run that does not
    resume, so a restarted job (``python -m minidist.run``) runs through."""
    return cfg.fail_at_step >= 0 and not cfg.resume


def check_config(cfg, world_size: int) -> None:
    """Raise :class:`ConfigError` listing everything wrong with running ``cfg`` on ``world_size`` ranks.
    Out-of-range numbers are reported first, all together (the other checks divide by them)."""
    problems = range_problems(cfg)
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
    axes = [a for a in ("dp", "pp", "cp", "tp") if a in ("dp", "tp") or getattr(cfg, a) > 1]
    n = cfg.dp * cfg.pp * cfg.cp * cfg.tp
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
    problems += context_parallel_problems(cfg) + expert_problems(cfg)
    if cfg.schedule not in SCHEDULES:
        problems.append(f"--schedule must be one of {', '.join(SCHEDULES)}, got {cfg.schedule!r}")
    if cfg.pp * cfg.virtual_stages > cfg.n_layer:
        problems.append(f"pp * virtual_stages = {cfg.pp} * {cfg.virtual_stages} pipeline stages need at least "
                        f"as many blocks, n_layer is {cfg.n_layer}")
    if cfg.schedule == "zbv" and cfg.virtual_stages != 2:
        problems.append(f"--schedule zbv places two chunks per rank in a V: it needs --virtual-stages 2, "
                        f"got {cfg.virtual_stages}")
    elif cfg.virtual_stages > 1 and cfg.schedule not in ("interleaved", "zbv"):
        problems.append(f"--virtual-stages {cfg.virtual_stages} needs --schedule interleaved (or zbv, with 2)")
    if cfg.schedule == "interleaved" and cfg.micro_batches % cfg.pp:
        problems.append(f"the interleaved schedule needs micro_batches ({cfg.micro_batches}) to be a multiple "
                        f"of pp ({cfg.pp})")
    problems += comm_timeout_problems(cfg)
    problems += checkpoint_problems(cfg, world_size) + mixed_precision_problems(cfg) + device_problems(cfg)
    problems += offload_problems(cfg)
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def context_parallel_problems(cfg) -> list[str]:
    """What --cp and --cp-algorithm cannot run: the sequence must cut into equal parts (2 cp chunks
    for zig-zag; under sequence parallelism each cp rank's part again into tp), and Ulysses gives
    each cp rank whole heads of its tp rank's n_head / tp."""
    if cfg.cp_algorithm not in ALGORITHMS:
        return [f"--cp-algorithm must be one of {', '.join(ALGORITHMS)}, got {cfg.cp_algorithm!r}"]
    if cfg.cp == 1:
        return []
    problems = []
    parts = tokens_multiple(cfg.cp, cfg.cp_algorithm)
    if cfg.block_size % parts:
        problems.append(f"block_size {cfg.block_size} is not divisible by {parts} (--cp {cfg.cp} "
                        f"--cp-algorithm {cfg.cp_algorithm} cuts every sequence into {parts} equal parts)")
    elif cfg.sequence_parallel and (cfg.block_size // cfg.cp) % cfg.tp:
        problems.append(f"block_size / cp = {cfg.block_size // cfg.cp} tokens per cp rank are not divisible by tp "
                        f"{cfg.tp} (sequence parallelism splits them again over the tp ranks)")
    heads = cfg.n_head // cfg.tp if cfg.n_head % cfg.tp == 0 else None
    if cfg.cp_algorithm == "ulysses" and heads is not None and heads % cfg.cp:
        problems.append(f"--cp-algorithm ulysses gives each of the {cfg.cp} cp ranks whole heads, and the "
                        f"{heads} heads of each tp rank (n_head {cfg.n_head} / tp {cfg.tp}) do not divide by "
                        f"cp {cfg.cp}: use --cp-algorithm ring or zigzag (they cut the sequence, not the heads), "
                        f"or an n_head divisible by tp * cp = {cfg.tp * cfg.cp}")
    return problems


def expert_problems(cfg) -> list[str]:
    """What the mixture of experts (--n-experts, --top-k, --moe-every, --capacity-factor) and expert
    parallelism (--ep) cannot run: ep cuts the dp axis and the experts, tp cuts the router's experts
    (every rank routes every token, minidist/parallel/tensor/model.py), and Hugging Face's GPT-2 has no
    experts."""
    if cfg.n_experts == 0:
        return ["--ep needs experts to split: add --n-experts"] if cfg.ep > 1 else []
    problems = []
    if cfg.top_k > cfg.n_experts:
        problems.append(f"--top-k {cfg.top_k} is more than the {cfg.n_experts} experts")
    if cfg.moe_every > cfg.n_layer:
        problems.append(f"--moe-every {cfg.moe_every} leaves none of the {cfg.n_layer} blocks with experts "
                        f"(blocks moe_every-1, 2 moe_every-1, ... have them)")
    if cfg.dp % cfg.ep:
        problems.append(f"--ep {cfg.ep} must divide --dp {cfg.dp} (expert parallelism splits the experts over "
                        f"groups of ep data-parallel ranks)")
    for axis in ("ep", "tp"):
        if cfg.n_experts % getattr(cfg, axis):
            what = "the experts" if axis == "ep" else "the router's logits (every tp rank computes E/tp of them)"
            problems.append(f"--n-experts {cfg.n_experts} is not divisible by {axis} {getattr(cfg, axis)} ({axis} "
                            f"splits {what})")
    if cfg.export_hf is not None or cfg.init_from_hf is not None:
        problems.append("--export-hf and --init-from-hf read and write Hugging Face's GPT-2, which has no "
                        "experts: use --export for a mixture-of-experts model")
    return problems


def comm_timeout_problems(cfg) -> list[str]:
    """What is wrong with ``--comm-timeout`` (a positive, finite number of seconds). ``main`` asks it
    before :func:`~minidist.comm.launch.init`, which needs the timeout, and :func:`check_config` again."""
    if not (isinstance(cfg.comm_timeout, (int, float)) and 0 < cfg.comm_timeout < float("inf")):
        return [f"--comm-timeout must be a positive, finite number of seconds, got {cfg.comm_timeout}"]
    return []


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
    collective = [f"--{name.replace('_', '-')}" for name in ("dp", "pp", "tp", "cp", "ep", "micro_batches", "zero", "offload", "ckpt_dir",
                                                             "explain", "sequence_parallel", "recompute",
                                                             "export_hf", "init_from_hf")
                  if getattr(cfg, name) not in (1, 0, None, False, "none")]
    if collective:
        problems.append(f"--mode ps trains whole models on its workers: {', '.join(collective)} do not apply")
    return problems


def offload_problems(cfg) -> list[str]:
    """What --offload and --offload-dir cannot run: an unknown offload, and a folder for nothing
    offloaded or that cannot be one. (``optimizer,params`` below ZeRO-3 runs as ``optimizer``: stages
    0-2 compute with every parameter whole on each rank, so there is no parameter shard to move.)"""
    if cfg.offload not in OFFLOAD_CHOICES:
        return [f"--offload must be one of {', '.join(OFFLOAD_CHOICES)}, got {cfg.offload!r}"]
    problems = []
    if cfg.offload_dir is not None:
        if cfg.offload == "none":
            problems.append("--offload-dir is where offloaded state lives: add --offload optimizer (or "
                            "optimizer,params with --zero 3)")
        existing = next(p for p in (Path(cfg.offload_dir), *Path(cfg.offload_dir).parents) if p.exists())
        if not existing.is_dir():
            problems.append(f"--offload-dir {cfg.offload_dir}: {existing} is not a folder")
    return problems


def offloaded(cfg) -> str:
    """What ``cfg`` offloads: ``cfg.offload``, but parameters only under ZeRO-3 (the only stage with
    parameter shards between uses)."""
    return "optimizer" if cfg.offload == "optimizer,params" and cfg.zero != 3 else cfg.offload


def mixed_precision_problems(cfg) -> list[str]:
    """What is wrong with --loss-scale (mixed precision itself composes with every layout)."""
    if cfg.dtype not in COMPUTE_DTYPES or cfg.loss_scale == "dynamic":
        return []
    try:
        if float(cfg.loss_scale) > 0 and float(cfg.loss_scale) < float("inf"):
            return []
    except ValueError:
        pass
    return [f"--loss-scale must be 'dynamic' or a positive, finite number, got {cfg.loss_scale!r}"]


def device_problems(cfg) -> list[str]:
    """What --device and --backend cannot be combined with. (Whether CuPy and a GPU are there is
    asked when the run starts: :func:`minidist.train.build.select_device`.)"""
    problems = []
    if cfg.backend == "nccl" and cfg.device != "cuda":
        problems.append("--backend nccl moves GPU buffers only: it needs --device cuda")
    if cfg.device == "cuda" and cfg.backend == "mpi":
        problems.append("--device cuda with --backend mpi is not supported: MPI's own collectives would be handed "
                        "GPU buffers, which only a CUDA-aware MPI reads (use --backend ring, which stages them "
                        "through host memory, or --backend nccl)")
    if cfg.backend == "nccl" and cfg.schedule in ("interleaved", "zbv") and cfg.pp > 1:
        problems.append(f"--schedule {cfg.schedule} with --backend nccl is not supported: NCCL runs one rank's "
                        f"sends and receives in order on one stream, and the {cfg.schedule} schedule has a rank wait "
                        f"for a receive whose peer sends it only after a later receive (a deadlock); use --schedule "
                        f"zb-h1, 1f1b or gpipe, or --backend ring")
    if cfg.device == "cuda" and cfg.mode == "ps":
        problems.append("--device cuda with --mode ps is not supported: the parameter servers keep NumPy shards")
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
    problems += ckpt_dir_problems(cfg.ckpt_dir) if cfg.ckpt_dir is not None else []
    if fault_injection_armed(cfg) and not 0 <= cfg.fail_rank < world_size:
        problems.append(f"--fail-rank {cfg.fail_rank} is not a rank of the {world_size}-rank world")
    return problems


def parse_args(argv=None):
    """The command line as a :class:`TrainConfig` (flags are the field names with dashes)."""
    defaults = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m minidist.train", description="Train a GPT: ``python -m minidist.train``.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    choices = {"mode": ["collective", "ps"], "dtype": ["float32", "float64", "float16", "bfloat16"], "optimizer": ["sgd", "adamw"], "schedule": list(SCHEDULES),
               "cp_algorithm": list(ALGORITHMS),
               "zero": [0, 1, 2, 3], "offload": list(OFFLOAD_CHOICES), "device": list(DEVICES), "backend": ["ring", "mpi", "nccl"]}
    helps = {
        "steps": "optimizer steps", "batch_size": "sequences per step (the global batch)",
        "seed": "seeds the weights and the batches",
        "dtype": "parameter and activation dtype; float16 / bfloat16 (emulated): mixed precision, float32 masters",
        "device": "where parameters, gradients, optimizer states and batches live: cpu (NumPy) or cuda (CuPy, "
                  "one GPU per rank: local rank modulo the GPUs of its machine)",
        "backend": "collectives: ring (hand-written, over MPI point-to-point), mpi (MPI's own), nccl (GPU buffers, "
                   "--device cuda)",
        "system_allocator": "keep glibc's default malloc settings (by default the trainer keeps freed memory "
                            "mapped for the next step: minidist/allocator.py)",
        "comm_timeout": "seconds a collective or point-to-point call waits for a peer before the job fails "
                        "(exit status 3) naming the rank that never arrived",
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
        "cp": "context-parallel ranks: each holds 1/cp of every sequence's tokens",
        "ep": "expert-parallel ranks, inside dp: each holds 1/ep of every MoE layer's experts, tokens reach them "
              "by all-to-all",
        "n_experts": "experts per MoE layer (0: a dense GPT)", "top_k": "experts each token is routed to",
        "moe_every": "every n-th block has experts (the last of every n)",
        "capacity_factor": "0: dropless; c > 0: each expert takes at most ceil(c k T / E) of each sequence's "
                           "assignments, the rest are dropped",
        "aux_loss_coef": "weight of the load-balancing loss (per sequence, Switch-style)",
        "cp_algorithm": "how attention reaches the other cp ranks' tokens: ring (K/V blocks passed around), zigzag "
                        "(the ring with balanced causal work), ulysses (all-to-alls: heads split over cp)",
        "sequence_parallel": "also split the LayerNorm and residual activations along the sequence over tp",
        "micro_batches": "micro-batches per step and dp rank (gradient accumulation; the pipeline's units)",
        "schedule": "pipeline schedule", "virtual_stages": "model chunks per pipeline rank (interleaved; 2 for zbv)",
        "zero": "ZeRO stage: shard optimizer states (1), + gradients (2), + parameters (3) over dp",
        "offload": "ZeRO-Offload: keep the optimizer shard (masters, moments) off the device and update it on the "
                   "host; optimizer,params: with --zero 3 the parameter shards too",
        "offload_dir": "ZeRO-Infinity: keep the offloaded state in memory-mapped files under this folder instead of "
                       "host memory",
        "recompute": "recompute each block's activations in backward instead of keeping them",
        "bucket_mb": "data-parallel gradient bucket size in MiB",
        "export": "write the consolidated full-model state_dict here at the end (.npz or .safetensors; nanoGPT / "
                  "PyTorch layout, not Hugging Face's: use --export-hf)",
        "export_hf": "write a Hugging Face GPT-2 folder here at the end (config.json + model.safetensors, for "
                     "transformers.GPT2LMHeadModel.from_pretrained)",
        "init_from_hf": "start from a local Hugging Face GPT-2 folder (config.json + model.safetensors; its "
                        "tokenizer.json, if there, tokenizes --data): the model's size comes from it",
        "trace": "run directory for python -m minidist.inspect: DIR/trace/rank<r>.jsonl, DIR/memory/rank<r>.json",
        "explain": "print each rank's first step: what it holds, what it sends to whom",
        "ckpt_dir": "directory of sharded checkpoints (step-<n>/ folders)",
        "save_every": "steps between checkpoints (0: none)", "keep": "newest checkpoints kept",
        "resume": "continue from the newest valid checkpoint in --ckpt-dir (in any layout); refused (exit 2) when "
                  "none is valid or it is another run's (model, seed, data or hyper-parameters differ)",
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
