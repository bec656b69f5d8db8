"""Lesson 12: zero-bubble pipeline parallelism — backward split into B and W, ZB-H1 and ZB-V.

    mpiexec -n 4 python tutorials/12_zero_bubble.py               (or alone: 4 threads)
    python tutorials/12_zero_bubble.py --local 2 --png zb.png     (also draw the timelines)

A layer's backward computes two things: the gradient of its INPUT, which the previous stage waits
for, and the gradients of its WEIGHTS, which nobody waits for. Zero-bubble pipelines (Qi et al.
2023) run them as two actions (minidist/autograd/engine.py, parallel/pipeline/zero_bubble.py):

    B   input gradient only: sent up the pipe at once (the critical path)
    W   weight gradients, later: whenever the rank would sit idle, after its B, before the step ends

With T_F, T_B, T_W the costs of F, B and W of one stage, each rank sits idle per step for

    1F1B    (p-1)(T_F + T_B + T_W)
    ZB-H1   (p-1)(T_F + T_B - T_W)   1F1B's memory (p micro-batches on the busiest rank), W in the bubble
    ZB-V    >= (p-1) T_F / 2         two half-size chunks per rank in a V (rank r: stages r, 2p-1-r);
                                     rank p-1 cannot start before (p-1) chunk forwards

ZB-V holds 2p chunks on every rank, p stages' worth of activations: 1F1B's peak. A micro-batch's
activations are held from its F until its W (W still reads the layer inputs). One list scheduler
places the W (and ZB-V's F and B) for given costs: ``build_schedule(name, p, m, v, costs=(F, B, W))``,
unit costs by default; on other costs a schedule placed for unit costs is replayed as it is.

  1. B then W on one Linear: after B only x.grad; after W the weight gradient, bitwise a backward's.
  2. 1F1B, ZB-H1 and ZB-V for p ranks and m = 8, simulated; idle time and memory vs the formulas.
  3. A GPT trained 3 steps with zb-h1 and with zbv: every loss equals one process's.

Pictures (``--png zb.png``): zb.png has one row per schedule (ZB-H1, ZB-V), ranks top to bottom.
Left, "executed with known stage costs": the schedule run on blocks that sleep 20 ms for each F, B
and W (the better of 2 steps), F blue, B orange, W green (ZB-V's chunk 1 paler), each box labelled
with its micro-batch where it fits, so it shows as placed: ZB-H1's W boxes filling what would be
1F1B's idle end, ZB-V's half-size chunks packed almost without grey. Right, "executed on this
machine": the GPT's last step, each rank's F, B, W and idle time added up into one bar (its own
timeline interleaves them with waits for cores). Each title carries the bubble printed beside it.
zb_schedules.png stacks the three ideal timelines on one axis, F blue, B orange, W green (ZB-V's
chunk 1 paler): the grey corners shrink from 1F1B to ZB-H1 to ZB-V.
"""
import argparse
from dataclasses import replace

import numpy as np

import minidist
from minidist.autograd import Tensor, linear, weight_grads_later
from minidist.data import get_batch
from minidist.launch_check import check_launch
from minidist.model import GPT, GPTConfig
from minidist.nn import Parameter
from minidist.optim import SGD
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.state import WholeState
from minidist.parallel.step import train_step
from minidist.parallel.pipeline import (PipelineEngine, PipelineStage, build_schedule, compute_spans,
                                        executed_timeline, format_timeline, gather_spans, placement_of,
                                        split_micro_batches, validate)
from minidist.parallel.pipeline.known_costs import run_known_costs
from minidist.parallel.pipeline.timeline import Panel, draw_panels, label_boxes

CONFIG = GPTConfig(n_layer=8, n_head=2, n_embd=32, block_size=16)
BATCH, MICRO, STEPS = 16, 8, 3
TOKENS = np.random.default_rng(0).integers(0, 256, size=20_000)
SCHEDULES = (("1f1b", 1), ("zb-h1", 1), ("zbv", 2))
COSTS = ((1, 1, 1), (2, 2, 1))  # (T_F, T_B, T_W) of one stage
SLEEP_MS = 20  # --png: T_F = T_B = T_W of a stage in the run with known stage costs


