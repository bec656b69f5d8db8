"""The composition grid: every meaningful combination of layout (dp, tp, pp each 1 or 2), context
parallelism (cp 1 or 2, ring, zig-zag or Ulysses), ZeRO stage, sequence parallelism, pipeline
schedule, recompute, precision, checkpointing, experts (none, a mixture of experts on every rank,
or split over 2 dp ranks), offload (none, the optimizer shards to host memory, with ZeRO-3's
parameter shards to files) and dropout (off, or p = 0.1: every layout draws one process's masks,
minidist/nn/dropout.py) trains like one process on the full batch (minidist/train/support_matrix.py
lists the 414,720 cells; the meaningless ones name a schedule without a pipeline, sequence
parallelism without tensor parallelism, a cp algorithm without cp, expert parallelism without dp, or
offloaded parameters below ZeRO-3).

``--slow`` trains, without dropout, the 6,912 meaningful dense cells without offload (1,728 without
cp, 5,184 with cp 2), the 2,592 mixture-of-experts cells without cp and the 2,160 offloading dense
cells without cp; and the cells of pairwise covers of all 20,736 mixture-of-experts cells and of all
43,200 offloading cells that have cp, experts or dropout, and a pairwise cover of the 6,912 dense
cells with dropout (dropout against every value of every other axis). The default run trains a
sample: 13 dense cells without cp that hold every value of every axis (dropout on and off among
them), the first 5 cells (``FIRST``) of a pairwise cover of the dense cp cells (39 cells in which every
pair of values of any two axes, such as zig-zag x fp16 or Ulysses x ZeRO-3, occurs at least once; its
first 5 hold every algorithm, ZeRO stage and precision, and dropout on and off), and the first 5 of
the experts' and of the offloading cells' pairwise covers (they hold ep 1 and 2, both offloads,
every ZeRO stage and precision, dropout on and off). Six more cells (``BLOCKED_CELLS``) train on
sequences of 80 tokens, which the model's attention takes in three query blocks (the grid's 16 fit in one).

A mixture-of-experts cell's one-process reference is the same MoE GPT (4 experts in blocks 1 and 3).
In float64 each token goes to its top 2 experts. A routing decision is not continuous: where a
token's 2nd and 3rd probabilities are within a rounding of each other, two layouts that add the same
numbers in other orders may send it to different experts, and no tolerance derived from rounding
covers that. In float64 such a near-tie (within ~1e-15) does not occur in these runs; in 16 bits it
does, so the mixed-precision MoE cells route every token to all 4 experts (top-4: the gate is a
softmax, continuous), and the derived tolerances below hold for them as they are.

Each cell trains a 4-block GPT for 4 steps of SGD with momentum (linear in the gradient, so a wrong
scale shows: Adam would hide it; a sample of the float32 cells runs AdamW too), clipping at 0.5, two micro-batches per step (two virtual stages
per rank under the interleaved and zbv schedules); a checkpointing cell saves at steps 2 and 4, loses the
second, and resumes from the first. Compared per step: the loss, the gradient norm before clipping
(a missing 1/N shows there even when clipping hides it in the update), and at the end every weight.

Tolerances:
- float32 cells run in float64 and equal one process to 1e-10 relative (loss, grad norm; weights
  to 1e-10 of each tensor's largest value): the layouts add the same numbers in other orders.
- mixed-precision cells (bfloat16, float16) equal the one-process run IN THE SAME PRECISION.
  * Which steps overflow (skipped) and every loss scale: exactly equal. The found-inf flag is agreed
    over the whole world, and a float16 average divides before it sums (comm/ops.py), so a layout
    overflows where one process does.
  * Loss and gradient norm: relative 2 S u, with u the compute dtype's unit roundoff (float16 2**-11,
    bfloat16 2**-8) and S the steps: each step rounds the weights once to the compute dtype, and
    another reduction order can move each rounding by at most one unit, in either direction.
  * Master weights: per element |w - w_ref| <= 2 u / (1 - momentum) * sum_t lr_t min(norm_t, clip).
    A step changes a master by lr_t times its momentum buffer; the gradients of the two runs are
    the same sums rounded to the compute dtype in different orders, so they differ by at most 2 u
    of the largest gradient element, itself at most the clipped norm; momentum sums a step's
    difference into every later step with weights adding up to at most 1 / (1 - momentum).
"""
import dataclasses
import itertools
import random
import shutil
from functools import lru_cache

