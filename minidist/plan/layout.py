"""A run the planner sizes: the layout (dp x pp x cp x tp, ep inside dp), the batch and the recipe.

:func:`layout_problems` lists why a layout cannot run, in words a user reads ("n_head 12 is not
divisible by tp 5"), the same words ``--search`` prints next to a rejected layout. The layout's rules
are :func:`minidist.parallel.spec.problems`, which the trainer asks too; the planner adds only its
own (its numbers' ranges, ``limits.py``; the recipe, where offload goes, the model's learned
positions) and, for a layout that can run, the bounds of its own work (``limits.work_problems``).
"""
from __future__ import annotations

from dataclasses import dataclass

from minidist.optim.state_bytes import ITEMSIZE, OPTIMIZERS
from minidist.parallel.spec import LayoutSpec, problems, range_problems
from minidist.plan.limits import own_number_problems, work_problems

RECOMPUTE = ("none", "selective", "full")
OFFLOAD_TO = ("host", "disk")


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


def layout_of(model, run: RunSpec) -> LayoutSpec:
    """The layout of ``run`` training ``model`` as the layout rules read it (:mod:`minidist.parallel.spec`):
    a GPT-2 shape's kv heads and MLP width stay None (the heads' rule covers them)."""
    return LayoutSpec(n_layer=model.n_layer, n_head=model.n_head, n_embd=model.n_embd, seq=run.seq,
                      batch_size=run.global_batch, dp=run.dp, tp=run.tp, pp=run.pp, cp=run.cp,
                      cp_algorithm=run.cp_algorithm, ep=run.ep, zero=run.zero, sequence_parallel=run.sequence_parallel,
                      schedule=run.schedule, virtual_stages=run.virtual_stages, micro_batches=run.micro_batches,
                      offload=run.offload, kv_heads=model.n_kv_head, mlp_width=model.ffn, n_experts=model.n_experts,
                      top_k=model.top_k, moe_every=model.moe_every, dtype=run.dtype)


def number_problems(model, run: RunSpec) -> list[str]:
    """Every number of ``model`` and ``run`` out of its range: the layout's (``spec.RANGES``), the
    planner's own and its caps (``limits.own_number_problems``). Arithmetic only: what a search
    checks before it starts."""
    return [p.text for p in range_problems(layout_of(model, run))] + own_number_problems(model, run)


def layout_problems(model, run: RunSpec) -> list[str]:
    """Why ``run`` cannot train ``model``, one line each, all at once (empty: it can): the layout's
    problems (:func:`layout_of`, ``minidist.parallel.spec.problems``) and the planner's own, then,
    when there are none, what would be more work than the planner does (``limits.work_problems``)."""
    found = own_number_problems(model, run)
    found += problems(layout_of(model, run))
    if run.optimizer not in OPTIMIZERS:
        found.append(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {run.optimizer!r}")
    if run.recompute not in RECOMPUTE:
        found.append(f"--recompute must be one of {', '.join(RECOMPUTE)}, got {run.recompute!r}")
    if run.offload_to not in OFFLOAD_TO:
        found.append(f"--offload-to must be one of {', '.join(OFFLOAD_TO)}, got {run.offload_to!r}")
    if model.positions == "learned" and run.seq > model.block_size:
        found.append(f"the sequence of {run.seq} is longer than the model's {model.block_size} learned positions: "
                     f"a shorter --seq, or --block-size {run.seq}")
    return found or work_problems(model, run)


def run_spec_of(cfg) -> RunSpec:
    """The planner's RunSpec of a ``TrainConfig`` (its global batch cut over dp and micro-batches):
    read field by field, so the planner needs nothing of the trainer but the config it is given."""
    return RunSpec(seq=cfg.block_size, micro_batch_size=cfg.batch_size // (cfg.dp * cfg.micro_batches),
                   micro_batches=cfg.micro_batches, dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep,
                   zero=cfg.zero, dtype=cfg.dtype, optimizer=cfg.optimizer, sequence_parallel=cfg.sequence_parallel,
                   recompute="full" if cfg.recompute else "none", schedule=cfg.schedule,
                   virtual_stages=cfg.virtual_stages, cp_algorithm=cfg.cp_algorithm, offload=cfg.offload,
                   offload_to="disk" if cfg.offload_dir else "host")