def part1():
    rng = np.random.default_rng(0)
    x0, w0, b0, dy = rng.standard_normal((2, 4)), rng.standard_normal((3, 4)), rng.standard_normal(3), \
        rng.standard_normal((2, 3))  # x (N, in), weight (out, in), bias (out,), dy (N, out)
    x, w, b = Tensor(x0.copy(), requires_grad=True), Parameter(w0.copy()), Parameter(b0.copy())
    with weight_grads_later() as later:
        linear(x, w, b).backward(dy)  # B: dx = dy W
    print("=== 1. backward split on one Linear y = x W^T + b ===")
    print(f"after B: x.grad[0] = {np.round(x.grad[0], 4)}, weight.grad = {w.grad}, bias.grad = {b.grad}")
    later.run()  # W: dW = dy^T x, db = dy summed over rows
    xr, wr, br = Tensor(x0.copy(), requires_grad=True), Parameter(w0.copy()), Parameter(b0.copy())
    linear(xr, wr, br).backward(dy)
    same = all(np.array_equal(a.grad, r.grad) for a, r in ((x, xr), (w, wr), (b, br)))
    assert same, "B + W differs from one backward"
    print(f"after W: weight.grad[0] = {np.round(w.grad[0], 4)}; x, weight, bias grads == one backward's "
          f"(np.array_equal): {same}")


def simulate(name, v, p, costs, rescheduled=False):
    """The ideal timeline of ``name``, each of its chunks costing ``costs`` = (F, B, W): the schedule
    placed for unit costs and replayed, or ``rescheduled``, placed by the list scheduler for these."""
    placement = placement_of(name)
    schedule = build_schedule(name, p, MICRO, v, costs=costs if rescheduled else (1, 1, 1))
    t_f, t_b, t_w = costs
    return validate(schedule, p, MICRO, v, placement=placement, forward_cost=t_f, backward_cost=t_b + t_w,
                    weight_cost=t_w)  # backward_cost: a whole backward, B + W


def part2(p):
    print(f"\n=== 2. schedules for p = {p} ranks, m = {MICRO} micro-batches (unit costs: F = B = W = 1; 1F1B's "
          "backward is B + W = 2; ZB-V's per chunk) ===")
    ideal = {}
    for name, v in SCHEDULES:
        ideal[name] = simulate(name, v, p, COSTS[0])
        print(format_timeline(ideal[name], f"\n{name}" + (" (F3.1: chunk 1, stage 2p-1-r)" if v > 1 else "")))
        print(f"in flight per rank: {ideal[name].peak_in_flight()}")
    print(f"\nidle time per rank in stage units (ZB-V's chunk is half a stage: its times halved), m = {MICRO}")
    print(f"  {'T_F,T_B,T_W':<12}{'schedule':<24}{'makespan':>9}{'idle':>7}{'formula':>9}{'bubble':>8}  peak in flight")
    found = {}
    for costs in COSTS:
        t_f, t_b, t_w = costs
        formula = {"1f1b": (p - 1) * (t_f + t_b + t_w), "zb-h1": (p - 1) * (t_f + t_b - t_w),
                   "zbv": (p - 1) * t_f / 2}
        for name, v in SCHEDULES:
            both = costs != COSTS[0] and name != "1f1b"  # replayed, and placed for these costs
            for again in (False, True) if both else (False,):
                tl = simulate(name, v, p, costs, again)
                makespan = tl.makespan / v  # stage units: a ZB-V chunk costs half a stage
                idle = makespan - MICRO * sum(costs)
                found[costs, name, again] = idle, formula[name], tl.peak_in_flight()
                label = name + (", rescheduled" if again else ", replayed" if both else "")
                print(f"  {','.join(map(str, costs)):<12}{label:<24}{makespan:>9g}{idle:>7g}"
                      f"{('>= ' if name == 'zbv' else '') + f'{formula[name]:g}':>9}{100 * tl.bubble():>7.1f}%  "
                      f"{tl.peak_in_flight()}")
    unit = {name: found[COSTS[0], name, False] for name, _ in SCHEDULES}
    assert all(found[c, "1f1b", False][0] == found[c, "1f1b", False][1] for c in COSTS), "1F1B != its formula"
    assert unit["zb-h1"][0] < unit["1f1b"][0], "ZB-H1 idles no less than 1F1B"
    assert max(unit["zb-h1"][2]) == max(unit["1f1b"][2]) == p, "ZB-H1 holds more than 1F1B's peak"
    assert max(unit["zbv"][2]) == 2 * p and unit["zbv"][0] >= unit["zbv"][1], "ZB-V's memory or bound"
    gap = unit["zb-h1"][0] - unit["zb-h1"][1]
    print(f"  1F1B: exactly its formula. ZB-H1 at unit costs: {'its formula' if gap == 0 else f'{gap:g} above it'}"
          f", with 1F1B's peak of {p}. ZB-V: idle {unit['zbv'][0]:g} (bound {unit['zbv'][1]:g}), at most {2 * p} "
          "chunks in flight.")
    other = COSTS[-1]

    def idles(again):
        return ", ".join(f"{name} {found[other, name, again][0]:g}" for name, _ in SCHEDULES[1:])
    print(f"  At {','.join(map(str, other))} the order placed for unit costs, replayed, idles {idles(False)}; placed "
          f"for these costs (build_schedule(..., costs=)) {idles(True)}; 1F1B {found[other, '1f1b', False][0]:g}.")
    return ideal


