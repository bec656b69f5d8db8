"""Benchmark: GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZB-V side by side at several m.

    mpiexec -n 2 python benchmarks/pipeline.py            # pp = 2 over MPI
    mpiexec -n 4 python benchmarks/pipeline.py --steps 3  # pp = 4 (oversubscribed on 2 cores)
    mpiexec -n 4 python benchmarks/pipeline.py --png benchmarks/figures/pipeline_zbv_p4_m8.png
    mpiexec -n 2 python benchmarks/pipeline.py --only 1f1b --micro-batches 8 --png benchmarks/figures/pipeline_1f1b_p2_m8.png

A GPT (8 blocks, 64 wide, float32) with a fixed global batch of 32 sequences of 64 tokens; each
schedule (interleaved and zbv with v = 2 chunks per rank; interleaved only where p divides m) runs
``--steps`` steps after one warm-up step. Per configuration: median step time, the measured bubble
of the fastest step (from the trace's F/B/W spans, W counted busy: 1 - busy / step, averaged over
ranks), the simulator's ideal bubble (unit costs F = 1, B + W = 2, W = 1), the peak micro-batches in
flight (engine.peak_in_flight, max over ranks) against the simulator's, and the median duration of
the traced forward / backward (B) / weight (W) events over the measured steps and all ranks (one
event is one micro-batch on one stage or chunk). Then zb-h1 and zbv run again, placed for the
F : B : W that zb-h1 measured (the paper places its schedules for profiled costs; the engine's
default is unit costs). ``--png`` draws the executed vs ideal timeline of zbv's last step at the
first m (``--only NAME``: measure that one schedule alone at the first m, print its row and draw it;
no JSON is written, since the tables need every row).

Rank 0 also prints a theory table, no MPI needed: the simulator's makespan of 1f1b, zb-h1 and zbv
for p in (2, 4), m in (8, 16) and costs (T_F, T_B, T_W) (zb-h1 and zbv placed for those costs; in
parentheses, placed for unit costs as the engine runs them), against the formulas
1F1B = (m + p-1)(T_F+T_B+T_W), ZB-H1 = m(T_F+T_B+T_W) + (p-1)(T_F+T_B-T_W) (Qi et al. 2023) and the
ZB-V lower bound 2m(t_F+t_B+t_W) + (p-1)t_F in chunk costs t = T/2. JSON (both tables) goes to
benchmarks/results/pipeline_<p>ranks.json.
"""
import argparse
import json
import time
from pathlib import Path

import numpy as np

import minidist
from minidist.data import get_batch
from minidist.model import GPT, GPTConfig
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.pipeline import (PipelineEngine, PipelineStage, build_schedule, compute_spans,
                                        draw_timelines, executed_timeline, gather_spans, placement_of,
                                        split_micro_batches, validate)

CONFIG = GPTConfig(n_layer=8, n_head=4, n_embd=64, block_size=64)
BATCH = 32
TOKENS = np.random.default_rng(0).integers(0, 256, size=100_000)
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2))
COSTS = ((1, 1, 1), (1, 1.5, 0.5), (2, 2, 1))  # (T_F, T_B, T_W) of a whole stage


def measure(world, schedule, m, v, steps, costs=None):
    """The row of one configuration (the zero-bubble schedules placed for ``costs``, the (F, B, W)
    of one stage; None: unit costs), and the last step's executed and ideal timelines (rank 0)."""
    mesh = DeviceMesh(world, pp=world.size)
    stage = PipelineStage(GPT(CONFIG, seed=0), mesh.pp_rank, world.size, v, placement=placement_of(schedule))
    engine = PipelineEngine(stage, mesh, schedule, m, v, costs=costs or (1.0, 1.0, 1.0))
    times, bubbles, peak, events = [], [], np.zeros(1), []
    for step in range(steps + 1):
        micro = split_micro_batches(get_batch(TOKENS, step, BATCH, CONFIG.block_size), m)
        stage.zero_grad()
        world.barrier()
        world.trace.clear()
        start = time.perf_counter()
        engine.forward_backward(micro)
        engine.all_reduce_tied_grads()
        elapsed = np.array([time.perf_counter() - start])
        world.all_reduce(elapsed, op="max")
        peak = np.maximum(peak, engine.peak_in_flight)
        spans = gather_spans(world, compute_spans(world.trace))
        if step > 0:  # step 0 warms up
            times.append(float(elapsed[0]))
            bubbles.append(executed_timeline(spans).bubble() if world.rank == 0 else 0.0)
            events += spans if world.rank == 0 else []
    world.all_reduce(peak, op="max")
    rows = np.concatenate(events) if world.rank == 0 else np.zeros((0, 5))  # measured steps, all ranks
    median_ms = {op: 1e3 * float(np.median(np.diff(rows[rows[:, 4] == k][:, :2]))) if (rows[:, 4] == k).any()
                 else None for k, op in enumerate(("F", "B", "W"))}
    row = dict(schedule=schedule + (" (placed for measured costs)" if costs else ""), pp=world.size, m=m, v=v,
               placed_for=list(costs or (1.0, 1.0, 1.0)), step_ms=1e3 * float(np.median(times)),
               bubble=min(bubbles), ideal=engine.ideal.bubble(), peak_in_flight=int(peak[0]),
               ideal_peak_in_flight=max(engine.ideal.peak_in_flight()), **{f"{op}_ms": t for op, t in median_ms.items()})
    return row, (executed_timeline(spans) if world.rank == 0 else None), engine.ideal


