"""A run the planner sizes: the layout (dp x pp x cp x tp, ep inside dp), the batch and the recipe.

:func:`layout_problems` lists why a layout cannot run, in words a user reads ("n_head 12 is not
divisible by tp 5"), the same words ``--search`` prints next to a rejected layout. The layout's rules
are :func:`minidist.parallel.spec.problems`, which the trainer asks too; the planner adds only its
own (its numbers' ranges, ``limits.py``; the recipe, where offload goes, the model's learned
positions) and, for a layout that can run, the bounds of its own work (``limits.work_problems``).
"""
from __future__ import annotations

from dataclasses import dataclass

from minidist.optim.state_bytes import ITEMSIZE, optimizer_problems
from minidist.parallel.layout import Layout, layout_fields
from minidist.parallel.spec import Needs, numbers_out_of_range, problems
from minidist.plan.limits import own_number_problems, work_problems

OFFLOAD_TO = ("host", "disk")


@dataclass(frozen=True)
class RunSpec(Layout):
    """A run the planner sizes: its layout (a :class:`~minidist.parallel.layout.Layout`, whose fields it
    inherits; the planner's precision by default bfloat16) and ``seq`` tokens per sequence, each
    data-parallel rank running ``micro_batches`` micro-batches of ``micro_batch_size`` sequences per
    step. Mixed precision is ``dtype`` bfloat16 / float16: the model computes in it, the optimizer
    keeps float32 masters and moments. ``recompute``: "full" keeps each block's input only
    (minidist's ``--recompute``), "selective" drops the attention core's activations (Korthikanti et
    al.). ``dropout``: the activations of Korthikanti et al.'s model, with dropout masks; off:
    minidist's model. ``offload_to`` is where ``offload`` puts the shards: "host" or "disk"."""
    dtype: str = "bfloat16"
    seq: int = 1024
    micro_batch_size: int = 1
    optimizer: str = "adamw"
    dropout: bool = False
    offload_to: str = "host"

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
    def forwards(self) -> int:
        """How many times a block's forward runs per micro-batch: twice under full recompute (again
        inside its backward, with its traffic)."""
        return 2 if self.recompute == "full" else 1


def needs_of(model, run: RunSpec) -> Needs:
    """What the layout rules need of ``model`` and ``run``'s batch (:mod:`minidist.parallel.spec`): a
    GPT-2 shape's kv heads and MLP width stay None (the heads' rule covers them)."""
    return Needs(n_layer=model.n_layer, n_head=model.n_head, n_embd=model.n_embd, seq=run.seq,
                 batch_size=run.global_batch, kv_heads=model.n_kv_head, mlp_width=model.ffn,
                 n_experts=model.n_experts, top_k=model.top_k, moe_every=model.moe_every)


def number_problems(model, run: RunSpec) -> list[str]:
    """Every number of ``model`` and ``run`` out of its range: the layout's (``spec.RANGES``), the
    planner's own and its caps (``limits.own_number_problems``). Arithmetic only: what a search
    checks before it starts."""
    return numbers_out_of_range(run, needs_of(model, run)) + own_number_problems(model, run)


def layout_problems(model, run: RunSpec) -> list[str]:
    """Why ``run`` cannot train ``model``, one line each, all at once (empty: it can): the layout's
    problems (``minidist.parallel.spec.problems``) and the planner's own, then, when there are none,
    what would be more work than the planner does (``limits.work_problems``)."""
    found = own_number_problems(model, run)
    found += problems(run, needs_of(model, run))
    found += optimizer_problems(run.optimizer)
    if run.offload_to not in OFFLOAD_TO:
        found.append(f"--offload-to must be one of {', '.join(OFFLOAD_TO)}, got {run.offload_to!r}")
    if model.positions == "learned" and run.seq > model.block_size:
        found.append(f"the sequence of {run.seq} is longer than the model's {model.block_size} learned positions: "
                     f"a shorter --seq, or --block-size {run.seq}")
    return found or work_problems(model, run)


def run_spec_of(cfg) -> RunSpec:
    """The planner's RunSpec of a trainer's config: the same layout (both are one), its global batch
    cut over dp and micro-batches, its optimizer, and offload to disk when it names a folder."""
    return RunSpec(**layout_fields(cfg), seq=cfg.block_size,
                   micro_batch_size=cfg.batch_size // (cfg.dp * cfg.micro_batches), optimizer=cfg.optimizer,
                   offload_to="disk" if cfg.offload_dir else "host")