def train(world, name, v, config):
    """STEPS SGD steps with ``name``: the losses, the last step's compute spans (rank 0) and the engine."""
    p = world.size
    mesh = DeviceMesh(world, pp=p)
    stage = PipelineStage(GPT(config, seed=1, dtype="float64"), mesh.pp_rank, p, v, placement=placement_of(name))
    engine = PipelineEngine(stage, mesh, name, MICRO, v)
    optimizer = SGD(stage.named_parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        world.trace.clear()
        optimizer.zero_grad()
        losses.append(engine.forward_backward(split_micro_batches(get_batch(TOKENS, step, BATCH, 16), MICRO)))
        engine.all_reduce_tied_grads()  # wte (stage 0) and lm_head (last stage) are one tied matrix
        optimizer.step()
    return losses, gather_spans(world, compute_spans(world.trace)), engine


def reference(config):
    """The same SGD steps in one process on the whole batch: the trainer's own step."""
    model = GPT(config, seed=1, dtype="float64")
    optimizer = SGD(model.named_parameters(), lr=0.1, momentum=0.9)
    return [train_step(model, WholeState(model, optimizer), get_batch(TOKENS, step, BATCH, 16), lr=0.1, grad_clip=0.0)[0]
            for step in range(STEPS)]


def lesson(world, png=None):
    p = world.size
    assert p >= 2, "the lesson needs at least 2 ranks"
    config = replace(CONFIG, n_layer=max(CONFIG.n_layer, 2 * p))  # ZB-V: 2p stages of at least one block
    if world.rank == 0:
        part1()
        ideal = part2(p)
        print(f"\n=== 3. a GPT ({config.n_layer} blocks, float64) trained {STEPS} SGD steps, batch {BATCH} in "
              f"{MICRO} micro-batches, against one process ===")
    expected = reference(config) if world.rank == 0 else None
    executed = {}
    for name, v in SCHEDULES[1:]:
        losses, spans, engine = train(world, name, v, config)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected)) if world.rank == 0 else 0.0
        if world.all_reduce(np.array([float(worst > 1e-10)]))[0]:  # every rank stops, none hangs
            raise AssertionError(f"{name} differs from one process (rank 0: {worst:.1e})")
        if world.rank == 0:
            print(f"{name:<6} losses {' '.join(f'{x:.10f}' for x in losses)}  matches one process ({worst:.1e})")
            executed[name] = executed_timeline(spans)
    # --png: both schedules on blocks that sleep SLEEP_MS (B and W as much): known stage costs, 2 steps
    known = {name: run_known_costs(world, config, name, MICRO, get_batch(TOKENS, 0, BATCH, 16), v, SLEEP_MS / 1e3)
             for name, v in SCHEDULES[1:]} if png else {}
    if world.rank == 0 and png:
        print(f"\nbubble of the last step: on this machine (the GPT above), and with known stage costs (blocks "
              f"that sleep\n{SLEEP_MS} ms for each F, B and W, the better of 2 steps: the engine's scheduler and "
              "messages, costs that do not\ncompete for the CPU)")
        for name, _ in SCHEDULES[1:]:
            print(f"  {name:<6} on this machine {100 * executed[name].bubble():5.1f}%   with known stage costs "
                  f"{100 * known[name][0].bubble():5.1f}%   ideal {100 * known[name][1].bubble():5.1f}%")
        draw(png, p, known, executed)
        path = png[:-4] + "_schedules.png" if png.endswith(".png") else png + "_schedules.png"
        draw_schedules(path, ideal, p)
        print(f"ZB-H1 and ZB-V executed with known stage costs and on this machine drawn in {png}; 1F1B, ZB-H1, "
              f"ZB-V ideal in {path}")
    if world.rank == 0:
        print("\nTry:")
        print("  1. MICRO = 4 (m = p; the numbers for p = 4). Expect the same idle time per rank, 1F1B 9, "
              "ZB-H1 3\n     (it depends on p, not m), in a shorter step: bubbles 42.9%, 20.0%, 14.3% (27.3%, 11.1%, "
              "5.9% at m = 8);\n     ZB-V idles 2 (bound 1.5), its rank 0 peaks at 7 chunks; the same losses.")
        print("  2. COSTS = ((1, 1, 1), (1, 2, 1)) (p = 4). Expect 1F1B to idle 12 and ZB-H1 6, its formula, "
              "replayed or rescheduled;\n     ZB-V replayed 13.5, worse than 1F1B, rescheduled 7: "
              "a zero-bubble order must be "
              "placed for the real costs.")
        print("Zero-bubble schedules: B + W = backward bitwise; zb-h1 and zbv train as one process does. "
              "All checks passed.")


