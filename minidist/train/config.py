"""What a training run is: :class:`TrainConfig` and the checks (its command line: train/cli.py).

A bad configuration is found from the config and the world size alone, so every rank reaches the
same verdict before any communication, and ``python -m minidist.train`` prints one clear message
listing every problem (:class:`ConfigError`) instead of hanging halfway through a collective. The
layout's rules are not here: :func:`check_config` asks :func:`minidist.parallel.spec.problems` (which
the planner and the support matrix ask too) about its config, which is a layout, and adds only what is
the trainer's own (its other numbers, paths, checkpoints, the parameter-server mode, Hugging Face).
"""
import dataclasses
import math
from pathlib import Path

from minidist.amp import COMPUTE_DTYPES
from minidist.optim.state_bytes import optimizer_problems
from minidist.parallel.ps.param_server import check_parameter_server
from minidist.parallel.layout import Layout
from minidist.parallel.spec import Needs, flag, out_of_range, problems
from minidist.train.folders import output_problems
from minidist.train.population import EXPLOITS, EXPLORABLE, POPULATION
from minidist.train.memory import INT64, memory_problems
from minidist.tune.asha import SCHEDULERS
from minidist.tune.samplers import BATCH_RULES, SAMPLERS
from minidist.tune.space import SEARCHABLE, range_flag, space_problems


@dataclasses.dataclass(frozen=True)
class TrainConfig(Layout):
    """Everything a run depends on: its layout (a :class:`~minidist.parallel.layout.Layout`, the fields
    it inherits: dp, tp, pp, cp, ep, the cuts, ZeRO, offload, recompute, dtype, device, backend) and the
    rest, below. The defaults train visibly in about a minute on one CPU core."""
    steps: int = 800
    batch_size: int = 16
    seed: int = 0
    loss_scale: str = "dynamic"
    loss_scale_window: int = 2000
    # optimizer and schedule
    optimizer: str = "adamw"
    lr: float = 3e-3
    min_lr: float | None = None  # None: MIN_LR, or --lr where that is lower (__post_init__)
    warmup: int = 20
    momentum: float = 0.9
    beta1: float = 0.9  # AdamW's, as nanoGPT's
    beta2: float = 0.95
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
    no_bias: bool = False  # nanoGPT's bias=False: no biases in Linears and LayerNorms
    dropout: float = 0.0  # nanoGPT's dropout: attention and residual, in training steps (minidist/nn/dropout.py)
    vocab_size: int = 0  # 0: the data's (train/build.py: load_data)
    # data, evaluation, output
    data: str | None = None
    data_dir: str | None = None
    no_prefetch: bool = False
    eval_every: int = 100
    eval_iters: int = 8
    sample_tokens: int = 200
    out: str | None = None
    # the run's modes (the layout's world size = dp * pp * cp * tp; --mode ps: servers + workers) and what it writes
    mode: str = "collective"
    comm_timeout: float = 300.0
    system_allocator: bool = False
    servers: int = 1
    staleness: int = -1
    straggler: float = 0.0
    population: int = 4  # --mode pbt (train/pbt.py)
    ready_every: int = 50
    explore: str = "lr"
    exploit: str = "truncation"
    quantile: float = 0.25
    lr_range: tuple | None = None
    weight_decay_range: tuple | None = None
    warmup_range: tuple | None = None  # --mode search (train/search.py): also --lr-range, --weight-decay-range
    grad_clip_range: tuple | None = None
    log_scale: str = "lr,weight_decay"
    trials: int = 8
    parallel: int = 1
    sampler: str = "random"
    batch_rule: str = "believer"
    scheduler: str = "none"
    grace: int = 10
    reduction: int = 3
    offload_dir: str | None = None
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
    fault_tolerant: bool = False  # a lost replica dropped live (train/fault_tolerant.py)
    fail_hang: bool = False  # --fail-rank hangs at --fail-at-step (no MPI call) instead of dying
    spares: int = 0  # --fault-tolerant: replicas it may start live (MPI_Comm_spawn), each to replace a lost one
    grow_at: int = -1  # ... or all to join at this step's start (-1: never)

    def __post_init__(self):
        """An unset --min-lr is :data:`MIN_LR`, or --lr where that is lower: the cosine never rises,
        so ``--lr 0`` (evaluate or convert a model without moving it) keeps a learning rate of 0."""
        if self.min_lr is None:
            lower = isinstance(self.lr, (int, float)) and 0 <= self.lr < MIN_LR
            object.__setattr__(self, "min_lr", self.lr if lower else MIN_LR)  # frozen: set once, here