import numpy as np
import pytest

from minidist import run_local
from minidist.checkpoint import step_dir
from minidist.train.support_matrix import AXES, Cell, config_for, grid, meaningful
from minidist.train import train
from minidist.train.config import TrainConfig
from minidist.train.outputs import TIMINGS

SIZES = dict(n_layer=4, n_head=4, n_embd=16, block_size=16, batch_size=8)
TRAIN = dict(steps=4, eval_every=100, eval_iters=1, sample_tokens=0, warmup=1, lr=1e-2, grad_clip=0.5,
             optimizer="sgd", momentum=0.9, bucket_mb=0.01, loss_scale_window=2)
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
CELLS = meaningful()
DENSE_CELLS = [c for c in CELLS if c.moe == "none" and c.offload == "none"]
CP1_CELLS = [c for c in DENSE_CELLS if c.cp == 1]
MOE_CELLS = [c for c in CELLS if c.moe != "none" and c.offload == "none"]
OFFLOAD_CELLS = [c for c in CELLS if c.offload != "none"]


def fit(cfg):
    """(history rows by step, exported weights) of ``cfg`` on its dp * tp * pp * cp thread ranks."""
    histories = run_local(lambda group: train(cfg, progress=False, world=group)[1], cfg.dp * cfg.tp * cfg.pp * cfg.cp)
    assert all([r["loss"] for r in h] == [r["loss"] for r in histories[0]] for h in histories)
    return {r["step"]: r for r in histories[0]}, dict(np.load(cfg.export))


def run_dtype(dtype: str) -> str:
    return "float64" if dtype == "float32" else dtype


def experts(dtype: str, moe: bool) -> dict:
    """The mixture of experts of a cell (none: {}): 4 per MoE block, top 2 in float64, all 4 in 16
    bits (the module docstring says why)."""
    return dict(n_experts=4, moe_every=2, top_k=2 if dtype == "float32" else 4) if moe else {}


@lru_cache(maxsize=None)
def reference(dtype: str, data_dir: str, optimizer: str = "sgd", moe: bool = False, dropout: bool = False,
              block_size: int = SIZES["block_size"]):
    """One process on the full batch, in ``dtype``: the dense GPT, or with ``moe`` the MoE GPT; with
    ``dropout`` dropping as a dropout cell does (config_for: p = 0.1); on sequences of ``block_size``."""
    p = config_for(Cell(dtype=dtype, dropout=dropout)).dropout
    cfg = TrainConfig(**{**SIZES, "block_size": block_size}, **{**TRAIN, "optimizer": optimizer}, **experts(dtype, moe),
                      dtype=run_dtype(dtype), data_dir=data_dir, dropout=p,
                      export=f"{data_dir}/ref-{dtype}-{optimizer}{'-moe' * moe}{'-dropout' * dropout}-T{block_size}.npz")
    return fit(cfg)


def train_cell(cell: Cell, data_dir: str, tmp_path, optimizer: str = "sgd", block_size: int = SIZES["block_size"]):
    """Train ``cell`` on sequences of ``block_size``: rows of the steps it ran (a checkpointing cell:
    the resumed steps 2 and 3) and its final weights."""
    cfg = config_for(cell, **{**SIZES, "block_size": block_size})
    cfg = dataclasses.replace(cfg, **{**TRAIN, "optimizer": optimizer}, **experts(cell.dtype, cell.moe != "none"),
                              dtype=run_dtype(cell.dtype), data_dir=data_dir, export=str(tmp_path / "w.npz"),
                              offload_dir=str(tmp_path / "offload") if cfg.offload_dir else None)
    if not cell.checkpoint:
        return fit(cfg)
    cfg = dataclasses.replace(cfg, ckpt_dir=str(tmp_path / "ckpt"))
    fit(cfg)
    shutil.rmtree(step_dir(cfg.ckpt_dir, 4))  # as if the job died before its last save
    return fit(dataclasses.replace(cfg, resume=True))


