"""Lesson 4: pipeline parallelism — stages, micro-batches, GPipe, 1F1B, interleaved, the bubble, the picture.

    mpiexec -n 4 python tutorials/04_pipeline.py            # 4 pipeline stages, over MPI
    python tutorials/04_pipeline.py --local 2               # 2 ranks as threads in one process
    python tutorials/04_pipeline.py --local 2 --png pp.png  # also draw each schedule, executed vs ideal

A model too big for one device is cut into consecutive STAGES, one per rank: the first embeds, the
last computes the loss. Rank r can only start on a batch once rank r-1 has sent it its activations,
and backward runs the other way. With one batch, all ranks but one would be idle at any time. So the
batch is cut into m MICRO-BATCHES that follow each other through the pipe like cars on an assembly
line. The idle time left at the start and the end of each step is the BUBBLE: (p-1)/(m+p-1) of the
step for p stages.

GPipe runs all m forwards, then all backwards: every rank holds the activations of m micro-batches.
1F1B starts backwards as soon as the last stage can, then alternates one forward, one backward: the
same bubble, but rank r holds at most p - r micro-batches. Interleaved 1F1B gives each rank v smaller
chunks (here v = 2: rank r holds stages r and r + p, each half as many layers), and the bubble
shrinks by v. (Lesson 12 splits backward into B and W and fills the bubble with W: ZB-H1 and ZB-V.)

In minidist a schedule is DATA: a list of actions per rank, validated (and simulated over all ranks)
before anything is sent. This lesson prints the three schedules, shows the validator catching a
deadlock, then trains a small GPT on the grammar corpus with each of them, checks every loss and
weight against one process on the whole batch, and sets each measured bubble beside the ideal, with
what this machine adds to it: ranks that wait for a CPU core, not only for their neighbour.

Picture (``--png PATH``): one row per schedule, two panels, ranks top to bottom, boxes coloured by
micro-batch (F plain, B hatched) and labelled F3 or B3.1 where the label fits (smaller, without
its letter, or the micro-batch alone where it does not; never touching a neighbour). Left, "executed with known stage costs":
each schedule run on blocks that sleep 20 ms a forward (as long a backward's B and W; the better
of 2 steps), so the boxes form the schedule's own shape: GPipe's staircase of forwards then of
backwards with a grey triangle of idle time at each end, 1F1B's short ramp then F and B
alternating, interleaved's half-width boxes and smaller grey corners. Right, "executed on this
machine": the GPT's last step, where ranks sharing cores leave grey gaps and stretched boxes no
schedule asks for. Each title carries the bubble section 4 prints (left: measured with known
costs, and the ideal).
"""
import argparse
import contextlib
import os
import textwrap
import time

import numpy as np

import minidist
from minidist.data import ByteTokenizer, get_batch, grammar_text, inputs_and_targets
from minidist.launch_check import check_launch
from minidist.train.stories import explaining
from minidist.model import GPT, GPTConfig
from minidist.optim import AdamW
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.pipeline import (Action, PipelineEngine, PipelineStage, ScheduleError, build_schedule,
                                        compute_spans, executed_timeline, format_timeline, gather_spans,
                                        split_micro_batches, validate)
from minidist.parallel.pipeline.known_costs import run_known_costs
from minidist.parallel.pipeline.timeline import Panel, draw_panels

CONFIG = GPTConfig(n_layer=8, n_head=2, n_embd=32, block_size=16)
BATCH, MICRO, STEPS = 16, 8, 5
TOKENS = ByteTokenizer().encode(grammar_text(20_000, seed=1))  # English-like sentences: a loss that falls
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))  # (name, v chunks per rank)
WIDTH = 100  # printed lines stay within this many characters
SLEEP_MS = 20  # --png: a stage's forward (and B, and W) in the run with known stage costs