MIN_LR = 3e-4  # where the cosine decay ends when --min-lr is not given (and --lr is not lower)


class ConfigError(ValueError):
    """A configuration that cannot run. Found from the config alone, identically on every rank,
    before any communication."""


# The values each numeric flag that is not the layout's may take, as an interval: "[" and "]" include the
# bound, "(" and ")" exclude it, so an open end at inf refuses inf too, and nan is in no interval. (The layout's
# numbers: spec.RANGES. --save-every, --keep, --comm-timeout and --fail-rank against the world are checked with
# their features, below.) Integer flags are below 2**63, and a run must fit in memory (train/memory.py).
RANGES = {
    "steps": "[1, inf)", "batch_size": "[1, inf)", "seed": "[0, inf)", "loss_scale_window": "[1, inf)",
    "lr": "[0, inf)", "min_lr": "[0, inf)", "warmup": "[0, inf)", "momentum": "[0, 1)", "beta1": "[0, 1)", "beta2": "[0, 1)",
    "weight_decay": "[0, inf)", "grad_clip": "[0, inf)", "block_size": "[1, inf)",
    "dropout": "[0, 1)", "capacity_factor": "[0, 1e6]", "aux_loss_coef": "[0, inf)", "vocab_size": "[0, 1048576]",  # a capacity factor >= E keeps every assignment
    "eval_every": "[1, inf)", "eval_iters": "[1, inf)", "sample_tokens": "[0, inf)",
    "servers": "[1, inf)", "staleness": "[-1, inf)", "straggler": "[0, inf)",
    "bucket_mb": "(0, inf)", "fail_at_step": "[-1, inf)", "fail_rank": "[0, inf)", "spares": "[0, inf)",
    "grow_at": "[-1, inf)",
    "population": "[2, inf)", "ready_every": "[1, inf)", "quantile": "(0, 0.5]",
    "trials": "[1, inf)", "parallel": "[1, inf)", "grace": "[1, inf)", "reduction": "[2, inf)",
}


def range_problems(cfg) -> list[str]:
    """Every flag of ``cfg`` outside its range in :data:`RANGES`, every integer flag at or past 2**63
    (the layout's too: ``spec.RANGES`` bounds them below), --min-lr above --lr, and a --straggler the
    parameter servers would time out waiting for (each comparison once both of its flags are valid)."""
    found = [text for name, interval in RANGES.items() for text in out_of_range(name, getattr(cfg, name), interval)]
    found += [f"{flag(f.name)} must be below 2**63 (NumPy's sizes and indices are int64), got {getattr(cfg, f.name)}"
              for f in dataclasses.fields(TrainConfig) if type(f.default) is int and getattr(cfg, f.name) >= INT64]
    valid = {name for name in ("lr", "min_lr", "straggler") if not out_of_range(name, getattr(cfg, name), RANGES[name])}
    if {"lr", "min_lr"} <= valid and cfg.min_lr > cfg.lr:
        found.append(f"--min-lr {cfg.min_lr} is larger than --lr {cfg.lr} (the cosine decays from --lr to --min-lr)")
    if "straggler" in valid and not comm_timeout_problems(cfg) and cfg.straggler >= cfg.comm_timeout:
        found.append(f"--straggler {cfg.straggler} is not below --comm-timeout {cfg.comm_timeout}: the parameter "
                     f"servers would time out waiting for the straggler")
    return found


def bucket_bytes(bucket_mb: float) -> int:
    """--bucket-mb (any positive, finite MiB) in bytes for ``DataParallel``, at least 1: a bucket closes
    once it holds that many bytes, so below the smallest parameter every parameter is a bucket of its
    own, and above the model's size (2**40 MiB at most counted) one bucket holds every gradient."""
    return max(1, math.ceil(min(bucket_mb, 2.0 ** 40) * 2 ** 20))


def needs_of(cfg) -> Needs:
    """What the layout rules need of ``cfg``'s model and batch (``spec.Needs``)."""
    return Needs(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, seq=cfg.block_size, batch_size=cfg.batch_size,
                 n_experts=cfg.n_experts, top_k=cfg.top_k, moe_every=cfg.moe_every)