def assert_like_one_process(cell: Cell, rows, weights, ref_rows, ref_weights):
    if cell.checkpoint:
        assert sorted(rows) == [2, 3], f"{cell}: resumed at {sorted(rows)}"
    assert weights.keys() == ref_weights.keys()
    if cell.dtype == "float32":
        for step, row in rows.items():
            for key in ("loss", "grad_norm"):
                ref = ref_rows[step][key]
                assert abs(row[key] - ref) <= 1e-10 * abs(ref), f"{cell} step {step} {key}: {row[key]} vs {ref}"
        for name, ref in ref_weights.items():
            assert np.abs(weights[name] - ref).max() <= 1e-10 * np.abs(ref).max(), f"{cell}: {name}"
        return
    u = UNIT_ROUNDOFF[cell.dtype]
    rtol = 2 * TRAIN["steps"] * u
    for step, row in rows.items():
        ref = ref_rows[step]
        assert (row["skipped"], row["loss_scale"]) == (ref["skipped"], ref["loss_scale"]), f"{cell} step {step}"
        assert abs(row["loss"] - ref["loss"]) <= rtol * abs(ref["loss"]), f"{cell} step {step} loss"
        if not ref["skipped"]:
            assert abs(row["grad_norm"] - ref["grad_norm"]) <= rtol * ref["grad_norm"], f"{cell} step {step} norm"
    steps = [r for r in ref_rows.values() if not r["skipped"]]
    bound = 2 * u / (1 - TRAIN["momentum"]) * sum(r["lr"] * min(r["grad_norm"], TRAIN["grad_clip"]) for r in steps)
    for name, ref in ref_weights.items():
        assert np.abs(weights[name] - ref).max() <= bound, f"{cell}: {name} {np.abs(weights[name] - ref).max()} > {bound}"


def check_cell(cell, data_dir, tmp_path, block_size: int = SIZES["block_size"]):
    rows, weights = train_cell(cell, data_dir, tmp_path, block_size=block_size)
    ref_rows, ref_weights = reference(cell.dtype, data_dir, moe=cell.moe != "none", dropout=cell.dropout,
                                      block_size=block_size)
    assert_like_one_process(cell, rows, weights, ref_rows, ref_weights)


def axis_values(c: Cell) -> list:
    """(axis, value) of every axis of ``c``, the layout as (dp, tp, pp)."""
    return [("layout", (c.dp, c.tp, c.pp))] + [(a, getattr(c, a)) for a in AXES if a != "layout"]


def sample(n: int, seed: int = 14) -> list:
    """``n`` cells without cp, every value of every axis among them: a seeded shuffle, the cells
    adding an uncovered (axis, value) first."""
    cells = CP1_CELLS[:]
    random.Random(seed).shuffle(cells)
    values = lambda c: set(axis_values(c))  # noqa: E731
    covered, chosen = set(), []
    for c in cells:
        if values(c) - covered:
            chosen.append(c)
            covered |= values(c)
    return (chosen + [c for c in cells if c not in chosen])[:n]


def pairwise_cover(cells, seed: int = 17) -> list:
    """Cells of ``cells`` in which every pair of (axis, value)s that any cell of ``cells`` has occurs
    at least once: greedily, the cell covering most uncovered pairs first (a seeded order breaks ties:
    the first such cell). A boolean matrix has a row per cell and a column per pair of values, so
    what every cell would cover is one count over the uncovered columns."""
    cells = cells[:]
    random.Random(seed).shuffle(cells)
    values = [axis_values(c) for c in cells]
    indices = [{} for _ in values[0]]  # per axis: value -> its number
    codes = np.array([[index.setdefault(v, len(index)) for index, v in zip(indices, row)] for row in values])
    sizes = codes.max(axis=0) + 1  # (axes,)
    pairs = list(itertools.combinations(range(codes.shape[1]), 2))
    offsets = np.cumsum([0] + [sizes[i] * sizes[j] for i, j in pairs])
    has = np.zeros((len(cells), offsets[-1]), bool)  # (cells, pairs of values)
    for (i, j), offset in zip(pairs, offsets):
        has[np.arange(len(cells)), offset + codes[:, i] * sizes[j] + codes[:, j]] = True
    uncovered, chosen = np.flatnonzero(has.any(axis=0)), []  # the pairs some cell has
    while uncovered.size:
        best = int(np.argmax(np.count_nonzero(has[:, uncovered], axis=1)))  # the first of the most
        chosen.append(cells[best])
        uncovered = uncovered[~has[best, uncovered]]
    return chosen


