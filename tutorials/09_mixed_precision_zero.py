"""Lesson 9: mixed precision with ZeRO, the paper's way. What each rank holds, in bytes, beside the
paper's table; one overflow shown, then the skipped step and the lowered scale.

    mpiexec -n 4 python tutorials/09_mixed_precision_zero.py     (or alone: 4 threads)
    python tutorials/09_mixed_precision_zero.py --png amp.png   (also draw the loss scale per step)

Read lesson 5 (ZeRO) first. In mixed precision the model computes in float16 and the optimizer
keeps float32 copies. Per parameter (Psi parameters in all), the ZeRO paper counts

    parameters  float16            2 bytes    P = 2 Psi
    gradients   float16            2 bytes    G = 2 Psi      (reduced over dp in float16: half the wire)
    optimizer   float32 master     4 bytes  \\
                float32 exp_avg    4 bytes   > O = K Psi, K = 12 for AdamW (8 for SGD with momentum)
                float32 exp_avg_sq 4 bytes  /

and ZeRO shards them over the N dp ranks (rank 0 holds, after backward):

    stage   parameters  gradients  masters + moments   total            N = 4, Psi = 30,080
    0       2 Psi       2 Psi      12 Psi              16 Psi           481,280 bytes
    1       2 Psi       2 Psi      12 Psi / N           7 Psi           210,560
    2       2 Psi       2 Psi / N  12 Psi / N           5.5 Psi         165,440
    3       2 Psi / N   2 Psi / N  12 Psi / N           4 Psi           120,320

The float32 masters are optimizer state: sharded from stage 1 on, like the moments. Each rank
unscales ITS gradient shard into float32, updates ITS master shard, and casts it back to float16
(stages 1, 2 then all-gather float16 parameters; stage 3 keeps the shard until its next use).

The loss scale: backward starts from ``scale / m`` (2**16 at first) so that small float16
gradients do not flush to zero. Part 2 measures it on this run's step-0 gradients (computed in
float32, then cast as a float16 backward would hold them): unscaled, some flush to 0 (below
2**-25) and many more are subnormal (below 2**-14: fewer significant bits); times 2**16, almost
none. Too large a scale overflows to inf on SOME rank; then every rank must skip the step
together, or the replicas' shards would drift apart. So the gradient pipeline's found-inf all-reduces one flag
over the world (8 bytes), and on every rank: no update, scale halved. Part 3 makes rank 3's
gradients overflow at step 2 and shows it. The scale also grows back: after ``growth_interval``
clean steps in a row it doubles (2000 by default, the trainer's --loss-scale-window); part 3b
runs with 2 and shows it doubling, halving at the overflow, doubling again.

Part 4 checks the weights against one process in float16 (MixedPrecision + AdamW on the full batch,
the same step skipped). Not bitwise: the 4 ranks compute gradients on 2 rows each and average them
in float16 in ring order, one process on 8 rows at once, so each gradient element differs by a few
float16 roundings (relative 2**-11 each). Adam divides by sqrt(v), so an update is about lr in size
whatever the gradient's (exactly +-lr at step 1): an element whose gradient is far from 0 moves the
same way in both runs, one whose gradient is near 0 (or flushed to 0 in one run only) may move ~lr
one way in one run and ~lr the other way in the other. The tolerance per element after S applied
steps is therefore 2 S lr (the float16 rounding of the weights, 2**-11 |w| ~ 1e-5, is far below);
and the TYPICAL element must differ by far less than one update: median |dw| < 2**-6 S lr. Measured:
max ~2e-3 against 2 S lr = 1e-2, median ~1e-3 S lr. Stages 1, 2 and 3 run the same float16
reduce-scatters in the same order: against EACH OTHER they are bitwise equal, asserted exactly
(stage 0 all-reduces, another summation order: it gets the tolerance).

Picture (``--png PATH``): left, why a scale: two pairs of bars, the share of the nonzero step-0
gradients float16 would flush to 0 (red) or keep subnormal (orange), unscaled (about 0.2% and 14.5%)
and x 65536 (about 0.02% and 0.2%), each bar labelled with the printed share. Right, on top, part
3's run rank by rank and step by step: red where a rank's own gradient shard held an inf, grey where
its shard was finite and it skipped all the same, green where it updated. Below, the loss scale
each step used, as a staircase on a log axis: part 3's run (65536, a red X at step 2 labelled
"step 2 skipped: 65536 -> 32768", then 32768 to the end) above part 3b's (65536, doubled to 131072
after 2 clean steps, a red X at step 2 "step 2 skipped: 131072 -> 65536", doubled again at step 5).
(Lesson 5 draws the bytes per stage.)
"""
import argparse

