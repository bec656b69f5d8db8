"""Lesson 3: tensor parallelism (Megatron-LM), then sequence parallelism.

    mpiexec -n 2 python tutorials/03_tensor_parallel.py      # or -n 4, over MPI
    python tutorials/03_tensor_parallel.py --local 4         # 4 threads in one process

One GPT is cut across the ranks of a tensor-parallel group: every rank holds a slice of every big
matrix and computes with it, and the ranks add their partial results where the math needs a sum.

  1. Which shard each rank holds: attention split by heads (c_attn's q, k, v keep whole heads),
     the MLP's c_fc by output columns and both c_proj by input rows, the vocabulary by rows (padded
     to a multiple of the group size). LayerNorms, position embeddings and c_proj biases are copies.
  2. Where the ranks talk: Megatron's f (identity forward, all-reduce backward) enters attention and
     the MLP, g (all-reduce forward, identity backward) leaves them, so a layer costs 2 all-reduces
     forward and 2 backward; the vocab-parallel cross-entropy adds 3 all-reduces of one number per
     token. Read from the trace of one training step, not from a formula.
  3. Sequence parallelism: the same step with the activations between the layers cut along the
     sequence; every all-reduce of activations becomes an all-gather plus a reduce-scatter.
  4. The proof: loss and every gradient, joined from the shards, equal one process's (float64).
"""
import argparse
from collections import Counter

import numpy as np

import minidist
from minidist.model import GPT, GPTConfig
from minidist.parallel.tensor_parallel import sync_sequence_parallel_grads, tp_layout, unshard
from minidist.parallel.tp_model import build_tp_gpt

CONFIG = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=4, n_embd=8)  # vocab 11: padded
B, T = 2, 8


def batch():
    rng = np.random.default_rng(0)
    return rng.integers(0, CONFIG.vocab_size, (B, T)), rng.integers(0, CONFIG.vocab_size, (B, T))


def holdings(group, model):
    """Rank 0 prints, per parameter of block 0 and the embeddings, what every rank holds."""
    if group.rank == 0:
        print(f"=== 1. who holds what: GPT(vocab {CONFIG.vocab_size}, {CONFIG.n_head} heads, "
              f"C={CONFIG.n_embd}) over {group.size} ranks ===")
    for name, p in model.named_parameters():
        if ".h.1." in name:
            continue  # block 1 is split exactly like block 0
        shapes = group.all_gather(np.array([p.shape + (1,) * (2 - p.ndim)]))  # (n, 2): every rank's shape
        if group.rank == 0:
            per_rank = "  ".join(f"r{r}:{tuple(int(s) for s in shape[:p.ndim])}" for r, shape in enumerate(shapes))
            print(f"  {name:<34} {tp_layout(name):<10} {per_rank}")
    if group.rank == 0:
        heads = CONFIG.n_head // group.size
        print(f"  c_attn rank r: heads {heads}r..{heads}r+{heads - 1} of q, then of k, then of v;"
              f" wte rows beyond {CONFIG.vocab_size - 1} are zero padding")


def one_step(group, model):
    """Forward (piece by piece along the model's cut: embed, each block, head) and backward, each piece
    recorded as a compute span in the trace. Returns the loss and the collectives, each labelled with
    the innermost span it ran in."""
    idx, targets = batch()
    trace = group.trace
    trace.clear()
    with trace.record("forward", kind="compute"):
        with trace.record("embed", kind="compute"):
            x = model.embed(idx)  # (B, T, C), or (B, T/n, C) under sequence parallelism
        for i, block in enumerate(model.transformer.h):
            with trace.record(f"h.{i}", kind="compute"):
                x = block(x)
        with trace.record("head", kind="compute"):
            _, loss = model.head(x, targets)
    with trace.record("backward", kind="compute"):
        loss.backward()
    with trace.record("sync_sequence_parallel_grads", kind="compute"):
        sync_sequence_parallel_grads(model, group)
    spans = [e for e in trace.events if e.kind == "compute"]
    labelled = []
    for e in trace.events:
        if e.kind == "collective":
            inside = [s for s in spans if s.start <= e.start and e.end <= s.end]
            labelled.append((max(inside, key=lambda s: s.start).op, e))
    return loss, labelled


def describe(group, title, labelled):
    """Rank 0 prints every collective of the step: where it ran, op, bytes, what the bytes are."""
    if group.rank != 0:
        return
    activation, per_token = B * T * CONFIG.n_embd * 8, B * T * 8
    sizes = {activation: "(B, T, C) activations", per_token: "(B, T) one number per token"}
    print(f"\n=== {title} ===")
    for where, e in labelled:
        print(f"  {where:<29} {e.op:<15} {e.nbytes:>6} B  {sizes.get(e.nbytes, '')}")
    print("  counts: " + ", ".join(f"{where}: {dict(Counter(e.op for w, e in labelled if w == where))}"
                                   for where in dict.fromkeys(w for w, _ in labelled)))


def check(group, model, loss, title):
    """Join the gradient shards (all-gather over the group) and compare with one process."""
    ref = GPT(CONFIG, seed=0, dtype="float64")
    _, ref_loss = ref(*batch())
    ref_loss.backward()
    worst = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        shards = group.all_gather(np.ascontiguousarray(p.grad).reshape(1, -1))  # (n, local size)
        full = unshard(name, [s.reshape(p.shape) for s in shards], CONFIG.vocab_size)
        worst = max(worst, np.abs(full - q.grad).max() / np.abs(q.grad).max())
    if worst > 1e-10:
        raise AssertionError(f"rank {group.rank}: {title} differs from one process by {worst:.2e}")
    if group.rank == 0:
        print(f"  {title}: loss {loss.item():.12f} = one process's; worst relative error over the loss and "
              f"all gradients {worst:.1e}")


def lesson(world):
    plain = build_tp_gpt(CONFIG, seed=0, dtype="float64", tp_group=world)
    holdings(world, plain)
    loss, labelled = one_step(world, plain)
    describe(world, "2. one step, tensor parallel: g leaves the embedding, attention and MLP (forward), "
                    "f enters\n    attention, MLP and the head (backward, in reverse); 3 small all-reduces in the loss",
             labelled)
    sp = build_tp_gpt(CONFIG, seed=0, dtype="float64", tp_group=world, sequence_parallel=True)
    sp_loss, sp_labelled = one_step(world, sp)
    describe(world, "3. the same step with sequence parallelism: all-gather where f was, reduce-scatter "
                    "where g was;\n    LayerNorm and residual gradients of my tokens only, summed at the end",
             sp_labelled)
    if world.rank == 0:
        print("\n=== 4. against one process ===")
    check(world, plain, loss, "tensor parallel")
    check(world, sp, sp_loss, "tensor + sequence parallel")


def main():
    p = argparse.ArgumentParser(description="Lesson 3: tensor parallelism and sequence parallelism.")
    p.add_argument("--local", type=int, metavar="N", help="run N ranks as threads in this process (N = 1, 2, 4)")
    args = p.parse_args()
    if args.local:
        minidist.run_local(lesson, args.local)
    else:
        lesson(minidist.init(backend="ring"))


if __name__ == "__main__":
    main()
