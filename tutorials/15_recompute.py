"""Lesson 15: activation recomputation (gradient checkpointing): memory against compute.

    mpiexec -n 2 python tutorials/15_recompute.py                 (or alone: 2 threads)
    python tutorials/15_recompute.py --local 2 --png rc.png       (also draw memory and time)

Between a block's forward and its backward, autograd keeps what the backward will need: the
LayerNorms' normalised inputs, every Linear's input, q, k, v, the attention probabilities
(B, nh, T, T), the MLP's (B, T, 4C) hidden activations... (memory.layer_activation_terms lists them).
For a long sequence that is far more than the weights. Recomputation (Chen et al. 2016; PyTorch's
``torch.utils.checkpoint``, Megatron's ``--recompute-granularity full``) keeps only each block's
INPUT (B, T, C): minidist/nn/recompute.py runs the block's forward under ``no_grad`` (nothing
saved), and when backward reaches the block it runs the forward again, this time building the graph,
and back-propagates through it. Same operations on the same values: the same gradients, bit for bit.

    kept per block      all the activations  ->  the block input, B x T x C x itemsize
    peak in backward    all blocks' graphs   ->  every block's input + ONE block's graph, rebuilt
    compute             F + B                ->  F + B + F_blocks (one more forward of the blocks)

The rule of thumb: backward costs about two forwards (a matmul's backward is two matmuls), so a step
is ~3F and full recompute adds one F: ~33% more compute, 8N instead of 6N FLOPs per token
(plan/timing.py). Selective recompute (Korthikanti et al.) re-runs only the attention core, whose
activations grow with T^2 and cost few FLOPs: most of the memory for ~2% more compute (the planner
knows it; minidist's trainer has only the full kind, ``--recompute``).

  1. Memory: the bytes one block keeps, measured from the live autograd graph
     (accounting.activation_bytes on models of L and L-1 blocks: the difference is one block),
     without and with recomputation, next to the planner's terms, to the byte.
  2. Compute: the blocks' forwards counted (a counter around each block's own forward): with
     recomputation each block runs once more, in backward, last block first (asserted). Then forward
     and backward timed, without and with (median of REPEATS), the extra time against one forward:
     measured on a shared machine, so printed, never asserted.
  3. The gradients with recomputation equal those without, bitwise (one process, float64).
  4. Composition: tensor parallelism (tp 2) with recomputation trains to one process's losses and
     weights; the recomputed forward re-runs its collectives: 2 more all-reduces per block a step.
"""
import argparse
import time

import numpy as np

import minidist
from minidist.allocator import keep_freed_memory
from minidist.autograd import Tensor, is_grad_enabled
from minidist.launch_check import check_launch
from minidist.model import GPT, GPTConfig
from minidist.inspect.accounting import activation_bytes
from minidist.parallel.whole_model.consolidate import consolidated_state_dict
from minidist.parallel.mesh import DeviceMesh
from minidist.nn.recompute import checkpoint, recompute_blocks
from minidist.parallel.step import train_step
from minidist.plan.layout import RunSpec
from minidist.plan.memory import layer_activation_terms
from minidist.plan.models import from_gpt_config
from minidist.train.build import build_parallel, world_of_one
from minidist.train.config import TrainConfig

CONFIG = GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=64)
BATCH, DTYPE, REPEATS = 8, "float64", 7
TOKENS = np.random.default_rng(0).integers(0, 256, (BATCH, CONFIG.block_size + 1))  # (B, T+1)
IDX, TARGETS = np.ascontiguousarray(TOKENS[:, :-1]), np.ascontiguousarray(TOKENS[:, 1:])  # (B, T), (B, T)
STEPS, LR = 3, 0.1