import numpy as np

import minidist
from minidist.amp import DynamicLossScaler, MixedPrecision
from minidist.data import get_batch, inputs_and_targets
from minidist.launch_check import check_launch
from minidist.model import GPT, GPTConfig
from minidist.optim import AdamW
from minidist.inspect.accounting import unique_nbytes
from minidist.parallel.compose.gradients import WholeGradients, apply_gradients
from minidist.parallel.compose.loss_scaling import backward_micro_batch
from minidist.parallel.zero.full_state import full_parameters
from minidist.parallel.zero.optimizer import ZeroOptimizer
from minidist.inspect import zero_memory

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_embeddings=False)
BATCH, STEPS, LR, MAX_NORM = 8, 6, 1e-3, 1.0
OVERFLOW_STEP, OVERFLOW_RANK, BLOWUP = 2, 3, 8.0  # rank 3 seeds step 2's backward 8 x too high:
# scale 2**16 x 8 = 2**19 pushes its largest float16 gradients past 65504 (inf), not all of them
INIT_SCALE = 2.0 ** 16  # DynamicLossScaler's first scale
SMALLEST_NORMAL, SMALLEST_SUBNORMAL = 2.0 ** -14, 2.0 ** -24  # float16: below 2**-25 rounds to 0
GROWTH = 2  # part 3b: growth_interval, the clean steps in a row after which the scale doubles
# (the trainer's --loss-scale-window; PyTorch's default and minidist's: 2000)
TOKENS = np.random.default_rng(0).integers(0, 64, size=4000)


def batch(step):
    return inputs_and_targets(get_batch(TOKENS, step, BATCH, CONFIG.block_size))  # (B, T), (B, T)


def one_process():
    """The reference: one process, float16 model, float32 masters, the same overflow at the same step."""
    model = GPT(CONFIG, seed=0, dtype="float16")
    amp = MixedPrecision(model, "float16", DynamicLossScaler())
    opt = AdamW(amp.master_parameters(), lr=LR, weight_decay=0.1)
    for step in range(STEPS):
        for p in model.parameters():
            p.grad = None
        blowup = 2.0 ** 16 if step == OVERFLOW_STEP else 1.0  # sure to overflow: skip this step too
        with np.errstate(over="ignore", invalid="ignore"):
            backward_micro_batch(model(*batch(step))[1], 1, amp.scaler.scale * blowup)
        skipped = apply_gradients(WholeGradients(model, opt, amp=amp), LR, MAX_NORM, amp.scaler) is None
        assert skipped == (step == OVERFLOW_STEP)
    return {name: m.data for name, m in amp.master_parameters()}


def underflow(group):
    """Part 2: what float16 would do to this rank's step-0 gradients without the scale and with it.
    The gradient is computed in float32 (the same model and rows); returns, summed over the world:
    [nonzero elements, unscaled: flushed to 0, subnormal; scaled: flushed, subnormal; max |g| x scale]."""
    model = GPT(CONFIG, seed=0, dtype="float32")
    idx, targets = batch(0)
    rows = np.array_split(np.arange(BATCH), group.size)[group.rank]
    backward_micro_batch(model(idx[rows], targets[rows])[1], 1, 1.0)  # unscaled, float32
    g = np.concatenate([p.grad.ravel() for p in model.parameters()])  # (Psi,) float32
    g = g[g != 0]  # exact zeros (embedding rows of tokens this rank never saw) are no loss
    counts = [g.size]
    for scale in (1.0, INIT_SCALE):
        h = np.abs((g * np.float32(scale)).astype(np.float16))  # what a float16 backward could hold
        assert np.isfinite(h).all(), "the scale itself overflowed at step 0"
        counts += [np.count_nonzero(h == 0), np.count_nonzero((h > 0) & (h < SMALLEST_NORMAL))]
    worst = np.array([np.abs(g).max() * INIT_SCALE])
    group.all_reduce(worst, op="max")
    return group.all_reduce(np.array(counts, dtype=np.float64)), float(worst[0])


