"""The support matrix: every combination of the trainer's features, and whether it runs.

The grid is the product of twelve axes (a new user's first questions):

    layout      dp, tp, pp each 1 or 2                              8
    context parallelism    cp 1 or 2                                2
    cp algorithm           ring, zigzag, ulysses                    3
    ZeRO        stage 0, 1, 2, 3                                    4
    sequence parallelism   off, on                                  2
    schedule    gpipe, 1f1b, interleaved, zb-h1, zbv                5
    recompute   off, on                                             2
    precision   float32, bfloat16, float16                          3
    checkpoints off, on (save, and resume from the newest)          2
    experts     none (dense), MoE with experts on every dp rank     3
                (ep 1), MoE with experts split over 2 (ep 2)
    offload     none, optimizer (host memory), optimizer,params     3
                (in files under --offload-dir)
    dropout     off, on (--dropout 0.1)                             2      = 414,720 cells

A cell is MEANINGLESS when it asks for something its layout does not have (sequence parallelism
without tensor parallelism: nothing to split the sequence over; a schedule other than the default
without pipeline parallelism: with one stage every schedule is the same run, counted once, as 1f1b;
likewise a cp algorithm other than ring with cp 1; expert parallelism with dp 1, as ep splits the
experts over dp ranks; offloading parameters below ZeRO-3, whose stages 0-2 keep every parameter
whole on each rank: the run that offloads the optimizer alone, counted once). The layout rules
decide it: a cell is meaningless when one of its problems (``minidist.parallel.spec.problems``, which
the trainer and the planner ask too) says it names something its layout lacks (``spec.lacks``), and
the trainer refuses it with that problem. Every other cell must be accepted by
:func:`~minidist.train.config.check_config`: a refusal is a debt, and :func:`refusals` lists them
(none today). tests/test_composition.py trains the cells against one process; the README's matrix
is :func:`markdown`, checked against it by a test; tests/test_layout_problems.py holds the trainer,
the planner and this matrix to the same verdict on every cell.

    python -m minidist.support_matrix              # a summary that fits a terminal
    python -m minidist.support_matrix --markdown   # the README's table
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import textwrap
from functools import lru_cache

from minidist.parallel.layout import Layout, layout_fields
from minidist.parallel.spec import lacks
from minidist.train.config import ConfigError, TrainConfig, check_config, needs_of

LAYOUTS = [dict(dp=dp, tp=tp, pp=pp) for pp in (1, 2) for dp in (1, 2) for tp in (1, 2)]
AXES = {
    "layout": LAYOUTS,
    "cp": [1, 2],
    "cp_algorithm": ["ring", "zigzag", "ulysses"],
    "zero": [0, 1, 2, 3],
    "sequence_parallel": [False, True],
    "schedule": ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"],
    "recompute": ["none", "full"],
    "dtype": ["float32", "bfloat16", "float16"],
    "checkpoint": [False, True],
    "moe": ["none", "ep1", "ep2"],
    "offload": ["none", "optimizer", "optimizer,params"],
    "dropout": [False, True],
}


@dataclasses.dataclass(frozen=True)
class Cell(Layout):
    """One combination: a layout (a :class:`~minidist.parallel.layout.Layout`: dp, tp, pp, context
    parallelism, a ZeRO stage, sequence parallelism, a schedule, recompute, a precision, what it
    offloads: "optimizer", the optimizer shards, to host memory; "optimizer,params", with the parameter
    shards, to files), whether it checkpoints, and its experts ("none": a dense GPT; "ep1": 4 experts
    per MoE block, on every rank; "ep2": split over 2 dp ranks). The rest of its layout follows from
    those: ep 2 for "ep2", two micro-batches per step, two virtual stages per rank under the
    interleaved and zbv schedules; whether it trains with dropout (p = 0.1: not a layout's)."""
    checkpoint: bool = False
    moe: str = "none"
    dropout: bool = False

    def __post_init__(self):
        derived = dict(ep=2 if self.moe == "ep2" else 1, micro_batches=2,
                       virtual_stages=2 if self.schedule in ("interleaved", "zbv") and self.pp > 1 else 1)
        for name, value in derived.items():
            object.__setattr__(self, name, value)  # frozen: derived once, here

    def __str__(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"] + [f"cp{self.cp}-{self.cp_algorithm}"] * (self.cp > 1)
        parts += [f"zero{self.zero}"]
        parts += ["sp"] * self.sequence_parallel + [self.schedule] * (self.pp > 1) + ["recompute"] * (self.recompute == "full")
        parts += [self.dtype] + ["ckpt"] * self.checkpoint + [f"moe-{self.moe}"] * (self.moe != "none")
        parts += [f"offload-{self.offload.replace(',', '+')}"] * (self.offload != "none")
        return "-".join(parts + ["dropout"] * self.dropout)


def grid() -> list[Cell]:
    """All 414,720 cells, in a fixed order."""
    return [Cell(**layout, cp=cp, cp_algorithm=a, zero=z, sequence_parallel=sp, schedule=s, recompute=r, dtype=d,
                 checkpoint=c, moe=e, offload=o, dropout=dr)
            for layout, cp, a, z, sp, s, r, d, c, e, o, dr in itertools.product(*AXES.values())]


def meaningful() -> list[Cell]:
    """The cells of :func:`grid` that are not :func:`meaningless` (77,760), in its order: each is
    judged by its :data:`LACKING` key before it is made, so the 336,960 meaningless cells never are."""
    return [Cell(**layout, cp=cp, cp_algorithm=a, zero=z, sequence_parallel=sp, schedule=s, recompute=r, dtype=d,
                 checkpoint=c, moe=e, offload=o, dropout=dr)
            for layout, cp, a, z, sp, s, r, d, c, e, o, dr in itertools.product(*AXES.values())
            if _layout_meaningless((layout["dp"], layout["tp"], layout["pp"], cp, a, z, sp, s, e, o)) is None]


def layout_keys():
    """Every value the grid's cells take in the :data:`LACKING` fields, as those fields' tuples."""
    for layout, *rest in itertools.product(*(AXES[name] for name in ("layout",) + LACKING[3:])):
        yield (layout["dp"], layout["tp"], layout["pp"], *rest)


def meaningless(cell: Cell) -> str | None:
    """Why ``cell`` names a combination that does not exist (the first of ``spec.lacks`` of its
    layout: a problem the trainer refuses it with), or None. Recompute, checkpoints, the precision and
    dropout are not part of what a layout lacks (no ``lacks`` reads them): the cells that differ only in
    them share one answer, found once."""
    return _layout_meaningless(tuple(getattr(cell, name) for name in LACKING))


LACKING = ("dp", "tp", "pp", "cp", "cp_algorithm", "zero", "sequence_parallel", "schedule", "moe", "offload")
"""The fields of a cell that ``spec.lacks`` can read (the others keep their defaults in its key)."""


@lru_cache(maxsize=None)
def _layout_meaningless(key: tuple) -> str | None:
    cfg = config_for(Cell(**dict(zip(LACKING, key))))
    found = lacks(cfg, needs_of(cfg))
    return found[0] if found else None


def config_for(cell: Cell, **sizes) -> TrainConfig:
    """The TrainConfig of ``cell``: its layout, and with experts 4 per MoE block, top-2, in every second
    block (``sizes`` override the model and batch). A checkpointing cell saves into ``ckpt``, and an
    offloading cell of parameters keeps its files in ``offload`` (relative paths: only checked, never
    written here); a dropout cell drops with p = 0.1."""
    base = dict(n_layer=4, n_head=4, n_embd=16, block_size=16, batch_size=8)
    base.update(sizes)
    return TrainConfig(**base, **layout_fields(cell),
                       ckpt_dir="ckpt" if cell.checkpoint else None, save_every=2 if cell.checkpoint else 0,
                       n_experts=0 if cell.moe == "none" else 4, moe_every=2,
                       offload_dir="offload" if cell.offload == "optimizer,params" else None,
                       dropout=0.1 if cell.dropout else 0.0)


def refusals(cells: list[Cell] | None = None) -> dict:
    """{cell: the trainer's message} for every meaningful cell of ``cells`` (default: the whole
    :func:`grid`) :func:`check_config` refuses."""
    refused = {}
    for cell in meaningful() if cells is None else cells:
        if meaningless(cell) is None:
            try:
                check_config(config_for(cell), cell.world)
            except ConfigError as e:
                refused[cell] = str(e)
    return refused


FEATURES = {  # a feature: the cells that have it
    "dp 2": lambda c: c.dp == 2, "tp 2": lambda c: c.tp == 2, "pp 2": lambda c: c.pp == 2,
    "cp ring": lambda c: c.cp == 2 and c.cp_algorithm == "ring",
    "cp zigzag": lambda c: c.cp == 2 and c.cp_algorithm == "zigzag",
    "Ulysses": lambda c: c.cp == 2 and c.cp_algorithm == "ulysses",
    "SP": lambda c: c.sequence_parallel, "ZeRO-1": lambda c: c.zero == 1, "ZeRO-2": lambda c: c.zero == 2,
    "ZeRO-3": lambda c: c.zero == 3, "GPipe": lambda c: c.pp == 2 and c.schedule == "gpipe",
    "1F1B": lambda c: c.pp == 2 and c.schedule == "1f1b",
    "interleaved": lambda c: c.pp == 2 and c.schedule == "interleaved",
    "ZB-H1": lambda c: c.pp == 2 and c.schedule == "zb-h1", "ZB-V": lambda c: c.pp == 2 and c.schedule == "zbv",
    "recompute": lambda c: c.recompute == "full",
    "bf16": lambda c: c.dtype == "bfloat16", "fp16": lambda c: c.dtype == "float16",
    "checkpoints": lambda c: c.checkpoint,
    "MoE": lambda c: c.moe != "none", "EP": lambda c: c.moe == "ep2",
    "offload": lambda c: c.offload != "none", "offload params": lambda c: c.offload == "optimizer,params",
    "dropout": lambda c: c.dropout,
}


@dataclasses.dataclass(frozen=True)
class Verdicts:
    """What the matrix says: ``marks[a, b]`` for every pair of :data:`FEATURES` ("✓" every meaningful
    cell that has both runs, "✗" one of them is refused, "·" no cell can have both: one axis, or a
    meaningless pair); the counts of cells; the refused ones with the trainer's message; the kinds
    of meaningless cells."""
    marks: dict
    cells: int
    valid: int
    refused: dict
    kinds: list


def verdicts(cells: list[Cell] | None = None) -> Verdicts:
    """The :class:`Verdicts` of ``cells`` (default: the whole :func:`grid`)."""
    if cells is None:  # every layout's verdict once, and only the meaningful cells made
        valid, count = meaningful(), math.prod(map(len, AXES.values()))
        kinds = {_layout_meaningless(key) for key in layout_keys()}
    else:
        valid, count = [c for c in cells if meaningless(c) is None], len(cells)
        kinds = {meaningless(c) for c in cells}
    refused = refusals(valid)
    having = {name: {i for i, c in enumerate(valid) if has(c)} for name, has in FEATURES.items()}
    bad = {i for i, c in enumerate(valid) if c in refused}
    marks = {(a, b): "·" if a == b or not having[a] & having[b] else "✗" if having[a] & having[b] & bad else "✓"
             for a in FEATURES for b in FEATURES}
    return Verdicts(marks, count, len(valid), refused, sorted(kinds - {None}))


def counts_line(v: Verdicts) -> str:
    return (f"{v.valid - len(v.refused):,} of the {v.cells:,} cells run and {len(v.refused)} are refused; "
            f"the other {v.cells - v.valid:,} are meaningless:")


def markdown(v: Verdicts | None = None) -> str:
    """The README's support matrix (:class:`Verdicts` as a Markdown table, a row and a column per
    feature); then the counts and the meaningless kinds."""
    v = verdicts() if v is None else v
    names = list(FEATURES)
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| **{a}** | " + " | ".join(v.marks[a, b] for b in names) + " |" for a in names]
    lines += ["", counts_line(v)] + [f"- {kind}" for kind in v.kinds]
    return "\n".join(lines)


def summary(v: Verdicts | None = None, width: int = 100) -> str:
    """The matrix for a terminal, in at most ``width`` columns: the features numbered, one row each,
    the columns by number; the pairs refused, the counts and the meaningless kinds wrapped."""
    v = verdicts() if v is None else v
    names = list(FEATURES)
    label = max(map(len, names)) + 5
    lines = ["Which pairs of features train together, over every cell of the grid (--markdown: the README's table)",
             "", " " * label + "".join(f"{i:>3}" for i in range(1, len(names) + 1))]
    lines += [f"{i:>3}  {a:<{label - 5}}" + "".join(f"{v.marks[a, b]:>3}" for b in names)
              for i, a in enumerate(names, 1)]
    lines += ["", "✓ every cell that has both runs   ✗ a cell that has both is refused",
              "· no cell has both: one axis (ZeRO-1 and ZeRO-2), or a meaningless pair (below)"]
    refused = [f"{a} + {b}" for i, a in enumerate(names) for b in names[i + 1:] if v.marks[a, b] == "✗"]
    lines += textwrap.wrap("refused pairs: " + (", ".join(refused) if refused else "none"), width,
                           subsequent_indent="  ")
    lines += textwrap.wrap(counts_line(v), width)
    lines += [line for kind in v.kinds for line in textwrap.wrap(kind, width, initial_indent="- ",
                                                                 subsequent_indent="  ")]
    return "\n".join(lines)