def fault_injection_armed(cfg) -> bool:
    """Whether rank --fail-rank crashes on purpose at --fail-at-step: only in a run that does not
    resume, so a restarted job (``python -m minidist.run``) runs through."""
    return cfg.fail_at_step >= 0 and not cfg.resume


def check_config(cfg, world_size: int, memory_bytes: int | None = None) -> None:
    """Raise :class:`ConfigError` listing everything wrong with running ``cfg`` on ``world_size`` ranks:
    :func:`check_flags`, then, with nothing else wrong, whether one rank's run fits in ``memory_bytes``
    (None: int64's sizes; train/memory.py). A run's start (train/life.py) asks the two apart, the data
    read between them (its vocabulary sizes the embeddings)."""
    check_flags(cfg, world_size)
    refuse(memory_problems(cfg, memory_bytes))


def check_flags(cfg, world_size: int) -> None:
    """Raise :class:`ConfigError` listing everything wrong with the flags of ``cfg`` on ``world_size``
    ranks, together, one line each: out-of-range numbers, the layout's problems (``spec.problems``),
    the trainer's own checks (names, paths, checkpoints, Hugging Face, mixed precision, the device),
    with the numbers in range the parameter servers' (they divide by them). Reads the flags and the
    output paths only; sends nothing."""
    numbers = range_problems(cfg)
    groups = {"pbt": cfg.population, "search": cfg.parallel}.get(cfg.mode) if not numbers else None
    member_ranks = world_size // groups if groups else world_size  # each member's, or each trial's
    split = groups and (world_size % groups or not member_ranks)  # no world of its own: said per group below
    found = numbers + problems(cfg, needs_of(cfg), None if cfg.mode == "ps" or split else member_ranks)
    found += parameter_server_problems(cfg, world_size) if cfg.mode == "ps" and not numbers else []
    found += population_problems(cfg, world_size) if cfg.mode == "pbt" and not numbers else []
    found += search_problems(cfg, world_size) if cfg.mode == "search" and not numbers else []
    found += [f"{range_flag(n)} is a range a search searches: add --mode search" for n in ("warmup", "grad_clip")
              if cfg.mode != "search" and getattr(cfg, f"{n}_range") is not None]
    found += optimizer_problems(cfg.optimizer) + hugging_face_problems(cfg) + comm_timeout_problems(cfg)
    found += checkpoint_problems(cfg, world_size) + mixed_precision_problems(cfg) + device_problems(cfg)
    found += offload_dir_problems(cfg) + output_problems(cfg) + recompute_problems(cfg) + fault_tolerance_problems(cfg)
    refuse(found)


def refuse(found: list[str]) -> None:
    """:class:`ConfigError` listing ``found`` (every problem, one line each), unless there is none."""
    if found:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(found))


def population_problems(cfg, world_size: int) -> list[str]:
    """What is wrong with ``--mode pbt`` (train/pbt.py) on ``world_size`` ranks: K members of equal
    size, each the layout's world (said per member: what each gets, and the world that gives each
    its layout), hyper-parameters it can explore with valid ranges, a --ckpt-dir to copy members
    through, and that folder not holding another population unless --resume continues it."""
    k = cfg.population
    found = [] if world_size % k == 0 and world_size >= k else [
        f"--population {k} does not divide the world of {world_size} ranks into equal members: each member gets "
        f"{world_size} / {k} = {world_size / k:g} ranks, and one of dp {cfg.dp} x pp {cfg.pp} x cp {cfg.cp} x tp "
        f"{cfg.tp} needs {cfg.world}: start mpiexec -n {k * cfg.world}"]
    names = [n for n in cfg.explore.split(",") if n]
    found += [f"--explore: {n} is not a hyper-parameter a member can explore ({', '.join(EXPLORABLE)})"
              for n in names if n not in EXPLORABLE] or ([] if names else ["--explore names no hyper-parameter"])
    for spelled, pair in (("--lr-range", cfg.lr_range), ("--weight-decay-range", cfg.weight_decay_range)):
        if pair is not None and not (len(pair) == 2 and all(isinstance(v, (int, float)) and 0 < v < float("inf")
                                                            for v in pair) and pair[0] <= pair[1]):
            found.append(f"{spelled} A B needs 0 < A <= B, finite, got {' '.join(map(str, pair))}")
    if cfg.exploit not in EXPLOITS:
        found.append(f"--exploit must be one of {', '.join(EXPLOITS)}, got {cfg.exploit!r}")
    if cfg.ckpt_dir is None:
        found.append("--mode pbt copies a member into another through its checkpoints: give --ckpt-dir DIR "
                     "(a folder every rank sees)")
    elif not cfg.resume:
        held = sorted((Path(cfg.ckpt_dir) / POPULATION).glob("step-*.json"))
        if held:
            found.append(f"--ckpt-dir {cfg.ckpt_dir} holds a population already (up to {held[-1].name}): add --resume "
                         f"to continue it, or give an empty --ckpt-dir")
    return found