def held_bytes(zero):
    """What this rank holds now, split as the paper's table: float16 parameters and gradients,
    float32 masters and moments (asserted to add up to the optimizer's own measurement)."""
    held = zero_memory.model_state_bytes(zero)
    masters = unique_nbytes([s.param.data for s in zero.shards])
    moments = unique_nbytes([a for s in zero.shards for a in s.state.values()])
    assert masters + moments == held["optimizer"]
    return {"parameters": held["parameters"], "gradients": held["gradients"], "masters": masters,
            "moments": moments}


def train(group, stage, growth_interval=2000):
    """STEPS steps of AdamW under ZeRO ``stage`` in float16 (with the default growth_interval the
    scale never grows here: only OVERFLOW_STEP may be skipped, asserted); returns (bytes held at
    step 0, the paper's formula, the float32 masters at the end (gathered), every rank's view of
    every step: rows (step, inf in own shard, skipped, scale before, after, skipped steps, loss),
    step by step, rank by rank, and the scale per step: rows (before, after, skipped, clean steps))."""
    model = GPT(CONFIG, seed=0, dtype="float16")  # the compute dtype: parameters and gradients float16
    scaler = DynamicLossScaler(group=group, growth_interval=growth_interval)  # the world: all skip together
    zero = ZeroOptimizer(model, group, stage, "adamw", lr=LR, weight_decay=0.1,
                         mixed_precision="float16", scaler=scaler)
    rows = np.array_split(np.arange(BATCH), group.size)[group.rank]  # this rank's rows
    held, report, scales = None, [], []
    for step in range(STEPS):
        idx, targets = batch(step)
        zero.zero_grad()
        scale = scaler.scale
        blowup = BLOWUP if (step, group.rank) == (OVERFLOW_STEP, OVERFLOW_RANK) else 1.0
        _, loss = model(idx[rows], targets[rows])  # loss float32, (B/N, T) rows
        with np.errstate(over="ignore", invalid="ignore"):  # the overflow below is on purpose
            backward_micro_batch(loss, 1, scale * blowup)  # seed: the scale (x 8 on the bad rank, once)
        zero.reduce()  # float16 reduce-scatter (stages 2, 3: already during backward)
        inf_here = any(not np.isfinite(s.grad).all() for s in zero.shards)  # MY shard only
        if held is None and not inf_here:
            held = held_bytes(zero)  # after backward + reduction: everything at its largest
        # the rest of the gradient pipeline: found-inf is one flag over the world (if set: the scale
        # is halved and nothing is updated, None), then clip, update, all-gather
        skipped = apply_gradients(zero, LR, MAX_NORM, scaler) is None
        if growth_interval > STEPS:
            assert skipped == (step == OVERFLOW_STEP), f"rank {group.rank}: step {step} skipped={skipped}"
        scales.append((scale, scaler.scale, skipped, scaler.clean_steps))
        row = np.array([step, inf_here, skipped, scale, scaler.scale, scaler.skipped_steps, loss.item()])
        report.append(group.all_gather(row[None, :]))  # (N, 7): every rank's view of this step
    with full_parameters(zero, masters=True):
        masters = {name: p.data.copy() for name, p in model.named_parameters()}  # float32, full
    return held, zero_memory.formula(zero), masters, np.concatenate(report), np.array(scales)


