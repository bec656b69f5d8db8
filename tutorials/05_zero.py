"""Lesson 5: ZeRO. Who holds which bytes at each stage, what it costs to send, and proof that it
trains exactly like one process.

    mpiexec -n 4 python tutorials/05_zero.py          (or: python tutorials/05_zero.py, 4 threads)

Plain data parallelism keeps on each of N ranks the full parameters P, gradients G and optimizer
state O. ZeRO cuts them by offset into N shards (minidist/parallel/flat_buffer.py):

    stage 1: P + G + O/N        optimizer state sharded; gradients reduce-scattered, shards updated,
                                parameters all-gathered
    stage 2: P + (G + O)/N      the same, each unit reduce-scattered during backward, full gradients dropped
    stage 3: (P + G + O)/N      parameters too: each module gathers them before its forward and again
                                before its backward (saved-tensor hooks hand the gathered weights back
                                to the graph: activations are kept, nothing is recomputed), frees them after

For every stage this script trains 5 steps of AdamW, prints the bytes rank 0 holds (measured from the
live arrays) next to the formula, and the bytes it sent (from its trace), and checks the final weights
against one process on the full batch. Lesson 9 does the same in float16 with float32 masters
(the paper's 2 + 2 + 12 bytes per parameter) and shows a skipped overflow.
"""
import numpy as np

import minidist
from minidist.data import get_batch, inputs_and_targets
from minidist.model import GPT, GPTConfig
from minidist.optim import AdamW, clip_grad_norm
from minidist.parallel.accounting import bus_bytes
from minidist.parallel.zero import ZeroOptimizer

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_embeddings=False)
BATCH, STEPS, LR = 8, 5, 1e-2
TOKENS = np.random.default_rng(0).integers(0, 64, size=4000)


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


def lesson(group):
    reference = one_process()
    lines = []
    for stage in (0, 1, 2, 3):
        model = GPT(CONFIG, seed=0, dtype="float64")
        zero = ZeroOptimizer(model, group, stage, "adamw", lr=LR, weight_decay=0.1)
        rows = np.array_split(np.arange(BATCH), group.size)[group.rank]  # this rank's rows
        group.trace.clear()
        for step in range(STEPS):
            idx, targets = batch(step)
            zero.zero_grad()
            model(idx[rows], targets[rows])[1].backward()
            zero.clip_grad_norm(1.0)
            if step == 0:
                held, formula = zero.model_state_bytes(), zero.formula()
            zero.step()
        sent = bus_bytes(group.trace.events, group.name, group.size)["total"] / STEPS
        with zero.full_parameters():
            state = model.state_dict()
        error = max(float(np.abs(state[k] - v).max() / np.abs(v).max()) for k, v in reference.items())
        assert error < 1e-10, f"stage {stage}: weights differ from one process by {error:.1e}"
        lines.append(f"{stage:>5} " + "".join(f"{held[k] / 1024:>9.1f}" for k in held)
                     + f"{sum(held.values()) / 1024:>9.1f}{sum(formula.values()) / 1024:>9.1f}"
                     + f"{sent / 1024:>12.1f}   {error:.0e}")
    if group.rank == 0:
        print(f"N = {group.size} ranks, KiB held by rank 0 after backward, KiB it sends per step:")
        print(f"{'stage':>5} {'params':>8} {'grads':>8} {'optim':>8} {'total':>8} {'formula':>8} {'sent/step':>11}"
              "   vs one process")
        print("\n".join(lines))
        print("stages 1 and 2 send what stage 0 (plain data parallelism) sends; stage 3 sends 1.5x.")


if __name__ == "__main__":
    minidist.run_anywhere(lesson, threads=4)
