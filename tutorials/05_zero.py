"""Lesson 5: ZeRO. Who holds which bytes at each stage, in float64 and in the paper's mixed
precision, ZeRO-3's peak while it gathers, what each stage sends, and proof that it trains exactly
like one process.

    mpiexec -n 4 python tutorials/05_zero.py                  (or: python tutorials/05_zero.py, 4 threads;
                                                               -n 2 or 8 too: N must divide the 8 rows)
    python tutorials/05_zero.py --png zero.png                (and draw the bytes per rank per stage)

Plain data parallelism keeps on each of N ranks the full parameters P, gradients G and optimizer
state O. ZeRO cuts them by offset into N shards (minidist/parallel/zero/flat_buffer.py):

    stage 1: P + G + O/N        optimizer state sharded; gradients reduce-scattered, shards updated,
                                parameters all-gathered
    stage 2: P + (G + O)/N      the same, each unit reduce-scattered during backward, full gradients dropped
    stage 3: (P + G + O)/N      parameters too: each module gathers them before its forward and again
                                before its backward (saved-tensor hooks hand the gathered weights back
                                to the graph: activations are kept, nothing is recomputed), frees them after

1. Bytes, float64 (the equality proof). For every stage the lesson trains 5 steps of AdamW in float64
   and prints the bytes each rank holds (measured from the live arrays after backward) next to the
   formula, and checks the final weights against one process on the full batch to 1e-10. In float64
   P = G = 8 bytes per parameter and AdamW's two moments O = 16: not the paper's numbers.
2. Bytes as the ZeRO paper counts them (mixed precision): float16 parameters and gradients (2 + 2
   bytes per parameter) and float32 master weights and two moments (12): 2 Psi + 2 Psi + 12 Psi =
   16 Psi, sharded per stage: 16, 7, 5.5 and 4 Psi on 4 ranks. Measured from a live float16 model
   under each stage, equal to the paper to the byte (lesson 9 trains it, with an overflow).
3. ZeRO-3's peak. Its resting memory is the shards, but each module's full parameters exist while
   it computes: the lesson notes the full parameters bound to the model (plus the next module's
   all-gather already in flight: the prefetch) at every gather of forward and backward. The largest
   is two blocks here, the working set: it stays two blocks however many layers a model has, while
   P grows with them. With 2 blocks (this model) that peak is more than stage 2 holds.
4. Traffic per step, from the trace: every collective's buffer bytes, summed per kind, in units of P.
   Lesson 1 measured that of an all-reduce of N bytes each rank sends 2(n-1)/n N: a reduce-scatter
   ((n-1)/n N) then an all-gather ((n-1)/n N). ZeRO splits exactly there: stages 1 and 2 send
   reduce-scatter P + all-gather P = the all-reduce of stage 0; stage 3 all-gathers twice (forward
   and backward): 3 (n-1)/n P, 1.5x. The lesson's buffers are small (a unit is at most 100 KiB),
   below the 256 KiB where "auto" picks recursive doubling (log2(n) whole buffers a rank: lesson 1),
   so it sets ``group.threshold_bytes = 0``: bandwidth-optimal all-reduces, as for a real model's
   megabyte buffers (Rabenseifner's on a power-of-two group, else the ring; both send 2(n-1)/n).

The step: every layout runs one gradient pipeline (minidist/parallel/compose/gradients.py,
``apply_gradients``): reduce, complete, unscale, clip, update, publish. ZeRO supplies three of those
steps and nothing else: how gradients are reduced (``zero.reduce()``: reduce-scatters instead of
all-reduces), where the optimizer state lives and is updated (the shards), and how parameters are
published (all-gathered). The lesson calls ``zero.reduce()`` itself to measure the bytes at their
largest, then ``apply_gradients`` for the rest: the same code a plain data-parallel step runs.

Picture: ``--png PATH`` draws P, G and O per rank per stage, in float64 (with ZeRO-3's gathered
peak) and in mixed precision (bytes per parameter, with the paper's totals).
"""
import argparse

import numpy as np