CP_CELLS = pairwise_cover([c for c in DENSE_CELLS if c.cp == 2])
FIRST = 5  # the cells of each cover the default run trains: the fewest that hold every value asserted below
SAMPLE = 13  # the dense cells without cp it trains: the first 13 of sample() hold every value of every axis
MOE_COVER = pairwise_cover(MOE_CELLS)
DROPOUT_COVER = pairwise_cover([c for c in DENSE_CELLS if c.dropout])  # --slow: dropout x every other axis
OFFLOAD_COVER = pairwise_cover(OFFLOAD_CELLS)


def test_the_grid_has_every_cell_and_the_samples_every_axis_value():
    assert len(grid()) == 414720 and len(CP1_CELLS) == 3456 and len(DENSE_CELLS) == 3456 + 10368
    assert len(MOE_CELLS) == 2 * (6912 + 3456)  # ep 2 needs dp 2
    assert len(OFFLOAD_CELLS) == 2 * (17280 + 17280 // 4)  # parameters move under ZeRO-3 only
    # every meaningful cell is accepted (refusals are debts): tests/test_readme.py checks the README's matrix,
    # whose counts line says how many are refused (0), against support_matrix.refusals()
    covered = {v for c in sample(SAMPLE) for v in axis_values(c)}
    assert len(covered) == 8 + 1 + 1 + 4 + 2 + 5 + 2 + 3 + 2 + 1 + 1 + 2  # (cp 1: one cp value, one algorithm; dense; no offload)
    first = {v for c in OFFLOAD_COVER[:FIRST] for v in axis_values(c)}
    assert {v for v in first if v[0] in ("offload", "zero", "dtype")} == {
        ("offload", "optimizer"), ("offload", "optimizer,params")} | {("zero", z) for z in AXES["zero"]} | {
        ("dtype", d) for d in AXES["dtype"]}
    first = {v for c in MOE_COVER[:FIRST] for v in axis_values(c)}
    assert {v for v in first if v[0] in ("moe", "zero", "dtype")} == {("moe", "ep1"), ("moe", "ep2")} | {
        ("zero", z) for z in AXES["zero"]} | {("dtype", d) for d in AXES["dtype"]}
    first = {v for c in CP_CELLS[:FIRST] for v in axis_values(c)}
    assert {v for v in first if v[0] in ("cp_algorithm", "zero", "dtype")} == {
        ("cp_algorithm", a) for a in AXES["cp_algorithm"]} | {("zero", z) for z in AXES["zero"]} | {
        ("dtype", d) for d in AXES["dtype"]}  # the default run trains every algorithm, ZeRO stage and precision
    for cover in (CP_CELLS, MOE_COVER, OFFLOAD_COVER):  # dropout on and off in each default sample
        assert {c.dropout for c in cover[:FIRST]} == {False, True}
    assert len(CP_CELLS) == 39


@pytest.mark.parametrize("cell", sample(SAMPLE), ids=str)
def test_a_sample_of_the_grid_trains_like_one_process(cell, data_dir, tmp_path):
    check_cell(cell, data_dir, tmp_path)


ADAMW_CELLS = [Cell(dp=dp, tp=tp, pp=pp, zero=zero, sequence_parallel=sp, schedule=schedule, recompute=recompute,
                    checkpoint=ckpt) for dp, tp, pp, zero, sp, schedule, recompute, ckpt in [
                   (2, 2, 1, 1, True, "1f1b", "none", False), (2, 1, 2, 2, False, "1f1b", "none", True),
                   (2, 2, 2, 3, True, "interleaved", "none", True), (2, 1, 1, 3, False, "1f1b", "full", False),
                   (1, 2, 2, 0, False, "gpipe", "full", False), (2, 2, 2, 2, True, "1f1b", "full", False)]]


@pytest.mark.parametrize("cell", ADAMW_CELLS, ids=str)
def test_a_sample_of_the_float32_cells_trains_like_one_process_with_adamw_too(cell, data_dir, tmp_path):
    # AdamW's sharded moments and its per-element division, through the same layouts (in float64 the
    # layouts still agree to 1e-10; in 16 bits Adam's normalised step turns rounding noise near zero
    # gradients into whole steps, which is why the grid's tolerances are derived for SGD)
    rows, weights = train_cell(cell, data_dir, tmp_path, optimizer="adamw")
    assert_like_one_process(cell, rows, weights, *reference(cell.dtype, data_dir, "adamw", dropout=cell.dropout))


QUERY_BLOCKS_T = 80  # a sequence the model's attention takes in three query blocks: 32, 32, 16 (autograd/attention.py)
BLOCKED_CELLS = [Cell(dp=2, tp=2, sequence_parallel=True, zero=1, dropout=True), Cell(cp=2, dropout=True),
                 Cell(cp=2, cp_algorithm="zigzag", zero=2), Cell(cp=2, cp_algorithm="ulysses", tp=2, dropout=True),
                 Cell(pp=2, schedule="zbv", recompute="full", dropout=True), Cell(dp=2, zero=3, dtype="bfloat16")]


@pytest.mark.parametrize("cell", BLOCKED_CELLS, ids=str)
def test_cells_whose_sequences_take_three_query_blocks_train_like_one_process(cell, data_dir, tmp_path):
    """The grid's sequences (16) fit in one query block; at 80 tokens one process, tensor and
    sequence parallelism, Ulysses, the pipeline's split backward and recomputation run the blocks
    (ring and zig-zag attention their own chunks against them), with dropout's masks per block."""
    check_cell(cell, data_dir, tmp_path, block_size=QUERY_BLOCKS_T)


@pytest.mark.parametrize("cell", CP_CELLS[:FIRST], ids=str)
def test_a_sample_of_the_context_parallel_cells_trains_like_one_process(cell, data_dir, tmp_path):
    check_cell(cell, data_dir, tmp_path)


@pytest.mark.parametrize("cell", MOE_COVER[:FIRST], ids=str)
def test_a_sample_of_the_mixture_of_experts_cells_trains_like_one_process(cell, data_dir, tmp_path):
    check_cell(cell, data_dir, tmp_path)


@pytest.mark.parametrize("cell", OFFLOAD_COVER[:FIRST], ids=str)
def test_a_sample_of_the_offloading_cells_trains_like_one_process(cell, data_dir, tmp_path):
    check_cell(cell, data_dir, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("cell", [c for c in DENSE_CELLS if not c.dropout] + DROPOUT_COVER, ids=str)
def test_every_cell_of_the_grid_trains_like_one_process(cell, data_dir, tmp_path):
    check_cell(cell, data_dir, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("cell", [c for c in MOE_CELLS if c.cp == 1 and not c.dropout] +
                         [c for c in MOE_COVER if c.cp == 2 or c.dropout], ids=str)
def test_the_mixture_of_experts_cells_train_like_one_process(cell, data_dir, tmp_path):
    check_cell(cell, data_dir, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("cell", [c for c in OFFLOAD_CELLS if c.cp == 1 and c.moe == "none" and not c.dropout] +
                         [c for c in OFFLOAD_COVER if c.cp == 2 or c.moe != "none" or c.dropout], ids=str)
def test_the_offloading_cells_train_like_one_process(cell, data_dir, tmp_path):
    check_cell(cell, data_dir, tmp_path)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_mixed_precision_layout_run_twice_is_bitwise_identical(dtype, data_dir, tmp_path):
    cell = Cell(dp=2, tp=2, pp=2, cp=1, cp_algorithm="ring", zero=3, sequence_parallel=True, schedule="interleaved",
                dtype=dtype)
    (rows_a, weights_a), (rows_b, weights_b) = (train_cell(cell, data_dir, tmp_path / name) for name in "ab")
    assert rows_a.keys() == rows_b.keys()
    for step in rows_a:
        assert {k: v for k, v in rows_a[step].items() if k not in TIMINGS} == \
            {k: v for k, v in rows_b[step].items() if k not in TIMINGS}
    for name in weights_a:
        assert np.array_equal(weights_a[name], weights_b[name]), name