def lesson(group, png=None):
    n = group.size
    reference = one_process()
    psi = sum(v.size for v in reference.values())
    results = {}
    for stage in (0, 1, 2, 3):
        results[stage] = train(group, stage)
    counts, worst = underflow(group)
    growing = train(group, 3, growth_interval=GROWTH)[4]  # (STEPS, 4): this rank's scale per step

    # 1. bytes: measured from the live arrays, against the paper's 2 Psi + 2 Psi + 12 Psi per stage
    lines = []
    for stage, (held, formula, *_) in results.items():
        paper = {"parameters": 2 * psi, "gradients": 2 * psi, "masters": 4 * psi, "moments": 8 * psi}
        sharded = {"parameters": stage >= 3, "gradients": stage >= 2, "masters": stage >= 1, "moments": stage >= 1}
        paper = {k: v // n if sharded[k] else v for k, v in paper.items()}
        assert held == paper, f"stage {stage}: rank {group.rank} holds {held}, the paper says {paper}"
        assert sum(held.values()) == sum(formula.values()), f"stage {stage}: zero_memory.formula(zero) disagrees"
        lines.append(f"{stage:>5} " + "".join(f"{held[k]:>11,}" for k in held)
                     + f"{sum(held.values()):>11,}{sum(paper.values()):>11,}   = {sum(held.values()) / psi:g} Psi")

    # 2. underflow: unscaled, float16 would flush some gradients to 0 and keep many more as subnormals
    nonzero, flushed, subnormal, flushed_scaled, subnormal_scaled = counts
    assert flushed_scaled < flushed and subnormal_scaled < subnormal, f"the scale saved nothing: {counts}"
    assert worst < 65504, f"max |g| x {INIT_SCALE:.0f} = {worst:.0f} overflows float16 at step 0"

    # 3b. the scale grows back: x 2 after GROWTH clean steps in a row, / 2 at the overflow, the same on every rank
    assert (group.all_gather(growing[None, :]) == growing).all(), "ranks disagree on the scale"
    scale, clean = INIT_SCALE, 0  # the state machine, counted here independently of the scaler
    for step, (before, after, skipped, _) in enumerate(growing):
        assert before == scale, f"step {step}: scale {before}, expected {scale}"
        clean = 0 if skipped else clean + 1
        if skipped:
            scale /= 2
        elif clean == GROWTH:
            scale, clean = scale * 2, 0
        assert after == scale, f"step {step}: scale {before} -> {after}, expected {scale}"
    assert growing[OVERFLOW_STEP, 2] and (growing[:, 1] > growing[:, 0]).any(), "no overflow, or no growth"

    # 4. against one process in float16, and the stages against each other
    for stage in (2, 3):
        for k, v in results[1][2].items():
            assert np.array_equal(results[stage][2][k], v), f"stage {stage} differs from stage 1 in {k}"
    applied = STEPS - 1
    bound, check = 2 * applied * LR, []
    for stage in (0, 1):  # 2 and 3 equal 1 bitwise; stage 0 all-reduces instead (another summation order)
        diffs = np.concatenate([np.abs(results[stage][2][k] - v).ravel() for k, v in reference.items()])  # (Psi,)
        median = float(np.median(diffs)) / (applied * LR)
        assert diffs.max() <= bound, f"stage {stage}: max |dw| {diffs.max():.2e} above 2 S lr = {bound:.1e}"
        assert median < 2.0 ** -6, f"stage {stage}: median |dw| / (S lr) = {median:.1e}: too far from one process"
        check.append(f"  stage {stage}{'-3' if stage else '  '}: max |dw| = {diffs.max():.2e} <= 2 S lr = {bound:.1e};"
                     f"  median |dw| / (S lr) = {median:.1e} < 2**-6")

    if group.rank == 0:
        print(f"\n1. N = {n} ranks, float16 + AdamW, Psi = {psi:,} parameters; bytes rank 0 holds after backward:")
        print(f"{'stage':>5} {'params f16':>10} {'grads f16':>10} {'master f32':>10} {'moments f32':>11}"
              f"{'total':>11}{'paper':>11}")
        print("\n".join(lines))
        print("  paper: 2 Psi + 2 Psi + 12 Psi = 16 Psi; stage 1 shards the 12, stage 2 also the grads, "
              "stage 3 all: measured = paper to the byte")
        print(f"\n2. Why a loss scale: float16's smallest subnormal is 2**-24 ({SMALLEST_SUBNORMAL:.1e}; below "
              f"half of it a value rounds to 0),\n   its smallest normal 2**-14 ({SMALLEST_NORMAL:.1e}; "
              "below it fewer than 11 "
              "significant bits). The step-0 gradients,\n   computed in float32 on each rank's rows, and what float16 "
              f"would hold ({n} ranks x {psi:,} elements, {nonzero:,.0f} nonzero):")
        print(f"  unscaled       flushed to 0 {flushed:>6,.0f} ({100 * flushed / nonzero:5.2f}%)   subnormal "
              f"{subnormal:>6,.0f} ({100 * subnormal / nonzero:5.2f}%)")
        print(f"  x {INIT_SCALE:<12.0f} flushed to 0 {flushed_scaled:>6,.0f} ({100 * flushed_scaled / nonzero:5.2f}%)"
              f"   subnormal {subnormal_scaled:>6,.0f} ({100 * subnormal_scaled / nonzero:5.2f}%)")
        print(f"  and the largest |g| x {INIT_SCALE:.0f} = {worst:,.0f} < 65504: room for {65504 / worst:.1f}x more, "
              f"so a seed {BLOWUP:g}x too high overflows (part 3)")
        print(f"\n3. One overflow (ZeRO-3): rank {OVERFLOW_RANK} seeds step {OVERFLOW_STEP}'s backward with "
              f"{BLOWUP:g} x the scale; every rank's own view, gathered:")
        for i, (s, inf, skip, before, after, n_skipped, lss) in enumerate(results[3][3]):
            if s not in (OVERFLOW_STEP, OVERFLOW_STEP + 1):
                continue
            what = (f"SKIPPED, scale {before:.0f} -> {after:.0f}, skipped steps {n_skipped:.0f}" if skip
                    else f"updated, scale {before:.0f}")
            print(f"  step {s:.0f} rank {i % n}: inf in own gradient shard: {'yes' if inf else 'no ':3}  "
                  f"{what}   loss {lss:.4f}")
        print(f"  the flag is agreed over the world (one 8-byte all-reduce): ranks whose shard is finite skip too;"
              f"\n  training went on at scale {results[3][3][-1, 4]:.0f}: {STEPS - 1} of {STEPS} steps applied")
        seen = results[3][3].reshape(STEPS, n, 7)  # (step, rank, field)
        assert (seen[:, :, 2] == seen[:, :1, 2]).all() and seen[OVERFLOW_STEP, :, 1].any(), "ranks disagreed"
        assert not seen[OVERFLOW_STEP, :, 1].all(), "every rank saw inf: part 3 shows no rank skipping for another"
        print(f"\n3b. The scale grows back: the same run with growth_interval = {GROWTH} (the trainer's "
              "--loss-scale-window; default 2000):")
        for step, (before, after, skipped, clean) in enumerate(growing):
            what = ("overflow: skipped, halved" if skipped else f"clean, {clean:.0f} in a row" if after == before
                    else f"clean, {GROWTH} in a row: doubled")
            print(f"  step {step}: scale {before:>6.0f} -> {after:>6.0f}   {what}")
        print(f"  after {GROWTH} clean steps in a row the scaler tries twice the scale; an overflow halves it "
              "(the same on every rank)")
        print(f"\n4. Against one process in float16 (same overflow, same skipped step), after {applied} applied steps:")
        print("\n".join(check))
        print("  stages 1, 2, 3: bitwise equal masters (the same float16 reduce-scatters in the same order)")
        if png:
            draw(png, n, counts, results[3][4], growing, seen)
        print("\nTry:")
        print("  1. BLOWUP = 2.0 ** 16. Expect 'inf in own gradient shard: yes' on all 4 ranks at step 2 (rank 3's "
              "inf\n     reaches every shard through the reduce-scatter), the same skip, 65536 -> 32768, and part 4 "
              "unchanged\n     (max |dw| 2.04e-03 and 1.77e-03).")
        print("  2. GROWTH = 1. Expect in 3b the scale doubled after every clean step, 65536 -> 131072 -> 262144, "
              "halved at\n     step 2 (rank 3's overflow) and again at step 4, where 262144 overflows on its own "
              "(part 2: 28,122 x 4\n     > 65504): the scaler settles just below float16's ceiling, 131072 <-> 262144.")
        print("Mixed-precision ZeRO holds what the paper says, skips an overflow on every rank, "
              "and trains like one process in float16. All checks passed.")


def draw(path, n, counts, scales, growing, seen):
    """Left, why a loss scale: the share of part 2's nonzero gradients float16 would flush to 0 or
    keep subnormal, unscaled and scaled. Right, top: part 3's run rank by rank and step by step
    (``seen``: (step, rank, field) as gathered), whether its own gradient shard held an inf and
    whether it updated or skipped; below, the loss scale each step's backward was seeded with, in
    part 3's run and in 3b's (``scales``, ``growing``: rows (before, after, skipped, clean)), the
    skipped steps marked; every number as the lesson prints it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle
    nonzero, *flushes = counts  # unscaled: flushed, subnormal; scaled: flushed, subnormal
    fig = plt.figure(figsize=(13, 7.5))
    grid = fig.add_gridspec(3, 2, width_ratios=[1, 1.9], height_ratios=[1.25, 1, 1])
    why = fig.add_subplot(grid[:, 0])
    x = np.arange(2)
    for k, (what, colour) in enumerate((("flushed to 0", "#d7301f"), ("subnormal (fewer bits)", "#fdae6b"))):
        shares = [100 * flushes[k] / nonzero, 100 * flushes[2 + k] / nonzero]
        bars = why.bar(x + (k - 0.5) * 0.38, shares, 0.38, color=colour, label=what)
        why.bar_label(bars, [f"{v:.2f}%" for v in shares], fontsize=9)
    why.set_xticks(x, ["unscaled", f"x {INIT_SCALE:.0f}"])
    why.set_ylabel(f"% of the {nonzero:,.0f} nonzero step-0 gradients", fontsize=9)
    why.set_title("part 2, why a scale: float16 gradients", fontsize=10, loc="left")
    why.set_ylim(0, 100 * max(flushes) / nonzero * 1.35)  # room above the bars for the legend
    why.legend(fontsize=9, frameon=False, loc="upper right")
    steps = np.arange(STEPS + 1)
    ranks = fig.add_subplot(grid[0, 1])
    states = {"inf": ("#d7301f", "inf in its own shard: skipped"),
              "skipped": ("#bdbdbd", "its shard finite: skipped all the same"),
              "updated": ("#a1d99b", "updated")}
    for step in range(STEPS):
        for r in range(n):
            inf, skipped = seen[step, r, 1], seen[step, r, 2]
            state = "inf" if inf else "skipped" if skipped else "updated"
            ranks.add_patch(Rectangle((step - 0.45, r - 0.42), 0.9, 0.84, color=states[state][0]))
            ranks.text(step, r, {"inf": "inf: skip", "skipped": "skip", "updated": "update"}[state], fontsize=8,
                       ha="center", va="center", color="white" if inf else "black")
    saw = [r for r in range(n) if seen[OVERFLOW_STEP, r, 1]]
    ranks.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=8)
    ranks.set_ylim(n - 0.5, -0.5)
    ranks.set_xticks(steps, [f"step {s}" for s in range(STEPS)] + ["after"], fontsize=8)
    ranks.set_title(f"part 3, each rank's own view: at step {OVERFLOW_STEP} rank{'s' * (len(saw) > 1)} "
                    f"{' and '.join(map(str, saw))} hold{'s' * (len(saw) == 1)} an inf, all {n} skip (one flag over "
                    "the world)", fontsize=9, loc="left")
    ranks.legend(handles=[Patch(color=c, label=w) for c, w in states.values()], fontsize=8, loc="upper left",
                 bbox_to_anchor=(1.01, 1.0), frameon=False)
    runs = ((scales, "part 3: growth_interval 2000 (the default)", "#4c72b0"),
            (growing, f"part 3b: growth_interval {GROWTH}", "#55a868"))
    for row, (rows, title, colour) in enumerate(runs):
        ax = fig.add_subplot(grid[row + 1, 1], sharex=ranks)
        used = np.append(rows[:, 0], rows[-1, 1])  # the scale each step's backward used, then the next one
        ax.plot(steps, used, drawstyle="steps-post", color=colour, marker="o", label="the scale a step used")
        skipped = np.flatnonzero(rows[:, 2])
        ax.plot(skipped, rows[skipped, 0], marker="X", markersize=13, color="#d7301f", linestyle="",
                label="skipped step: no rank updated,\nthe scale halved")
        for s in skipped:
            ax.annotate(f"step {s} skipped: {rows[s, 0]:.0f} -> {rows[s, 1]:.0f}", (s, rows[s, 0]), xytext=(0, 9),
                        textcoords="offset points", fontsize=8, color="#d7301f", ha="center", va="bottom")
        ax.set_yscale("log", base=2)
        levels = sorted(set(rows[:, :2].ravel()))
        ax.set_yticks(levels, [f"{v:.0f}" for v in levels], fontsize=8)
        ax.minorticks_off()
        ax.set_ylim(min(levels) / 1.6, max(levels) * 2.2)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_ylabel("loss scale", fontsize=9)
        ax.set_title(title, fontsize=9, loc="left")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ranks.set_xlim(-0.5, STEPS + 0.3)
    fig.suptitle(f"Mixed-precision ZeRO-3 on {n} ranks: rank {OVERFLOW_RANK}'s gradients overflow at step "
                 f"{OVERFLOW_STEP}, the reduce-scatter puts the inf in the shards of rank{'s' * (len(saw) > 1)} "
                 f"{' and '.join(map(str, saw))}; every rank skips the step and halves the scale", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"  the loss scale per step, each rank's view of the overflow, and why a scale, drawn in {path}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--png", help="draw the loss scale per step (skipped steps marked) into this PNG")
    args = ap.parse_args()
    check_launch(ap, args, ranks=(4,), alone=4)  # part 3 overflows on rank 3 of 4
    minidist.run_anywhere(lambda world: lesson(world, args.png), threads=4)