def draw(path, p, known, executed):
    """One row per schedule: left, the step executed with known stage costs (the schedule itself),
    F, B and W in three colours, ZB-V's second chunk paler; right, the GPT's last step on this
    machine, each rank's F, B, W and idle time added up (its boxes are slivers between waits for
    cores and messages); titles carry the bubbles printed above."""
    rows = [[Panel(known[name][0], f"{name}, executed with known stage costs: bubble "
                   f"{100 * known[name][0].bubble():.1f}%, ideal {100 * known[name][1].bubble():.1f}%", 1e3),
             Panel(executed[name], f"{name}, executed on this machine (the GPT, last step): bubble "
                   f"{100 * executed[name].bubble():.1f}%", 1e3, summed=True)] for name, _ in SCHEDULES[1:]]
    draw_panels(path, rows, f"Zero-bubble schedules on {p} ranks, m = {MICRO} micro-batches, each box labelled with "
                f"its micro-batch. Left: blocks that sleep {SLEEP_MS} ms for each F, B and W (the better of 2 "
                "steps): the schedule as placed,\nW (green) filling what would be 1F1B's idle time. Right: the GPT "
                "trained above, each rank's step added up: its own timeline interleaves the actions with waits for "
                "cores and messages", "milliseconds of the step", widths=[2.6, 1], by_op=True)


def draw_schedules(path, ideal, p):
    """The three ideal timelines one above the other on one time axis (stage units), F, B and W in
    three colours, each box labelled with its micro-batch (and chunk)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colours = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
    fig, axes = plt.subplots(len(ideal), 1, figsize=(13, 1 + 1.3 * p * len(ideal) / 2), sharex=True)
    for ax, (name, v) in zip(axes, SCHEDULES):
        tl = ideal[name]
        for r, spans in enumerate(tl.spans):
            for s in spans:
                a = s.action
                ax.barh(r, (s.end - s.start) / v, left=s.start / v, height=0.8, color=colours[a.op],
                        edgecolor="black", linewidth=0.4, alpha=0.6 if v > 1 and a.stage >= p else 1.0)
        ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
        ax.invert_yaxis()
        ax.set_title(f"{name}: makespan {tl.makespan / v:g}, bubble {100 * tl.bubble():.1f}%, in flight "
                     f"{tl.peak_in_flight()}", fontsize=10, loc="left")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    fig.legend(handles, ["F", "B (input gradient; 1F1B: the whole backward)", "W (weight gradients)"],
               loc="upper center", fontsize=9, ncol=3)
    axes[-1].set_xlabel("time (stage units: T_F = T_B = T_W = 1; ZB-V's chunks are half stages, paler: chunk 1)")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    for ax, (name, v) in zip(axes, SCHEDULES):  # each box: its micro-batch (and chunk), where it fits
        label_boxes(ax, ideal[name], 1 / v, lambda a, v=v: f"{a.microbatch}" + (f".{a.stage // p}" if v > 1 else ""))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local", type=int, nargs="?", const=4, metavar="N", help="run N ranks as threads (default 4)")
    ap.add_argument("--png", help="draw ZB-V executed vs ideal into this PNG, and the three schedules beside it")
    args = ap.parse_args()
    check_launch(ap, args, ranks=range(2, 9), alone=4)
    if args.local:
        minidist.run_local(lambda world: lesson(world, args.png), args.local)
    else:
        minidist.run_anywhere(lambda world: lesson(world, args.png), threads=4)
