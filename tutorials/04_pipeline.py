"""Lesson 4: pipeline parallelism — stages, micro-batches, the 1F1B schedule, the bubble, the picture.

    mpiexec -n 4 python tutorials/04_pipeline.py            # 4 pipeline stages, over MPI
    python tutorials/04_pipeline.py --local 4               # 4 ranks as threads in one process
    python tutorials/04_pipeline.py --local 2 --png pp.png  # also draw executed vs ideal timelines

A model too big for one device is cut into consecutive STAGES, one per rank: the first embeds, the
last computes the loss. Rank r can only start on a batch once rank r-1 has sent it its activations,
and backward runs the other way. With one batch, all ranks but one would be idle at any time. So the
batch is cut into m MICRO-BATCHES that follow each other through the pipe like cars on an assembly
line. The idle time left at the start and the end of each step is the BUBBLE: (p-1)/(m+p-1) of the
step for p stages.

GPipe runs all m forwards, then all backwards: every rank holds the activations of m micro-batches.
1F1B starts backwards as soon as the last stage can, then alternates one forward, one backward: the
same bubble, but rank r holds at most p - r micro-batches. Interleaved 1F1B gives each rank v smaller
chunks, and the bubble shrinks by v. (Lesson 12 splits backward into B and W and fills the bubble
with W: ZB-H1 and ZB-V.)

In minidist a schedule is DATA: a list of actions per rank, validated (and simulated over all ranks)
before anything is sent. This lesson prints schedules, shows the validator catching a deadlock, then
trains a small GPT with 1F1B and checks it against one process on the whole batch.
"""
import argparse
import contextlib

import numpy as np

import minidist
from minidist.explain import explaining
from minidist.data import get_batch, inputs_and_targets
from minidist.model import GPT, GPTConfig
from minidist.optim import AdamW
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.pipeline import (Action, PipelineEngine, PipelineStage, ScheduleError, build_schedule,
                                        compute_spans, draw_timelines, executed_timeline, format_timeline,
                                        gather_spans, split_micro_batches, validate)

CONFIG = GPTConfig(n_layer=8, n_head=2, n_embd=32, block_size=16)
BATCH, MICRO, STEPS = 16, 8, 5
TOKENS = np.random.default_rng(0).integers(0, 256, size=20_000)


def schedules_as_data(p):
    """Print GPipe, 1F1B and interleaved 1F1B for p ranks (the simulator's ideal timelines)."""
    print(f"=== 1. schedules for p = {p} stages, m = {MICRO} micro-batches (F = 1 unit, B = 2) ===")
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        timeline = validate(build_schedule(name, p, MICRO, v), p, MICRO, v)
        print(format_timeline(timeline, f"\n{name}" + (f", v = {v} chunks per rank (F3.1: chunk 1)" if v > 1 else "")))
        print(f"in flight per rank: {timeline.peak_in_flight()}   formula bubble (p-1)/(v m + p-1) = "
              f"{(p - 1) / (v * MICRO + p - 1):.3f}")
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
        print(f"ScheduleError: {e}")


def lesson(world, png=None, explain=False):
    p = world.size
    if world.rank == 0:
        schedules_as_data(p)
    mesh = DeviceMesh(world, pp=p)
    stage = PipelineStage(GPT(CONFIG, seed=0, dtype="float64"), mesh.pp_rank, p)
    engine = PipelineEngine(stage, mesh, "1f1b", MICRO)
    optimizer = AdamW(stage.named_parameters(), lr=1e-2)
    if world.rank == 0:
        print(f"\n=== 3. training with 1F1B: blocks per stage {stage.layers_per_stage} (split by cost: the "
              f"last stage also runs the LM head) ===")
    losses = []
    for step in range(STEPS):
        world.trace.clear()
        optimizer.zero_grad()
        told = explaining(mesh, stage, activation_shape=(BATCH // MICRO, 16, CONFIG.n_embd)) \
            if explain and step == 0 else contextlib.nullcontext()
        with told:  # --explain: each rank's account of the first step, what it holds and sends to whom
            losses.append(engine.forward_backward(split_micro_batches(get_batch(TOKENS, step, BATCH, 16), MICRO)))
        engine.all_reduce_tied_grads()  # wte on stage 0 and lm_head on stage p-1 are one tied matrix
        optimizer.step()
    spans = gather_spans(world, compute_spans(world.trace))  # the last step's F and B boxes, on rank 0

    reference = GPT(CONFIG, seed=0, dtype="float64")
    ref_opt = AdamW(reference.named_parameters(), lr=1e-2)
    ref_losses = []
    for step in range(STEPS):
        ref_opt.zero_grad()
        _, loss = reference(*inputs_and_targets(get_batch(TOKENS, step, BATCH, 16)))
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    for name, value in stage.state_dict().items():
        expected = reference.state_dict()[name]
        worst = max(worst, float(np.abs(value - expected).max() / np.abs(expected).max()))
    bad = world.all_reduce(np.array([float(worst > 1e-10)]))[0]
    if bad:
        raise AssertionError(f"pipeline differs from one process (rank {world.rank}: {worst:.2e})")
    if world.rank == 0:
        print("losses:", " ".join(f"{x:.4f}" for x in losses))
        print("every stage's weights and every loss equal one process's to 1e-10 relative")
        executed = executed_timeline(spans)
        print(f"\n=== 4. the bubble: measured {100 * executed.bubble():.1f}% of the last step idle, "
              f"ideal {100 * engine.ideal.bubble():.1f}% ===")
        if png:
            draw_timelines(png, executed, engine.ideal, f"1F1B, p={p}, m={MICRO}")
            print(f"executed vs ideal timeline drawn in {png}")


def main():
    ap = argparse.ArgumentParser(description="Lesson 4: pipeline parallelism.")
    ap.add_argument("--local", type=int, metavar="N", help="run N ranks as threads in this process")
    ap.add_argument("--png", help="draw the executed and ideal timelines into this PNG")
    ap.add_argument("--explain", action="store_true", help="print each rank's account of the first step")
    args = ap.parse_args()
    if args.local is not None and args.local < 2:
        ap.error("the lesson needs at least 2 ranks")
    if args.local:
        minidist.run_local(lambda world: lesson(world, args.png, args.explain), args.local)
    else:
        lesson(minidist.init(), args.png, args.explain)


if __name__ == "__main__":
    main()
