"""A run the planner sizes: the layout (dp x pp x cp x tp, ep inside dp), the batch and the recipe.

:func:`layout_problems` lists why a layout cannot run, in words a user reads ("tp 16 does not
divide 8 kv heads"), the same words ``--search`` prints next to a rejected layout.
"""
from __future__ import annotations

from dataclasses import dataclass

from minidist.parallel.zero.offload import CHOICES as OFFLOAD_CHOICES
from minidist.parallel.pipeline import SCHEDULES
from minidist.parallel.pipeline.schedules import CHUNKS

ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
RECOMPUTE = ("none", "selective", "full")
SLOTS = {"adamw": 2, "sgd": 1}  # optimizer state per parameter: AdamW's two moments, SGD's momentum


@dataclass(frozen=True)
class RunSpec:
    """``seq`` tokens per sequence; each data-parallel rank runs ``micro_batches`` micro-batches of
    ``micro_batch_size`` sequences per step. Mixed precision is ``dtype`` bfloat16 / float16: the
    model computes in it, the optimizer keeps float32 masters and moments. ``recompute``: "full"
    keeps each block's input only (minidist's ``--recompute``), "selective" drops the attention
    core's activations (Korthikanti et al.). ``dropout``: the activations of Korthikanti et al.'s
    model, with dropout masks; off: minidist's model. ``offload_to`` is where ``offload`` puts the
    shards: "host" or "disk"."""
    seq: int = 1024
    micro_batch_size: int = 1
    micro_batches: int = 1
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    dtype: str = "bfloat16"
    optimizer: str = "adamw"
    sequence_parallel: bool = False
    recompute: str = "none"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    dropout: bool = False
    cp_algorithm: str = "ring"
    offload: str = "none"
    offload_to: str = "host"

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def mixed(self) -> bool:
        return self.dtype in ("bfloat16", "float16")

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def global_batch(self) -> int:
        """Sequences per step over all data-parallel ranks."""
        return self.dp * self.micro_batches * self.micro_batch_size

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def forwards(self) -> int:
        """How many times a block's forward runs per micro-batch: twice under full recompute (again
        inside its backward, with its traffic)."""
        return 2 if self.recompute == "full" else 1


def layout_problems(model, run: RunSpec) -> list[str]:
    """Why ``run`` cannot train ``model``, one line each (empty: it can)."""
    problems = []
    for name in ("seq", "micro_batch_size", "micro_batches", "dp", "tp", "pp", "cp", "ep", "virtual_stages"):
        if getattr(run, name) < 1:
            problems.append(f"{name} must be >= 1, got {getattr(run, name)}")
    if problems:
        return problems
    if run.dtype not in ITEMSIZE:
        problems.append(f"dtype must be one of {', '.join(ITEMSIZE)}, got {run.dtype!r}")
    if run.optimizer not in SLOTS:
        problems.append(f"optimizer must be adamw or sgd, got {run.optimizer!r}")
    if run.zero not in (0, 1, 2, 3):
        problems.append(f"zero must be 0-3, got {run.zero}")
    if run.recompute not in RECOMPUTE:
        problems.append(f"recompute must be one of {', '.join(RECOMPUTE)}, got {run.recompute!r}")
    if run.offload not in OFFLOAD_CHOICES or run.offload_to not in ("host", "disk"):
        problems.append(f"offload must be one of {', '.join(OFFLOAD_CHOICES)} to host or disk")
    elif run.offload == "optimizer,params" and run.zero != 3:
        problems.append("offloading the parameters moves ZeRO-3's parameter shards: use --zero 3")
    if run.schedule not in SCHEDULES:
        problems.append(f"schedule must be one of {', '.join(SCHEDULES)}, got {run.schedule!r}")
    elif run.pp > 1 and run.schedule != "interleaved" and run.virtual_stages != CHUNKS.get(run.schedule, 1):
        problems.append(f"the {run.schedule} schedule runs {CHUNKS.get(run.schedule, 1)} chunk(s) per rank")
    elif run.pp > 1 and run.schedule == "interleaved" and run.micro_batches % run.pp:
        problems.append(f"interleaved 1F1B needs micro-batches ({run.micro_batches}) a multiple of pp ({run.pp})")
    for what, n in (("heads", model.n_head), ("kv heads", model.kv_heads), ("MLP width", model.hidden)):
        if n % run.tp and not (what == "kv heads" and run.tp % n == 0):
            problems.append(f"tp {run.tp} does not divide the {n} {what}")
    if model.n_layer < run.n_stages:
        problems.append(f"pp {run.pp} x {run.virtual_stages} chunk(s) is more stages than the {model.n_layer} layers")
    chunks = 2 * run.cp if run.cp_algorithm == "zigzag" else run.cp
    if run.seq % chunks or (run.sequence_parallel and (run.seq // run.cp) % run.tp):
        problems.append(f"the sequence of {run.seq} does not split into cp {run.cp}"
                        + (f" x tp {run.tp} (sequence parallel)" if run.sequence_parallel else ""))
    if run.cp_algorithm == "ulysses" and (model.n_head // run.tp) % run.cp:
        problems.append(f"Ulysses needs cp {run.cp} to divide the {model.n_head // run.tp} heads per tp rank")
    if model.positions == "learned" and run.seq > model.block_size:
        problems.append(f"the sequence of {run.seq} is longer than the model's {model.block_size} learned positions")
    if run.ep > 1 and (not model.n_experts or model.n_experts % run.ep or run.dp % run.ep):
        problems.append(f"ep {run.ep} needs experts it divides ({model.n_experts}) and must divide dp {run.dp}")
    return problems