import minidist
from minidist.amp import DynamicLossScaler
from minidist.comm.ops import bus_factor
from minidist.data import get_batch, inputs_and_targets
from minidist.launch_check import check_launch
from minidist.model import GPT, GPTConfig
from minidist.optim import AdamW, clip_grad_norm
from minidist.parallel.compose.gradients import apply_gradients
from minidist.parallel.compose.loss_scaling import backward_micro_batch
from minidist.parallel.zero.full_state import full_parameters
from minidist.parallel.zero.optimizer import ZeroOptimizer
from minidist.inspect import zero_memory

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_embeddings=False)
BATCH, STEPS, LR = 8, 5, 1e-2
TOKENS = np.random.default_rng(0).integers(0, 64, size=4000)
PARTS = ("parameters", "gradients", "optimizer")
KINDS = ("all_reduce", "reduce_scatter", "all_gather")
NORM_BYTES = 16  # stages 1-3: clip_grad_norm all-reduces two float64 sums of squares over dp


def batch(step):
    return inputs_and_targets(get_batch(TOKENS, step, BATCH, CONFIG.block_size))


def one_process():
    model = GPT(CONFIG, seed=0, dtype="float64")
    opt = AdamW(model.named_parameters(), lr=LR, weight_decay=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        model(*batch(step))[1].backward()
        clip_grad_norm(model.parameters(), 1.0)
        opt.step()
    return model.state_dict()


def watch_gathers(zero, model):
    """ZeRO-3: after every gather (each module's, forward and backward), note the bytes of full
    parameters bound to the model now, plus the next module's all-gather in flight (the prefetch).
    Returns a dict that keeps the largest: bytes, and the units gathered then (``watching``: set it
    False to stop, before ``full_parameters()`` gathers everything on purpose)."""
    peak = {"bytes": 0, "units": [], "watching": True}
    gatherer, ensure = zero.gatherer, zero.gatherer.ensure

    def watched(shards):
        ensure(shards)
        if peak["watching"] and gatherer.held_bytes() > peak["bytes"]:  # gathered + prefetch buffers
            gathered = [s.unit.name for s in zero.shards if s.unit.params[0][1].data.size]
            queued = [s.unit.name for s in gatherer.prefetching(zero.shards)]
            peak.update(bytes=gatherer.held_bytes(), units=gathered + [f"{u} (prefetch)" for u in queued])
    gatherer.ensure = watched
    return peak


def train(group, stage, reference):
    """STEPS steps of float64 AdamW under ZeRO ``stage``. Returns the bytes this rank held after
    the first backward, the formula, ZeRO-3's gathered peak (or None), the trace's bytes per kind
    of collective per step (sharding buffers and the norm's all-reduce apart), the algorithms the
    trace names, and the error against one process."""
    model = GPT(CONFIG, seed=0, dtype="float64")
    zero = ZeroOptimizer(model, group, stage, "adamw", lr=LR, weight_decay=0.1)
    peak = watch_gathers(zero, model) if stage == 3 else None
    rows = np.array_split(np.arange(BATCH), group.size)[group.rank]  # this rank's rows
    with group.trace.capture() as events:
        for step in range(STEPS):
            idx, targets = batch(step)
            zero.zero_grad()
            model(idx[rows], targets[rows])[1].backward()
            zero.reduce()  # ZeRO's reduction: the model states are at their largest now
            if step == 0:
                held, formula = zero_memory.model_state_bytes(zero), zero_memory.formula(zero)
            apply_gradients(zero, LR, max_norm=1.0)  # the rest of the pipeline: clip, update, all-gather
    if peak is not None:
        peak["watching"] = False
    traffic = dict.fromkeys(KINDS + ("norm",), 0)
    for e in events:
        if e.kind == "collective" and e.op in KINDS:
            traffic["norm" if e.op == "all_reduce" and e.nbytes == NORM_BYTES else e.op] += e.nbytes
    traffic = {k: v // STEPS for k, v in traffic.items()}  # every step sends the same
    algorithms = sorted({f"{e.op} {e.algorithm}" for e in events if e.op in KINDS and e.nbytes != NORM_BYTES})
    with full_parameters(zero):
        state = model.state_dict()
    error = max(float(np.abs(state[k] - v).max() / np.abs(v).max()) for k, v in reference.items())
    return held, formula, peak, traffic, algorithms, error


def mixed_precision_bytes(group, stage):
    """The paper's bytes: a float16 model under ZeRO ``stage`` with float32 masters and moments; one
    forward and backward, then what this rank holds (P, G, O = masters + moments), live."""
    model = GPT(CONFIG, seed=0, dtype="float16")
    scaler = DynamicLossScaler(group=group)
    zero = ZeroOptimizer(model, group, stage, "adamw", lr=LR, weight_decay=0.1,
                         mixed_precision="float16", scaler=scaler)
    idx, targets = batch(0)
    rows = np.array_split(np.arange(BATCH), group.size)[group.rank]
    zero.zero_grad()
    backward_micro_batch(model(idx[rows], targets[rows])[1], 1, scaler.scale)
    zero.reduce()
    return zero_memory.model_state_bytes(zero)


def lesson(group):
    """The whole lesson on one rank; returns, on rank 0, what :func:`draw` and the exercises need."""
    group.threshold_bytes = 0  # bandwidth-optimal all-reduces even for these small buffers (docstring, 4.)
    n = group.size
    reference = one_process()
    psi = sum(v.size for v in reference.values())
    P = psi * 8  # float64 parameter bytes
    results = {stage: train(group, stage, reference) for stage in (0, 1, 2, 3)}
    mixed = {stage: mixed_precision_bytes(group, stage) for stage in (0, 1, 2, 3)}

    # every rank's bytes, gathered: (stages, n, 3) in float64 and in mixed precision, and the peaks
    def everyone(held_by_stage):
        mine = np.array([[held[k] for k in PARTS] for held in held_by_stage])  # (4, 3)
        return group.all_gather(mine[None]).reshape(n, 4, 3).transpose(1, 0, 2)  # (4, n, 3)
    held64 = everyone([results[s][0] for s in results])
    held16 = everyone([mixed[s] for s in mixed])
    peaks = group.all_gather(np.array([results[3][2]["bytes"]])).reshape(n)  # (n,)

    # the checks, on every rank: a sharded part adds up over the ranks to the whole (numpy.array_split
    # may give a rank one element more), a replicated one is whole on every rank
    failures = []
    whole = {"float64": (P, P, 2 * P), "float16": (2 * psi, 2 * psi, 12 * psi)}  # AdamW: 2 moments; fp32 master + 2
    for stage in range(4):
        sharded = (stage >= 3, stage >= 2, stage >= 1)
        for name, held in (("float64", held64[stage]), ("float16", held16[stage])):  # (n, 3)
            for k, part in enumerate(PARTS):
                ok = held[:, k].sum() == whole[name][k] if sharded[k] else (held[:, k] == whole[name][k]).all()
                if not ok:
                    failures.append(f"stage {stage} {name}: {part} per rank {held[:, k].tolist()}, whole "
                                    f"{whole[name][k]}, sharded: {sharded[k]}")
    for stage, (held, formula, peak, traffic, _, error) in results.items():
        if error > 1e-10:
            failures.append(f"stage {stage}: weights differ from one process by {error:.1e}")
        if not np.isclose(held64[stage].sum(), n * sum(formula.values())):  # the mean rank = zero_memory.formula(zero)
            failures.append(f"stage {stage}: the ranks hold {held64[stage].sum(axis=1).tolist()}, formula {formula}")
        expected = {0: (P, 0, 0), 1: (0, P, P), 2: (0, P, P), 3: (0, P, 2 * P)}[stage]
        if tuple(traffic[k] for k in KINDS) != expected:
            failures.append(f"stage {stage}: traced bytes per step {traffic}, expected {expected} (P = {P})")
    if group.all_reduce(np.array([len(failures)]))[0]:
        raise AssertionError(f"rank {group.rank}: " + "; ".join(failures or ["another rank failed"]))
    if group.rank != 0:
        return None
    show(n, psi, P, results, held64, held16, peaks)
    block = sum(v.size for k, v in reference.items() if k.startswith("transformer.h.0."))  # one block's Psi
    return held64, held16, peaks, psi, n, block


def show(n, psi, P, results, held64, held16, peaks):
    """Rank 0 prints the four sections (every number was checked on every rank before)."""
    kib = lambda b: f"{b / 1024:>9.1f}"  # noqa: E731
    print(f"=== 1. float64, AdamW, N = {n} ranks, Psi = {psi:,} parameters (P = G = 8 Psi = {P / 1024:.1f} KiB, "
          f"O = 16 Psi): KiB rank 0 holds after backward ===")
    print(f"{'stage':>5} {'params':>8} {'grads':>8} {'optim':>8} {'total':>8} {'formula':>8}   weights vs one process")
    for stage, (held, formula, _, _, _, error) in results.items():
        print(f"{stage:>5} " + "".join(kib(held[k]) for k in PARTS) + kib(sum(held.values()))
              + kib(sum(formula.values())) + f"   {error:.0e}")
    print(f"  every rank: {', '.join(f'rank {r} {held64[3, r].sum() / 1024:.1f}' for r in range(n))} KiB at stage 3"
          " (each unit's shards, numpy.array_split)")

    print("\n=== 2. mixed precision as the ZeRO paper counts it: float16 P and G, float32 master + 2 moments; "
          "bytes rank 0 holds ===")
    print(f"{'stage':>5} {'P f16':>9} {'G f16':>9} {'O f32':>9} {'total':>9}  bytes/param   paper: 2 Psi + 2 Psi + "
          f"12 Psi, sharded")
    paper = {0: "16", 1: f"2 + 2 + 12/{n}", 2: f"2 + (2 + 12)/{n}", 3: f"(2 + 2 + 12)/{n}"}
    for stage in range(4):
        row = held16[stage, 0]
        print(f"{stage:>5} " + "".join(f"{v:>9,}" for v in row) + f"{row.sum():>10,}  {row.sum() / psi:>8g} Psi"
              f"   = {paper[stage]} = {row.sum() / psi:g} Psi: measured = paper to the byte")
    print(f"  float64 holds {held64[0, 0].sum() / psi:g} bytes a parameter at stage 0 (8 + 8 + 16); mixed precision "
          f"16: the float32 masters and moments (12) dominate, which is why stage 1 shards them first.")

    peak, units = peaks[0], results[3][2]["units"]
    rest = held64[3, 0, 0]
    print(f"\n=== 3. ZeRO-3's peak: the shards rest at {rest / 1024:.1f} KiB of parameters, but each module's "
          f"full parameters exist while it runs ===")
    print(f"  largest gathered working set (full parameters bound + prefetch in flight), measured at every gather:\n"
          f"    {peak / 1024:.1f} KiB = {', '.join(units)}")
    print(f"  so rank 0's parameters peak at {rest / 1024:.1f} + {peak / 1024:.1f} = {(rest + peak) / 1024:.1f} KiB "
          f"(stage 2 holds all of P: {P / 1024:.1f} KiB; every rank's gathered peak: "
          f"{', '.join(f'{p / 1024:.1f}' for p in peaks)} KiB).")
    verdict = ("saves nothing at the peak" if rest + peak >= P else
               f"peaks {100 * (1 - (rest + peak) / P):.0f}% below stage 2")
    print(f"  With {CONFIG.n_layer} blocks ZeRO-3 {verdict}; the working set stays two blocks while P grows with "
          f"the layers (Try 2).")

    print(f"\n=== 4. bytes per step from the trace, in units of P = {P / 1024:.1f} KiB; each rank sends (n-1)/n "
          f"of a reduce-scatter's\n    or all-gather's buffer and 2(n-1)/n of an all-reduce's (lesson 1: "
          f"2(n-1)/n = (n-1)/n + (n-1)/n) ===")
    print(f"{'stage':>5} {'all-reduce':>11} {'reduce-scatter':>15} {'all-gather':>11}   sent/step KiB   vs stage 0"
          f"   + clip's norm all-reduce")
    sent0 = None
    for stage, (_, _, _, traffic, algorithms, _) in results.items():
        sent = sum(traffic[k] * bus_factor(k, n) for k in KINDS)
        sent0 = sent0 or sent
        print(f"{stage:>5} {traffic['all_reduce'] / P:>10g}P {traffic['reduce_scatter'] / P:>14g}P "
              f"{traffic['all_gather'] / P:>10g}P   {sent / 1024:>13.1f}   {sent / sent0:>9g}x   "
              f"{traffic['norm']:g} B")
    f = (n - 1) / n
    print(f"  stage 0: 2(n-1)/n P = {2 * f:g} P; stages 1, 2: (n-1)/n P + (n-1)/n P = the same; stage 3: "
          f"3(n-1)/n P = {3 * f:g} P = 1.5x.")
    print(f"  algorithms (trace): {', '.join(sorted(set(a for r in results.values() for a in r[4])))}")
    print("stages 1 and 2 send what stage 0 (plain data parallelism) sends; stage 3 sends 1.5x.")


def exercises(psi, block):
    """Closing exercises with what the learner should see (formulas on this run's unit sizes)."""
    P = psi * 8  # float64 bytes, for 2 ranks: P + G + O with O = 2P, sharded per stage
    two = [4 * P, 2 * P + 2 * P / 2, P + 3 * P / 2, 4 * P / 2]
    paper_two = [16, 4 + 12 / 2, 2 + 14 / 2, 16 / 2]
    layers = 8
    big = (psi + (layers - CONFIG.n_layer) * block) * 8  # P with 8 blocks of this size
    print("\nTry:")
    print("  1. mpiexec -n 2 (or threads=2 in main): the sharded columns double. Expect in section 1 totals of "
          + ", ".join(f"{v / 1024:.1f}" for v in two) + " KiB\n     for stages 0-3, in section 2 "
          + ", ".join(f"{v:g}" for v in paper_two) + " Psi, and stage 3 still at 1.5x stage 0's traffic.")
    print(f"  2. n_layer={layers} in CONFIG: P grows to {big / 1024:.1f} KiB and ZeRO-3 rests at {big / 4 / 1024:.1f} "
          f"KiB (4 ranks), yet its gathered\n     peak stays two blocks, {2 * block * 8 / 1024:.1f} KiB: "
          f"the peak, {(big / 4 + 2 * block * 8) / 1024:.1f} KiB, is now far below stage 2's {big / 1024:.1f}.")


def draw(path, held64, held16, peaks, psi, n):
    """P, G and O per rank per stage: float64 KiB with ZeRO-3's gathered peak, and mixed-precision
    bytes per parameter with the paper's totals."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer": "#55a868"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    width = 0.8 / n
    for ax, held, unit, title in ((axes[0], held64 / 1024, "KiB", "float64 + AdamW (the proof)"),
                                  (axes[1], held16 / psi, "bytes per parameter", "mixed precision (the paper)")):
        for stage in range(4):
            for r in range(n):
                x = stage + (r - (n - 1) / 2) * width
                bottom = 0.0
                for k, part in enumerate(PARTS):
                    ax.bar(x, held[stage, r, k], width * 0.92, bottom=bottom, color=colors[part])
                    bottom += held[stage, r, k]
                if ax is axes[0] and stage == 3:
                    ax.bar(x, peaks[r] / 1024, width * 0.92, bottom=bottom, color="white", edgecolor=colors[
                        "parameters"], hatch="///")
                ax.text(x, -0.02, f"r{r}", ha="center", va="top", fontsize=7, transform=ax.get_xaxis_transform())
        ax.set_xticks(range(4), [f"\nstage {s}" for s in range(4)], fontsize=9)
        ax.tick_params(axis="x", length=0)
        ax.set_ylabel(f"{unit} per rank", fontsize=9)
        ax.set_title(title, fontsize=10)
    paper = [16, 4 + 12 / n, 2 + 14 / n, 16 / n]
    axes[1].plot(range(4), paper, "k_", markersize=28, markeredgewidth=2)
    for s, v in enumerate(paper):
        axes[1].text(s + 0.45, v, f"paper {v:g}", fontsize=8, va="center")
    handles = [Patch(color=colors[p], label=p if p != "optimizer" else "optimizer state\n(fp32 master + moments\n"
                     "in mixed precision)") for p in PARTS]
    handles.append(Patch(facecolor="white", edgecolor=colors["parameters"], hatch="///",
                         label="ZeRO-3: full parameters\ngathered at the peak\n(forward / backward)"))
    handles.append(plt.Line2D([], [], color="black", marker="_", linestyle="", markersize=14, markeredgewidth=2,
                              label="paper: 2+2+12 Psi, sharded"))
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.suptitle(f"ZeRO on {n} ranks: what each rank (r0..r{n - 1}) holds per stage, measured from the live arrays",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"\nP/G/O per rank per stage drawn in {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--png", metavar="PATH", help="draw P/G/O per rank per ZeRO stage into PATH")
    args = p.parse_args()
    check_launch(p, args, ranks=(2, 4), alone=4)
    result = minidist.run_anywhere(lesson, threads=4)
    result = result[0] if isinstance(result, list) else result  # threads: every rank's; MPI: this rank's
    if result is None:
        return
    held64, held16, peaks, psi, n, block = result
    if args.png:
        draw(args.png, held64, held16, peaks, psi, n)
    exercises(psi, block)
    print("\nAll checks passed: every stage's weights = one process's; bytes held = the formula, and in mixed "
          "precision = the paper's; traffic = lesson 1's formula.")


if __name__ == "__main__":
    main()