def gpt(recompute, n_layer=CONFIG.n_layer, calls=None):
    """The lesson's GPT, its blocks recomputed if ``recompute``; with a list ``calls``, each block's own
    forward first appends the block's index to it (so a recomputed forward is counted too)."""
    model = GPT(GPTConfig(**{**vars(CONFIG), "n_layer": n_layer}), seed=1, dtype=DTYPE)
    for i, block in enumerate(model.transformer.h if calls is not None else []):
        def counted(x, *rest, forward=block.forward, i=i):  # rest: the block's dropout (None here)
            calls.append(i)
            return forward(x, *rest)  # (B, T, C)
        object.__setattr__(block, "forward", counted)
    if recompute:
        recompute_blocks(model)
    return model


def kept_bytes(recompute, n_layer):
    """Bytes the graph of one forward keeps for backward (the weights not counted)."""
    model = gpt(recompute, n_layer)
    _, loss = model(IDX, TARGETS)
    return activation_bytes(loss, exclude=[p.data for p in model.parameters()])


def rebuilt_bytes():
    """Bytes of each block's graph as backward rebuilds it: recompute_blocks by hand (checkpoint of
    the block's forward), with the forward wrapped to measure the graph it builds when grad is on."""
    model, rebuilt = gpt(False), []
    weights = [p.data for p in model.parameters()]
    for block in model.transformer.h:
        def measuring(x, *rest, forward=block.forward):  # rest: the block's dropout (None here)
            out = forward(x, *rest)  # (B, T, C)
            if is_grad_enabled():  # the second run, inside backward: its graph lives until its backward ends
                rebuilt.append(activation_bytes(out, exclude=weights))
            return out
        object.__setattr__(block, "forward", lambda x, *rest, fn=measuring: checkpoint(fn, x, *rest))
    _, loss = model(IDX, TARGETS)
    loss.backward()
    return rebuilt


def part1():
    L = CONFIG.n_layer
    B, T, C = BATCH, CONFIG.block_size, CONFIG.n_embd
    print(f"=== 1. memory: what one block keeps for backward (B={B}, T={T}, C={C}, {CONFIG.n_head} heads, {DTYPE}) ===")
    spec = from_gpt_config(CONFIG)
    measured, planned, totals = {}, {}, {}
    for recompute in (False, True):
        measured[recompute] = kept_bytes(recompute, L) - kept_bytes(recompute, L - 1)  # one block
        totals[recompute] = kept_bytes(recompute, L)
        run = RunSpec(seq=T, micro_batch_size=B, dtype=DTYPE, recompute="full" if recompute else "none")
        terms = layer_activation_terms(spec, run)
        planned[recompute] = sum(v for _, v in terms)
        print(f"  {'with' if recompute else 'without'} recomputation, the planner's terms:")
        for what, v in terms:
            print(f"    {what:<60}{v / 1024:9.1f} KiB")
        print(f"    {'= planned':<60}{planned[recompute] / 1024:9.1f} KiB;  measured {measured[recompute] / 1024:.1f} KiB")
        assert measured[recompute] == planned[recompute], (recompute, measured[recompute], planned[recompute])
    assert measured[True] == B * T * C * 8  # the block input, float64
    ratio = measured[False] / measured[True]
    print(f"  a block keeps {ratio:.1f}x less: B x T x C x 8 = {measured[True]:,} B instead of {measured[False]:,} B")
    print(f"  the whole model ({L} blocks + embeddings + head): {totals[False] / 1024:.1f} KiB -> "
          f"{totals[True] / 1024:.1f} KiB kept from forward to backward;")
    rebuilt = rebuilt_bytes()
    print("  in backward each block's graph is rebuilt, one at a time (last block first): "
          + ", ".join(f"{v / 1024:.1f}" for v in rebuilt) + " KiB,")
    print(f"  freed when its backward ends: the peak is about {totals[True] / 1024:.1f} + {max(rebuilt) / 1024:.1f} = "
          f"{(totals[True] + max(rebuilt)) / 1024:.1f} KiB instead of {totals[False] / 1024:.1f} KiB")
    assert rebuilt == [measured[False]] * L  # the same graph the block would have kept
    return measured, totals


