"""One function says what is wrong with a layout (minidist/parallel/spec.py: ``problems``), and the
trainer (``check_config``), the planner (``layout_problems``) and the support matrix (``meaningless``)
all ask it, so they cannot disagree. Held here on the support matrix's cells (a seeded sample that
holds every value of every axis, each kind of meaningless cell, and with ``--slow`` all 414,720) and
on edge layouts that break each rule:

- the trainer and the planner give the SAME lines, in the same order (empty for both, or the same
  refusal), for every layout both can express;
- a cell is meaningless exactly when the trainer refuses it, with the problem that says so; every
  other cell is accepted (the matrix's refusals stay empty);
- every problem comes at once: a bad number beside a bad layout, a layout problem beside the
  trainer's own.
"""
import dataclasses
import random
from functools import lru_cache

import pytest

from minidist.parallel.layout import Layout
from minidist.parallel.spec import Needs, findings, lacks, problems
from minidist.plan import from_gpt_config, preset
from minidist.plan.layout import RunSpec, layout_problems, needs_of as planner_needs
from minidist.plan.layout import run_spec_of
from minidist.train.config import ConfigError, TrainConfig, check_config, needs_of
from minidist.train.support_matrix import AXES, config_for, grid, meaningless


@lru_cache(maxsize=None)
def all_cells() -> tuple:
    """The grid's 414,720 cells, made once, when a test first asks (not at collection, on every worker)."""
    return tuple(grid())


def trainer(cfg) -> list[str]:
    """The trainer's verdict on ``cfg`` on as many ranks as its layout needs: its refusal's lines."""
    try:
        check_config(cfg, cfg.world)
    except ConfigError as e:
        return str(e).split("\n  - ")[1:]
    return []


def planner(cfg) -> list[str]:
    """The planner's verdict on the same run (minidist's GPT, the batch cut over dp and micro-batches)."""
    return layout_problems(from_gpt_config(cfg), run_spec_of(cfg))


@lru_cache(maxsize=None)
def sample(n: int, seed: int = 34, scanned: int = 30000) -> list:
    """``n`` cells of a seeded shuffle of the grid: first, for every value of every axis and every
    verdict of the matrix (accepted, or a kind of meaningless), a cell of the first ``scanned`` that
    has both, where one does; then the others in order."""
    cells = list(all_cells())
    random.Random(seed).shuffle(cells)
    chosen, covered = [], set()
    for c in cells[:scanned]:
        if keys(c) - covered:
            chosen.append(c)
            covered |= keys(c)
    taken = set(chosen)
    return (chosen + [c for c in cells if c not in taken])[:n]


def keys(c) -> set:
    """(axis, value, the matrix's verdict) of every axis of cell ``c``."""
    values = {"layout": (c.dp, c.tp, c.pp), **{a: getattr(c, a) for a in AXES if a != "layout"}}
    return {(a, v, meaningless(c)) for a, v in values.items()}


def disagreement(cell) -> str | None:
    """How the trainer, the planner and the matrix disagree on ``cell``, or None."""
    cfg = config_for(cell)
    said, why = trainer(cfg), meaningless(cell)
    if planner(cfg) != said:
        return f"{cell}: the trainer says {said}, the planner {planner(cfg)}"
    if said != problems(cfg, needs_of(cfg), cell.world):
        return f"{cell}: the trainer adds to the layout's problems: {said}"
    if why is None and said:
        return f"{cell}: meaningful, but refused: {said}"  # refusals are debts
    if why is not None and not any(why in line for line in said):
        return f"{cell}: meaningless ({why}), but the trainer says {said}"
    return None


def test_the_sample_holds_every_axis_value_and_every_kind_of_meaningless_cell():
    cells = sample(3000)
    assert len({meaningless(c) for c in cells}) == 6  # the five kinds and None
    for axis, values in AXES.items():
        every = {(v["dp"], v["tp"], v["pp"]) if axis == "layout" else v for v in values}
        for accepted in (True, False):
            got = {value for c in cells for a, value, why in keys(c) if a == axis and (why is None) == accepted}
            assert got == every, (axis, accepted)


def test_the_trainer_the_planner_and_the_matrix_agree_on_a_sample_of_the_cells():
    wrong = [d for d in map(disagreement, sample(3000)) if d is not None]
    assert not wrong, "\n".join(wrong[:10])


@pytest.mark.slow
def test_the_trainer_the_planner_and_the_matrix_agree_on_every_cell():
    wrong = [d for d in map(disagreement, all_cells()) if d is not None]
    assert not wrong, "\n".join(wrong[:10])