def search_problems(cfg, world_size: int) -> list[str]:
    """What is wrong with ``--mode search`` (train/search.py) on ``world_size`` ranks: --parallel
    sub-groups of equal size, a space to search (tune/space.py), a sampler, a scheduler whose first
    rung comes before the budget's end, a --ckpt-dir that holds no other search unless --resume."""
    k = cfg.parallel
    found = [] if world_size % k == 0 and world_size >= k else [
        f"--parallel {k} does not divide the world of {world_size} ranks into equal sub-groups: each trial gets "
        f"{world_size} / {k} = {world_size / k:g} ranks, and one of dp {cfg.dp} x pp {cfg.pp} x cp {cfg.cp} x tp "
        f"{cfg.tp} needs {cfg.world}: start mpiexec -n {k * cfg.world}"]
    ranges = {n: getattr(cfg, f"{n}_range") for n in SEARCHABLE}
    found += space_problems(ranges, [n for n in cfg.log_scale.split(",") if n])
    found += [f"--{name.replace('_', '-')} must be one of {', '.join(known)}, got {getattr(cfg, name)!r}"
              for name, known in (("sampler", SAMPLERS), ("scheduler", SCHEDULERS), ("batch_rule", BATCH_RULES))
              if getattr(cfg, name) not in known]
    if cfg.scheduler == "asha" and cfg.grace >= cfg.steps:
        found.append(f"--grace {cfg.grace} is not below --steps {cfg.steps}: the budget is too small for one rung "
                     f"of --scheduler asha (give --grace below --steps, or --scheduler none)")
    if cfg.ckpt_dir is None:
        found.append("--mode search resumes each trial from its checkpoints: give --ckpt-dir DIR (a folder every "
                     "rank sees)")
    elif not cfg.resume and (Path(cfg.ckpt_dir) / "search" / "state.json").exists():
        found.append(f"--ckpt-dir {cfg.ckpt_dir} holds a search already: add --resume to continue it, or give an "
                     f"empty --ckpt-dir")
    return found


def hugging_face_problems(cfg) -> list[str]:
    """Hugging Face's GPT-2, which --export-hf writes and --init-from-hf reads, has no experts and
    always has biases."""
    if cfg.export_hf is None and cfg.init_from_hf is None:
        return []
    found = ["--export-hf and --init-from-hf read and write Hugging Face's GPT-2, which has no experts: use "
             "--export for a mixture-of-experts model"] if cfg.n_experts else []
    return found + (["--export-hf and --init-from-hf read and write Hugging Face's GPT-2, which always has biases: "
                     "use --export for a model built with --no-bias"] if cfg.no_bias else [])


def comm_timeout_problems(cfg) -> list[str]:
    """What is wrong with ``--comm-timeout`` (a positive, finite number of seconds)."""
    if not (isinstance(cfg.comm_timeout, (int, float)) and 0 < cfg.comm_timeout < float("inf")):
        return [f"--comm-timeout must be a positive, finite number of seconds, got {cfg.comm_timeout}"]
    return []


def parameter_server_problems(cfg, world_size: int) -> list[str]:
    """What is wrong with running ``cfg`` in ``--mode ps`` on ``world_size`` ranks (servers + workers,
    whole models: the collective layouts' flags do not apply)."""
    staleness, problems = None if cfg.staleness < 0 else cfg.staleness, []
    try:
        check_parameter_server(world_size, cfg.servers, staleness, cfg.straggler, cfg.batch_size)
    except ValueError as e:
        problems.append(str(e))
    collective = [flag(name) for name in ("dp", "pp", "tp", "cp", "ep", "micro_batches", "zero", "offload", "ckpt_dir",
                  "explain", "sequence_parallel", "recompute", "export_hf", "init_from_hf", "dropout")
                  if getattr(cfg, name) not in (1, 0, None, False, "none")]
    if collective:
        problems.append(f"--mode ps trains whole models on its workers: {', '.join(collective)} do not apply")
    return problems