def block_forwards(recompute):
    """Which blocks ran their forward during one forward, and during the backward after it (indices,
    in order)."""
    calls = []
    model = gpt(recompute, calls=calls)
    _, loss = model(IDX, TARGETS)
    in_forward = len(calls)
    loss.backward()
    return calls[:in_forward], calls[in_forward:]


def timed(model):
    """Median seconds of (forward, backward) over REPEATS, after one warm-up step."""
    fwd, bwd = [], []
    for k in range(REPEATS + 1):
        model.zero_grad()
        start = time.perf_counter()
        _, loss = model(IDX, TARGETS)
        middle = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        if k:
            fwd.append(middle - start)
            bwd.append(end - middle)
    return float(np.median(fwd)), float(np.median(bwd))


def blocks_forward_seconds():
    """Median seconds of the blocks' forward alone (with grad: as backward re-runs it)."""
    model = gpt(False)
    x = Tensor(np.random.default_rng(0).standard_normal((BATCH, CONFIG.block_size, CONFIG.n_embd)))  # (B, T, C)
    seconds = []
    for k in range(REPEATS + 1):
        start = time.perf_counter()
        h = x
        for block in model.transformer.h:
            h = block(h)  # (B, T, C)
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds[1:]))


def part2():
    L = CONFIG.n_layer
    print(f"\n=== 2. compute: one forward and backward (one process, {DTYPE}) ===")
    counted = {recompute: block_forwards(recompute) for recompute in (False, True)}
    print(f"  {'block forwards, counted':<25}{'in forward':<20}in backward")
    for recompute, (fwd, bwd) in counted.items():
        print(f"    {'with recomputation' if recompute else 'without':<23}{' '.join(f'h.{i}' for i in fwd):<20}"
              + (" ".join(f"h.{i}" for i in bwd) + " (last block first)" if bwd else "-"))
    assert counted[False] == (list(range(L)), []), counted[False]
    assert counted[True] == (list(range(L)), list(range(L))[::-1]), counted[True]
    print(f"  = one more forward of each of the {L} blocks per step, run in backward; the embeddings and the head "
          f"are not recomputed")
    print(f"  timed (median of {REPEATS}; a measurement on a shared machine, so it varies from run to run):")
    times = {recompute: timed(gpt(recompute)) for recompute in (False, True)}
    (f, b), (f_r, b_r) = times[False], times[True]
    f_blocks = blocks_forward_seconds()
    print(f"  {'':<26}{'forward':>10}{'backward':>10}{'total':>10}")
    for recompute, (fw, bw) in times.items():
        print(f"  {'with recomputation' if recompute else 'without':<26}{1e3 * fw:8.1f}ms{1e3 * bw:8.1f}ms"
              f"{1e3 * (fw + bw):8.1f}ms")
    extra = (f_r + b_r) - (f + b)
    print(f"  backward grew by {1e3 * (b_r - b):.1f} ms: the blocks' forward run again (timed alone: "
          f"{1e3 * f_blocks:.1f} ms; the embeddings\n  and the head are not recomputed); the forward changed by "
          f"{1e3 * (f_r - f):+.1f} ms (under no_grad it builds no graph: usually a little cheaper)")
    print(f"  extra time {1e3 * extra:.1f} ms = {extra / f:.2f} forwards: {100 * extra / (f + b):.0f}% more per step. "
          f"Rule of thumb: backward = 2 forwards,\n  so +F / (F + 2F) = 33%; here backward = {b / f:.2f} forwards and "
          f"the blocks {100 * f_blocks / f:.0f}% of the forward: F_blocks / (F + B) = {100 * f_blocks / (f + b):.0f}%")
    return times