SIZES = dict(n_layer=4, n_head=4, n_embd=16, block_size=16, batch_size=8)
EDGES = {  # a layout that breaks one rule (or several): what its problem says
    "tp not dividing the heads": (dict(tp=3), "n_head 4 is not divisible by tp 3"),
    "heads not dividing the width": (dict(n_embd=18), "n_embd 18 is not divisible by n_head 4"),
    "sp without tp": (dict(sequence_parallel=True), "--sequence-parallel needs --tp > 1"),
    "sp over a sequence tp cannot cut": (dict(tp=2, sequence_parallel=True, block_size=15),
                                         "the sequence of 15 tokens is not divisible by tp 2"),
    "cp over a sequence it cannot cut": (dict(cp=3), "the sequence of 16 tokens is not divisible by 3"),
    "zig-zag needs 2 cp chunks": (dict(cp=2, cp_algorithm="zigzag", block_size=18),
                                  "the sequence of 18 tokens is not divisible by 4"),
    "cp and sp cut the sequence twice": (dict(cp=2, tp=4, sequence_parallel=True, block_size=12, n_head=8, n_embd=32),
                                         "6 tokens per cp rank are not divisible by tp 4"),
    "Ulysses needs whole heads": (dict(cp=4, tp=2, cp_algorithm="ulysses"), "do not divide by cp 4"),
    "a cp algorithm without cp": (dict(cp_algorithm="ulysses"), "--cp-algorithm ulysses needs --cp > 1"),
    "an unknown cp algorithm": (dict(cp=2, cp_algorithm="tree"), "--cp-algorithm must be one of ring, zigzag, ulysses"),
    "a schedule without pp": (dict(schedule="gpipe"), "--schedule gpipe needs --pp > 1"),
    "an unknown schedule": (dict(schedule="zigzag"), "--schedule must be one of gpipe, 1f1b, interleaved, zb-h1, zbv"),
    "more stages than blocks": (dict(pp=4, virtual_stages=2, schedule="interleaved", micro_batches=4),
                                "pp * virtual_stages = 4 * 2 pipeline stages need at least as many blocks"),
    "ZB-V with one chunk": (dict(pp=2, schedule="zbv"), "--schedule zbv places two chunks per rank in a V"),
    "chunks without interleaving": (dict(pp=2, virtual_stages=2), "--virtual-stages 2 needs --schedule interleaved"),
    "interleaving fewer micro-batches": (dict(pp=2, schedule="interleaved", virtual_stages=2, micro_batches=1),
                                         "needs micro_batches (1) to be a multiple of pp (2)"),
    "ep without experts": (dict(dp=2, ep=2), "--ep needs experts to split: add --n-experts"),
    "ep without dp": (dict(n_experts=4, ep=2), "--ep 2 must divide --dp 1"),
    "ep not dividing the experts": (dict(n_experts=6, dp=4, ep=4, batch_size=16), "--n-experts 6 is not divisible by ep 4"),
    "tp not dividing the router": (dict(n_experts=3, tp=2), "--n-experts 3 is not divisible by tp 2"),
    "top-k above the experts": (dict(n_experts=4, top_k=5), "--top-k 5 is more than the 4 experts"),
    "no block with experts": (dict(n_experts=4, moe_every=5), "--moe-every 5 leaves none of the 4 blocks"),
    "offloaded parameters below ZeRO-3": (dict(dp=2, zero=2, offload="optimizer,params"),
                                          "--offload optimizer,params needs --zero 3, got --zero 2"),
    "an unknown offload": (dict(offload="params"), "--offload must be one of none, optimizer, optimizer,params"),
    "a ZeRO stage that does not exist": (dict(zero=5), "--zero must be in [0, 3], got 5"),
    "an unknown dtype": (dict(dtype="int8"), "--dtype must be one of"),
    "a number out of range and a layout that cannot run": (dict(ep=0, tp=3, schedule="zigzag"), "--ep must be >= 1"),
    "everything at once": (dict(tp=3, cp=3, schedule="gpipe", n_experts=4, top_k=5, zero=1, offload="optimizer,params"),
                           "n_head 4 is not divisible by tp 3"),
}


@pytest.mark.parametrize("name", list(EDGES))
def test_the_trainer_and_the_planner_refuse_an_edge_layout_in_the_same_words(name):
    changes, message = EDGES[name]
    cfg = TrainConfig(**{**SIZES, **changes})
    said = trainer(cfg)
    assert any(message in line for line in said), said
    assert planner(cfg) == said == problems(cfg, needs_of(cfg), cfg.world)