def fault_tolerance_problems(cfg) -> list[str]:
    """What ``--fault-tolerant`` (train/fault_tolerant.py) cannot drop a replica of yet, and why: it keeps
    each step's start as ZeRO-1 or 2 shards with a copy on the next replica, re-forms the dp axis alone,
    and keeps no loss scaler's state across a drop."""
    if not cfg.fault_tolerant:
        return ["--spares and --grow-at start replicas that join a --fault-tolerant run: add --fault-tolerant"] \
            if cfg.spares or cfg.grow_at >= 0 else []
    found = spare_problems(cfg)
    why = []
    if cfg.mode != "collective":
        why.append(f"--mode {cfg.mode} (it drops the replicas of one collective run)")
    if cfg.zero not in (1, 2) or cfg.offload != "none":
        why.append("a state other than ZeRO-1 or 2 on the device (each replica's part of the optimizer state is "
                   "kept on the next replica at every step's start: add --zero 1 or 2, without --offload)")
    if cfg.dp < 2:
        why.append("one replica (nothing to go on with: add --dp 2 or more)")
    if cfg.pp > 1 or cfg.cp > 1 or cfg.n_experts:
        why.append("pipeline, context or expert parallelism (their groups would be re-formed too, not done yet)")
    if cfg.dtype not in ("float32", "float64"):
        why.append(f"--dtype {cfg.dtype} (the loss scaler's state is not kept across a drop yet)")
    return found + [f"--fault-tolerant is not done with {w}" for w in why]


def spare_problems(cfg) -> list[str]:
    """What is wrong with --spares and --grow-at: the step to grow at needs spares to start, and the
    global batch must divide over the replicas it grows to."""
    if cfg.grow_at >= 0 and not cfg.spares:
        return [f"--grow-at {cfg.grow_at} starts the spares as new replicas: add --spares S (S >= 1)"]
    if cfg.grow_at >= 0 and cfg.batch_size % (cfg.dp + cfg.spares):
        return [f"--grow-at {cfg.grow_at} grows dp {cfg.dp} by --spares {cfg.spares}, and the global batch of "
                f"{cfg.batch_size} rows does not divide over {cfg.dp + cfg.spares} replicas"]
    return []


def recompute_problems(cfg) -> list[str]:
    """The trainer recomputes whole blocks (--recompute, "full"); recomputing the attention core alone
    ("selective") is what the planner estimates, not what the trainer runs."""
    if cfg.recompute != "selective":
        return []
    return ["--recompute selective is the planner's estimate (the attention core recomputed); the trainer "
            "recomputes whole blocks: --recompute (full)"]


def offload_dir_problems(cfg) -> list[str]:
    """What --offload-dir cannot be: a folder for nothing offloaded. (Whether its path can be a folder:
    train/folders.py; what --offload itself cannot run: a layout rule.)"""
    if cfg.offload_dir is not None and cfg.offload == "none":
        return ["--offload-dir is where offloaded state lives: add --offload optimizer (or optimizer,params with "
                "--zero 3)"]
    return []


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
    """What --device cannot be combined with beyond the layout's rules. Whether CuPy and a GPU are
    there is asked when the run starts: :func:`minidist.train.build.select_device`."""
    if cfg.device == "cuda" and cfg.mode == "ps":
        return ["--device cuda with --mode ps is not supported: the parameter servers keep NumPy shards"]
    return []


def checkpoint_problems(cfg, world_size: int) -> list[str]:
    """What is wrong with the checkpoint and fault-injection flags of ``cfg``."""
    problems = []
    if (cfg.save_every or cfg.resume) and cfg.ckpt_dir is None:
        problems.append("--save-every and --resume need --ckpt-dir (where the checkpoints live)")
    if cfg.save_every < 0:
        problems.append(f"--save-every must be >= 0 (0: never), got {cfg.save_every}")
    if cfg.keep < 1:
        problems.append(f"--keep must be >= 1, got {cfg.keep}")
    if fault_injection_armed(cfg) and not 0 <= cfg.fail_rank < world_size:
        problems.append(f"--fail-rank {cfg.fail_rank} is not a rank of the {world_size}-rank world")
    return problems