def wrapped(text, width=WIDTH):
    """A :func:`format_timeline` drawing cut along the time axis into rows of at most ``width`` characters:
    each row is a window of time units ("t 0-17") with every rank's line for that window."""
    lines = text.split("\n")
    ranks = [line for line in lines if line.startswith("rank ")]
    prefix = len(ranks[0].split("| ")[0]) + 2  # "rank 0 | "
    cells = [line[prefix:] for line in ranks]
    cell = max(len(tok) for row in cells for tok in row.split()) + 1  # one time unit: label and a space
    units = max((len(row) + 1) // cell for row in cells)
    per_row = (width - prefix) // cell
    out = [line for line in lines if not line.startswith(("rank ", "bubble"))]
    for t0 in range(0, units, per_row):
        t1 = min(t0 + per_row, units)
        out.append(f"  t {t0}-{t1 - 1}:")
        out += [f"{line[:prefix]}{row[t0 * cell:t1 * cell].rstrip()}" for line, row in zip(ranks, cells)]
    return "\n".join(out + [line for line in lines if line.startswith("bubble")])


def schedules_as_data(p):
    """Print GPipe, 1F1B and interleaved 1F1B for p ranks (the simulator's ideal timelines)."""
    print(f"=== 1. schedules for p = {p} stages, m = {MICRO} micro-batches (F = 1 unit, B = 2) ===")
    print("(in flight: the most a rank has forwarded and not yet backwarded, so holds the activations of)")
    for name, v in SCHEDULES:
        timeline = validate(build_schedule(name, p, MICRO, v), p, MICRO, v)
        title = f"\n{name}" + (f", v = {v} chunks per rank (F3.1: micro-batch 3 through chunk 1)" if v > 1 else "")
        print(wrapped(format_timeline(timeline, title)))
        unit = f"(chunk, micro-batch) pairs; a chunk is 1/{v} of a rank's layers" if v > 1 else "micro-batches"
        print(f"in flight per rank: {timeline.peak_in_flight()} {unit}\n"
              f"formula bubble (p-1)/(v m + p-1) = {(p - 1) / (v * MICRO + p - 1):.3f}")
    print("\nrank 1's first actions in 1F1B:", " ".join(map(str, build_schedule("1f1b", p, MICRO)[1][:9])))

    print("\n=== 2. the validator catches a deadlock before anything is sent (1F1B, 4 stages) ===")
    broken = build_schedule("1f1b", 4, MICRO)
    for a in (Action("RECV_B", 0, 0), Action("B", 0, 0)):  # rank 0 runs B0 right after sending F0:
        broken[0].remove(a)  # it waits for a gradient while the next stages wait for its F1
    at = broken[0].index(Action("SEND_F", 0, 0)) + 1
    broken[0][at:at] = [Action("RECV_B", 0, 0), Action("B", 0, 0)]
    try:
        validate(broken, 4, MICRO)
    except ScheduleError as e:
        print(textwrap.fill(f"ScheduleError: {e}", WIDTH, subsequent_indent="  ", break_on_hyphens=False))


def train(world, mesh, name, v, explain):
    """STEPS AdamW steps with schedule ``name``; returns (losses, stage, engine, the last step's spans
    gathered on rank 0, this rank's numbers for the last step: wall s, CPU s, F+B s, send/recv s, messages)."""
    p = world.size
    stage = PipelineStage(GPT(CONFIG, seed=0, dtype="float64"), mesh.pp_rank, p, v)
    engine = PipelineEngine(stage, mesh, name, MICRO, v)
    optimizer = AdamW(stage.named_parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        world.trace.clear()
        optimizer.zero_grad()
        told = explaining(mesh, stage) if explain and step == 0 else contextlib.nullcontext()
        world.barrier()
        wall, cpu = time.perf_counter(), time.thread_time()  # thread_time: this rank's own CPU, threads or processes
        with told:  # --explain: each rank's account of the first step, what it holds and sends to whom
            losses.append(engine.forward_backward(split_micro_batches(get_batch(TOKENS, step, BATCH, 16), MICRO)))
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        engine.all_reduce_tied_grads()  # wte on stage 0 and lm_head on stage p-1 are one tied matrix
        optimizer.step()
    events = world.trace.events
    busy = sum(e.duration for e in events if e.kind == "compute" and e.op in ("forward", "backward"))
    p2p = [e for e in events if e.kind == "p2p"]  # sends and receives of activations and gradients
    mine = np.array([wall, cpu, busy, sum(e.duration for e in p2p), len(p2p)])
    return losses, stage, engine, gather_spans(world, compute_spans(world.trace)), mine


def one_process():
    """The same STEPS steps on one process, whole batch: losses and final weights."""
    reference = GPT(CONFIG, seed=0, dtype="float64")
    optimizer = AdamW(reference.named_parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        _, loss = reference(*inputs_and_targets(get_batch(TOKENS, step, BATCH, 16)))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, reference.state_dict()


def lesson(world, png=None, explain=False, local=False):
    p = world.size
    if world.rank == 0:
        schedules_as_data(p)
    mesh = DeviceMesh(world, pp=p)
    ref_losses, ref_state = one_process()
    if world.rank == 0:
        print(f"\n=== 3. training on the grammar corpus, {STEPS} steps with each schedule, against one process ===")
    runs, blocks = {}, {}
    for name, v in SCHEDULES:
        losses, stage, engine, spans, mine = train(world, mesh, name, v, explain and name == "1f1b")
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        for key, value in stage.state_dict().items():
            worst = max(worst, float(np.abs(value - ref_state[key]).max() / np.abs(ref_state[key]).max()))
        if world.all_reduce(np.array([float(worst > 1e-10)]))[0]:
            raise AssertionError(f"{name} differs from one process (rank {world.rank}: {worst:.2e})")
        runs[name] = (engine, spans, world.all_gather(mine.reshape(1, -1)))  # (p, 5) every rank's numbers
        if world.rank == 0:
            print(f"  {name:<11} losses " + " ".join(f"{x:.4f}" for x in losses) + f"  worst relative error {worst:.0e}")
            blocks[name] = stage.layers_per_stage
    # --png: each schedule on blocks that sleep SLEEP_MS (B and W as much): known stage costs, 2 steps
    known = {name: run_known_costs(world, CONFIG, name, MICRO, get_batch(TOKENS, 0, BATCH, 16), v, SLEEP_MS / 1e3)
             for name, v in SCHEDULES} if png else {}
    if world.rank != 0:
        return
    print(f"  blocks per stage: gpipe and 1f1b {blocks['1f1b']}, interleaved {blocks['interleaved']} (rank r: "
          "stages r, r + p)")
    print("every stage's weights and every loss equal one process's to 1e-10, for all three schedules")
    print("(the loss falls: the corpus is sentences; on uniform random bytes it would sit at ln 256 = 5.55)")

    print("\n=== 4. the bubble: measured (the last step, 1 - busy / step) against the simulator's ideal ===")
    executed = {name: executed_timeline(spans) for name, (_, spans, _) in runs.items()}
    for name, (engine, _, _) in runs.items():
        print(f"  {name:<11} measured {100 * executed[name].bubble():5.1f}%   ideal {100 * engine.ideal.bubble():5.1f}%"
              + (f"   with known stage costs {100 * known[name][0].bubble():5.1f}%" if known else ""))
    if known:
        print(textwrap.fill(f"(with known stage costs: the same schedules on blocks that sleep {SLEEP_MS} ms a "
                            "forward, as long a backward's B and W, the better of 2 steps: the engine's real "
                            "scheduler and messages, costs that do not compete for the CPU)", WIDTH,
                            initial_indent="  ", subsequent_indent="  "))
    numbers = runs["1f1b"][2]
    cores = len(os.sched_getaffinity(0))
    print(f"  1F1B's last step per rank ({p} ranks {'as threads of one process' if local else 'as processes'}, "
          f"{cores} cores):")
    print("    rank  step ms  in F and B ms  outside them ms  messages  CPU ms  CPU share of the step")
    for r, (wall, cpu, busy, _, count) in enumerate(numbers):
        print(f"    {r:>4} {1e3 * wall:8.1f} {1e3 * busy:14.1f} {1e3 * (wall - busy):16.1f} {int(count):9d} "
              f"{1e3 * cpu:7.1f} {100 * cpu / wall:9.0f}%")
    share = numbers[:, 1].sum() / numbers[:, 0].max()
    why = ("threads of one Python process take turns holding the interpreter (the GIL): at most one rank "
           "runs Python at a time, so a rank's F or B box also holds its wait for the others: the waits hide inside "
           "the boxes, the bubble can look ideal while the step takes longer than under mpiexec" if local else
           f"{p} processes share {cores} cores (at most {min(1, cores / p):.0%} of a core each when all want one): "
           "a rank with work may wait for a core, not only for its neighbour's message, and a rank waiting in "
           "MPI's receive may spin on a core another one needs")
    print(textwrap.fill(
        f"All ranks together used {share:.2f} cores' worth of CPU in the step (other jobs on this machine take "
        f"the rest). Why the measured bubble is not the ideal: {why}. And the micro-batches are tiny "
        f"({BATCH // MICRO} x 16 tokens, {CONFIG.n_embd} wide): each message and each action has a fixed cost "
        "about as large as the compute it carries. The ideal assumes neither: F and B of fixed length, "
        "messages for free. With real work per micro-batch and a core (or a GPU) per rank, measured meets "
        "ideal: blocks that only sleep do (--png runs them and draws both).", WIDTH,
        initial_indent="  ", subsequent_indent="  "))
    if png:
        draw(png, p, known, executed, local)
        print(f"each schedule, executed with known stage costs and executed on this machine, drawn in {png}")
    other = 4 if p == 2 else 2
    ideal_other = (other - 1) / (MICRO + other - 1)
    print(textwrap.dedent(f"""
        Try: {f"--local {other}" if local else f"mpiexec -n {other}"}: the ideal 1F1B bubble becomes (p-1)/(m+p-1) = {100 * ideal_other:.1f}% and the in-flight
             counts [{", ".join(str(min(other - r, MICRO)) for r in range(other))}] (1F1B holds min(p - r, m) micro-batches).
             MICRO = 16: 1F1B's ideal bubble at p = {p} falls to {100 * (p - 1) / (16 + p - 1):.1f}%, GPipe's in flight grows to
             [{", ".join(["16"] * p)}].
        Pipeline lesson on {p} ranks: GPipe, 1F1B and interleaved = one process. All checks passed."""))


def draw(path, p, known, executed, local):
    """One row per schedule: left, the step executed with known stage costs (the schedule itself),
    right, this run's last step of the GPT, each rank's forward, backward and idle time added up
    (its boxes are slivers between waits for cores and messages); titles carry the bubbles printed
    in section 4."""
    cores = len(os.sched_getaffinity(0))
    ranks = f"{p} ranks as threads of one process" if local else f"{p} processes on {cores} cores"
    rows = [[Panel(known[name][0], f"{name}, executed with known stage costs: bubble "
                   f"{100 * known[name][0].bubble():.1f}%, ideal {100 * known[name][1].bubble():.1f}%", 1e3),
             Panel(executed[name], f"{name}, executed on this machine (the GPT, last step): bubble "
                   f"{100 * executed[name].bubble():.1f}%", 1e3, summed=True)] for name, _ in SCHEDULES]
    draw_panels(path, rows, f"Pipeline schedules on {p} ranks, m = {MICRO} micro-batches. Left: blocks that sleep "
                f"{SLEEP_MS} ms a forward (a backward's B and W as much each; the better of 2 steps): the schedule "
                "as it is.\n"
                f"Right: the GPT trained above ({ranks}), each rank's step added up: its own timeline interleaves "
                "the actions with waits for cores and messages", "milliseconds of the step", widths=[2.6, 1])


def main():
    ap = argparse.ArgumentParser(description="Lesson 4: pipeline parallelism.")
    ap.add_argument("--local", type=int, metavar="N", help="run N ranks as threads in this process")
    ap.add_argument("--png", help="draw each schedule's executed and ideal timelines into this PNG")
    ap.add_argument("--explain", action="store_true", help="print each rank's account of 1F1B's first step")
    args = ap.parse_args()
    check_launch(ap, args, ranks=(2, 4), alone=4)  # 8 blocks over p ranks x 2 virtual stages
    if args.local:
        minidist.run_local(lambda world: lesson(world, args.png, args.explain, local=True), args.local)
    else:
        lesson(minidist.init(), args.png, args.explain)


if __name__ == "__main__":
    main()