def test_every_problem_comes_at_once():
    said = trainer(TrainConfig(**{**SIZES, **EDGES["everything at once"][0]}))
    assert len(said) == 6, said  # heads, cp's cut, a schedule without pp, top-k, offload below ZeRO-3 ...
    assert sum(line.startswith("--schedule gpipe needs --pp > 1") for line in said) == 1
    mixed = trainer(TrainConfig(**{**SIZES, "lr": -1.0, "tp": 3}))
    heads = "n_head 4 is not divisible by tp 3 (each tp rank holds whole heads)"
    assert mixed == ["--lr must be >= 0, got -1.0", heads]
    numbers = trainer(TrainConfig(**{**SIZES, "ep": 0, "tp": 3, "schedule": "zigzag"}))
    assert numbers == ["--schedule must be one of gpipe, 1f1b, interleaved, zb-h1, zbv, got 'zigzag'",
                       "--ep must be >= 1, got 0"]  # names and numbers; the arithmetic waits for them
    trainer_own = trainer(TrainConfig(**{**SIZES, "tp": 3, "save_every": 2}))
    assert trainer_own == [heads, "--save-every and --resume need --ckpt-dir (where the checkpoints live)"]


def test_offloading_parameters_below_zero_3_is_refused_everywhere_saying_what_to_use():
    cfg = TrainConfig(**SIZES, dp=2, zero=2, offload="optimizer,params", offload_dir="off")
    with pytest.raises(ConfigError, match=r"use --offload optimizer, or --zero 3 to offload the parameter shards too"):
        check_config(cfg, 2)
    assert planner(cfg) == trainer(cfg)
    check_config(dataclasses.replace(cfg, zero=3), 2)
    check_config(dataclasses.replace(cfg, offload="optimizer"), 2)


def test_the_planners_own_shapes_go_through_the_same_rules():
    """Grouped-query attention and a SwiGLU width: tp divides the kv heads (or copies them) and the
    MLP's columns; the planner's problems are the spec's and its own."""
    llama = preset("llama3-8b")  # 32 heads, 8 kv heads, MLP width 14336
    for tp in (8, 16, 32):
        run = RunSpec(seq=8192, tp=tp)
        assert layout_problems(llama, run) == problems(run, planner_needs(llama, run)) == []
    run = RunSpec(seq=8192, tp=3)
    said = layout_problems(llama, run)
    assert said == problems(run, planner_needs(llama, run))
    assert said == ["n_head 32 is not divisible by tp 3 (each tp rank holds whole heads)",
                    "the 8 kv heads are not divisible by tp 3, nor tp by them (each tp rank holds whole kv heads, or a "
                    "copy of one)",
                    "the MLP width 14336 is not divisible by tp 3 (each tp rank holds 1/tp of the MLP's columns)"]
    own = layout_problems(preset("gpt2"), RunSpec(seq=2048, micro_batch_size=0, recompute="some"))
    assert own == ["--micro-batch-size must be in [1, 1e12], got 0", "--recompute must be one of none, selective, full, got 'some'",
                   "the sequence of 2048 is longer than the model's 1024 learned positions: a shorter --seq, or "
                   "--block-size 2048"]


def test_every_schedule_runs_over_nccl():
    """The pipeline posts each round of sends and receives as one group (batch_isend_irecv), so the
    interleaved and ZB-V schedules no longer deadlock on NCCL's in-order point-to-point: nothing refuses them."""
    base, needs = Layout(pp=2, virtual_stages=2, micro_batches=2, device="cuda", backend="nccl"), Needs(4, 4, 16, 16, 8)
    for schedule in ("interleaved", "zbv"):
        assert findings(dataclasses.replace(base, schedule=schedule), needs) == []
    assert problems(dataclasses.replace(base, schedule="1f1b", virtual_stages=1), needs) == []


def test_a_meaningless_problem_says_what_the_layout_lacks_in_the_matrix_words():
    spec, needs = Layout(sequence_parallel=True), Needs(n_layer=4, n_head=4, n_embd=16, seq=16, batch_size=8)
    assert lacks(spec, needs) == ["sequence parallelism splits the sequence over the tp ranks: with tp 1 there is nothing "
                           "to split"]
    assert lacks(dataclasses.replace(spec, sequence_parallel=False, tp=3), needs) == []  # refused, but it lacks nothing