def part3():
    print("\n=== 3. the gradients with recomputation = without (one process) ===")
    grads, losses = [], []
    for recompute in (False, True):
        model = gpt(recompute)
        _, loss = model(IDX, TARGETS)
        loss.backward()
        losses.append(loss.item())
        grads.append({name: p.grad for name, p in model.named_parameters()})
    same = all(np.array_equal(grads[0][n], grads[1][n]) for n in grads[0])
    print(f"  loss {losses[0]:.12f} vs {losses[1]:.12f}; {len(grads[0])} gradients equal bitwise "
          f"(np.array_equal): {same}")
    assert losses[0] == losses[1] and same


def layout_of(n):
    """(dp, tp) for n ranks: tp 2 when n is even (the collectives a recomputed block repeats)."""
    return (n // 2, 2) if n % 2 == 0 else (n, 1)


def train(world, recompute, dp, tp):
    """STEPS SGD steps of CONFIG on the (dp, tp) mesh of ``world``: (losses, full weights, all-reduces
    of the tp group in the last step)."""
    cfg = TrainConfig(**{k: getattr(CONFIG, k) for k in ("n_layer", "n_head", "n_embd", "block_size")},
                      batch_size=BATCH, dtype=DTYPE, optimizer="sgd", lr=LR, dp=dp, tp=tp,
                      recompute="full" if recompute else "none")
    mesh = DeviceMesh(world, dp=dp, pp=1, tp=tp)
    model, state, _ = build_parallel(cfg, mesh)  # state: the optimizer and DDP's buckets (parallel/state.py)
    rows = TOKENS[np.array_split(np.arange(BATCH), dp)[mesh.dp_rank]]  # (B/dp, T+1) this replica's rows
    losses = []
    for _ in range(STEPS):
        with world.trace.capture() as events:
            loss, _ = train_step(model, state, rows, LR, 1.0, mesh=mesh, trace=world.trace)
        losses.append(loss)
    tp_all_reduces = sum(e.op == "all_reduce" and e.group == mesh.tp_group.name for e in events)
    return losses, consolidated_state_dict(model, mesh), tp_all_reduces


def part4(world):
    lead = world.rank == 0
    dp, tp = layout_of(world.size)
    if lead:
        print(f"\n=== 4. composition: dp {dp} x tp {tp} on {world.size} ranks, with and without recomputation ===")
    runs = {recompute: train(world, recompute, dp, tp) for recompute in (False, True)}
    if not lead:
        return
    ref_losses, ref_weights, _ = train(world_of_one(), False, 1, 1)
    for recompute, (losses, weights, _) in runs.items():
        err = max(np.abs(weights[k] - v).max() / np.abs(v).max() for k, v in ref_weights.items())
        print(f"  {'with recompute' if recompute else 'without':<15} losses" + "".join(f" {x:.10f}" for x in losses)
              + f"; weights vs one process: max relative error {err:.1e}")
        assert np.allclose(losses, ref_losses, rtol=1e-10, atol=0) and err <= 1e-10
    same = runs[True][0] == runs[False][0] and all(np.array_equal(runs[True][1][k], runs[False][1][k])
                                                    for k in ref_weights)
    print(f"  with recompute = without, bitwise (losses and weights): {same}")
    assert same
    without, with_ = runs[False][2], runs[True][2]
    if tp > 1:
        print(f"  tp all-reduces in one step: {without} without, {with_} with recompute: "
              f"{(with_ - without) // CONFIG.n_layer} more per block (its forward's 2 run again in backward)")
        assert with_ - without == 2 * CONFIG.n_layer


def draw(path, measured, totals, times):
    """Left: the bytes kept per block and in all; right: forward and backward time, without and with."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (mem, clock) = plt.subplots(1, 2, figsize=(12, 4.4))
    names = ["without", "with recompute"]
    x = np.arange(2)
    mem.bar(x - 0.2, [measured[False] / 1024, measured[True] / 1024], 0.4, color="tab:orange", label="one block")
    mem.bar(x + 0.2, [totals[False] / 1024, totals[True] / 1024], 0.4, color="tab:blue",
            label=f"the whole model ({CONFIG.n_layer} blocks, head, embeddings)")
    mem.bar(x[1] + 0.2, measured[False] / 1024, 0.4, bottom=totals[True] / 1024, color="none", edgecolor="tab:blue",
            hatch="//", label="+ one block's graph, rebuilt in backward (the peak)")
    tops = [measured[False], measured[True], totals[False], totals[True] + measured[False]]
    for xi, v in zip(list(x - 0.2) + list(x + 0.2), tops):
        mem.text(xi, v / 1024, f"{v / 1024:.0f}", ha="center", va="bottom", fontsize=8)
    mem.set_xticks(x, names)
    mem.set_ylabel("KiB kept from forward to backward")
    mem.set_title("memory: activations kept (measured)", fontsize=10)
    mem.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), fontsize=8, frameon=False)
    fw = [1e3 * times[False][0], 1e3 * times[True][0]]
    bw = [1e3 * times[False][1], 1e3 * times[True][1]]
    clock.bar(x, fw, 0.5, color="tab:green", label="forward")
    again = bw[1] - bw[0]  # what backward grew by: the blocks' forward, run again
    clock.bar(x, [bw[0], bw[0]], 0.5, bottom=fw, color="tab:purple", label="backward")
    clock.bar(x[1], again, 0.5, bottom=fw[1] + bw[0], color="tab:olive",
              label="backward's growth: the blocks' forward again")
    for xi, f, b in zip(x, fw, bw):
        clock.text(xi, f + b, f"{f + b:.1f} ms", ha="center", va="bottom", fontsize=8)
    clock.set_xticks(x, names)
    clock.set_ylabel("ms per step (median)")
    clock.set_title("compute: forward + backward time (measured)", fontsize=10)
    clock.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), fontsize=8, frameon=False)
    fig.suptitle(f"Activation recomputation: B={BATCH}, T={CONFIG.block_size}, C={CONFIG.n_embd}, {DTYPE}",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"\nMemory and time drawn in {path}")


def lesson(world, png=None):
    lead = world.rank == 0
    if lead:
        measured, totals = part1()
        times = part2()
        part3()
    world.barrier()
    part4(world)
    if lead:
        if png:
            draw(png, measured, totals, times)
        print("\nTry:")
        print("  1. CONFIG with block_size=128. Expect a block to keep 12816.0 KiB without recomputation (2.2x: the")
        print("     attention probabilities grow about with T^2, the rest with T) and 512.0 KiB with it (2x: B x T x C),")
        print("     25.0x less; the whole model 54362.0 -> 5146.0 KiB; the extra time still the blocks' forward, ~35%.")
        print("  2. --local 4 (dp 2 x tp 2). Expect the same losses and weights, and still 22 -> 30 tp all-reduces.")
        print(f"\nRecomputation keeps {measured[False] / measured[True]:.1f}x less per block for one more forward "
              f"of each block (here {100 * ((sum(times[True]) / sum(times[False])) - 1):+.0f}% time); gradients "
              "bitwise equal; composes with tensor parallelism.\nAll checks passed.")


def main():
    keep_freed_memory()  # as the trainer does: steps reuse their memory instead of faulting in fresh pages
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local", type=int, nargs="?", const=2, metavar="N", help="run N ranks as threads (default 2)")
    ap.add_argument("--png", help="draw the memory kept and the time, without and with recomputation, into this PNG")
    args = ap.parse_args()
    check_launch(ap, args, ranks=(1, 2, 4), alone=2)  # dp x tp: tp 2 splits 4 heads
    if args.local:
        minidist.run_local(lambda world: lesson(world, args.png), args.local)
    else:
        minidist.run_anywhere(lambda world: lesson(world, args.png), threads=2)


if __name__ == "__main__":
    main()