def theory():
    """Simulator makespans of 1f1b, zb-h1, zbv against the closed forms, for several cost ratios."""
    rows = []
    for p in (2, 4):
        for m in (8, 16):
            for tf, tb, tw in COSTS:
                def sim(name, v, f, b, w, placed_for=(tf, tb, tw)):  # zb schedules are placed for costs
                    return validate(build_schedule(name, p, m, v, costs=placed_for), p, m, v,
                                    placement=placement_of(name), forward_cost=f, backward_cost=b,
                                    weight_cost=w).makespan
                rows.append(dict(p=p, m=m, T_F=tf, T_B=tb, T_W=tw,
                                 sim_1f1b=sim("1f1b", 1, tf, tb + tw, tw), formula_1f1b=(m + p - 1) * (tf + tb + tw),
                                 sim_zbh1=sim("zb-h1", 1, tf, tb + tw, tw),
                                 formula_zbh1=m * (tf + tb + tw) + (p - 1) * (tf + tb - tw),
                                 sim_zbh1_unit=sim("zb-h1", 1, tf, tb + tw, tw, placed_for=(1, 1, 1)),
                                 sim_zbv=sim("zbv", 2, tf / 2, (tb + tw) / 2, tw / 2),
                                 sim_zbv_unit=sim("zbv", 2, tf / 2, (tb + tw) / 2, tw / 2, placed_for=(1, 1, 1)),
                                 bound_zbv=m * (tf + tb + tw) + (p - 1) * tf / 2))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--png", help="draw zbv's executed vs ideal timeline (first m) to this path")
    ap.add_argument("--only", choices=[name for name, _ in SCHEDULES],
                    help="measure and draw (--png) this schedule alone at the first m; writes no JSON")
    args = ap.parse_args()
    world = minidist.init()
    if args.only:
        m, v = args.micro_batches[0], dict(SCHEDULES)[args.only]
        row, executed, ideal = measure(world, args.only, m, v, args.steps)
        if world.rank == 0:
            print({k: round(float(x), 4) if isinstance(x, (float, np.floating)) else x for k, x in row.items()})
            if args.png:
                draw_timelines(args.png, executed, ideal, f"{args.only}, p = {world.size}, m = {m}: executed vs ideal")
        return
    rows = []
    for m in args.micro_batches:
        for schedule, v in SCHEDULES:
            if m % world.size == 0 or schedule != "interleaved":
                row, executed, ideal = measure(world, schedule, m, v, args.steps)
                rows.append(row)
                if args.png and schedule == "zbv" and m == args.micro_batches[0] and world.rank == 0:
                    draw_timelines(args.png, executed, ideal, f"zbv, p = {world.size}, m = {m}: executed vs ideal")
        # the zero-bubble schedules again, placed for the F, B and W zb-h1 just measured (one stage's)
        zb = next((r for r in rows if r["schedule"] == "zb-h1" and r["m"] == m), None)
        costs = np.array([zb[f"{op}_ms"] for op in "FBW"] if world.rank == 0 else [0.0] * 3)
        world.broadcast(costs, src=0)  # every rank must build the same schedule
        for schedule, v in (("zb-h1", 1), ("zbv", 2)):
            rows.append(measure(world, schedule, m, v, args.steps, costs=tuple(costs / costs[0]))[0])
    if world.rank == 0:
        ms = lambda t: "-" if t is None else f"{t:.2f}"  # noqa: E731
        print("| schedule | p | m | v | step (ms) | bubble measured | bubble ideal | peak in flight (ideal) "
              "| F / B / W (ms) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['schedule']} | {r['pp']} | {r['m']} | {r['v']} | {r['step_ms']:.1f} | "
                  f"{100 * r['bubble']:.1f}% | {100 * r['ideal']:.1f}% | {r['peak_in_flight']} "
                  f"({r['ideal_peak_in_flight']}) | {ms(r['F_ms'])} / {ms(r['B_ms'])} / {ms(r['W_ms'])} |")
        table = theory()
        print("\n| p | m | T_F, T_B, T_W | 1f1b sim / formula | zb-h1 sim / formula (placed for unit costs) "
              "| zbv sim / bound (placed for unit costs) |")
        print("|---|---|---|---|---|---|")
        for t in table:
            print(f"| {t['p']} | {t['m']} | {t['T_F']}, {t['T_B']}, {t['T_W']} | {t['sim_1f1b']:g} / "
                  f"{t['formula_1f1b']:g} | {t['sim_zbh1']:g} / {t['formula_zbh1']:g} ({t['sim_zbh1_unit']:g}) | "
                  f"{t['sim_zbv']:g} / {t['bound_zbv']:g} ({t['sim_zbv_unit']:g}) |")
        out = Path(__file__).resolve().parent / "results" / f"pipeline_{world.size}ranks.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(dict(measured=rows, theory=table), indent=1))


if __name__ == "__main__":
    main()
