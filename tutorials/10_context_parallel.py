"""Lesson 10: context parallelism. Every sequence cut over the ranks; attention joins the pieces.

    mpiexec -n 4 python tutorials/10_context_parallel.py      (or alone: 4 threads)
    python tutorials/10_context_parallel.py --local 4 --png cp.png   (also draw who computes what)

Long sequences make the activations, not the weights, the memory that runs out. Context
parallelism (cp) gives each of the n ranks of a cp group 1/n of every sequence's tokens. Embeddings,
LayerNorms, MLPs and the loss work token by token, so they run on the local tokens unchanged; only
attention needs other ranks' tokens (a query attends to every earlier key). Three ways to bring them:

  ring     rank r holds tokens [r T/n, (r+1) T/n). Its queries stay; the K/V blocks travel around
           the ring, one hop per step: at step s rank r holds the K/V of rank (r - s) mod n and
           merges that block's partial result with the online softmax (flash attention's lse rule).
           A (query chunk, key chunk) pair whose keys all come after its queries is skipped; one
           whose keys all come before needs no mask; a chunk against itself is cut by the triangle.
  zig-zag  the same ring, the sequence cut into 2n chunks and rank r holding chunks r and 2n-1-r:
           an early chunk (little causal work) paired with a late one (much), so every rank does
           the same work. Contiguous, rank r does r + 1/2 blocks: the last works 2n - 1 times as
           much as the first, and the ring moves at its slowest rank's pace.
  Ulysses  two all-to-alls trade the sequence split for a head split: (B, nh, T/n, hs) per rank
           -> (B, nh/n, T, hs), ordinary causal attention on whole sequences, and back. Needs the
           heads to divide by n.

  1. The ring step by step on T = 16 tokens, derived from sequence_chunks and block_plan (the
     functions ring_attention itself runs), confirmed by the trace of a real call.
  2. Zig-zag's balance: the causal work per rank (exact), and measured busy time (illustrative).
  3. Ulysses' reshuffle: shapes and which heads and tokens each rank holds; the trainer's refusal
     when the heads do not divide.
  4. The proof: each algorithm's attention (output, dq, dk, dv) and a tiny GPT's loss and gradients
     equal one process's to 1e-10 in float64. The cp ranks' parameter gradients are each the part
     their tokens contribute, so they are SUMMED over cp (the trainer's gradient sync sums over cp
     and averages over dp only: cp ranks are parts of one replica, not replicas).
"""
import argparse
import itertools
import time

import numpy as np

import minidist
from minidist.autograd import Tensor, scaled_dot_product_attention
from minidist.launch_check import check_launch
from minidist.model import GPT, GPTConfig
from minidist.parallel.context.context_parallel import ALGORITHMS, ContextParallel, context_parallel
from minidist.parallel.context.ring_attention import block_plan, causal_work, ring_attention, sequence_chunks
from minidist.parallel.context.ulysses import heads_to_sequence, sequence_to_heads
from minidist.train.config import ConfigError, TrainConfig, check_config

CONFIG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=16)
B, NH, HS = 2, 4, 8  # the small attention: (B, nh, T, hs) with T = 4 cp tokens (zig-zag: 2 per chunk)
BIG_T, REPEATS = 2048, 3  # the timing: (1, nh, 2048, 32), forward + backward, median of 3
LETTER = {"full": "F", "causal": "C", None: "-"}  # F full block, C causal triangle, - skipped


def tokens(chunks):
    return ",".join(f"{a}-{b - 1}" for a, b in chunks)


def blocks(n, T, zigzag):
    """Every (rank r, ring step s, query chunk, key chunk, kind) of one ring forward, kind "full",
    "causal" or None (skipped): from sequence_chunks and block_plan, as ring_attention runs them."""
    for r in range(n):
        mine = sequence_chunks(T, n, r, zigzag)
        for s in range(n):
            theirs = sequence_chunks(T, n, (r - s) % n, zigzag)  # the K/V that reached rank r at step s
            plan = {(i, j): kind for i, j, kind in block_plan(mine, theirs)}
            for i, j in itertools.product(range(len(mine)), range(len(theirs))):
                yield r, s, mine[i], theirs[j], plan.get((i, j))


def traced_hops(group, T, zigzag):
    """Run a real ring_attention forward and read from every rank's trace whom it sent each K/V
    block to and received it from: (n, 2, n - 1) = [rank][send to / receive from][hop]."""
    n = group.size
    q, k, v = (Tensor(np.random.default_rng(i).standard_normal((1, 2, T // n, 4))) for i in range(3))  # (B, nh, L, hs)
    with group.trace.capture() as events:
        ring_attention(q, k, v, group, zigzag)
    mine = [[e.peer for e in events if e.op == op] for op in ("isend", "irecv")]  # (2, n - 1)
    nbytes = {e.nbytes for e in events if e.op == "ring sendrecv kv"}
    return group.all_gather(np.array([mine])), nbytes.pop()


def part1(group):
    """The ring's steps, from the plan; then checked against the trace of a real call."""
    n, T = group.size, 4 * group.size
    say = print if group.rank == 0 else (lambda *a: None)
    say(f"=== 1. the ring on T = {T} tokens, cp = {n}: at step s rank r holds rank (r - s) mod {n}'s K/V;\n"
        f"    F full block, C causal triangle, - skipped (its keys all come after its queries);\n"
        f"    work: blocks of (T/cp)^2 per rank, a triangle counts 1/2 ===")
    for zigzag in (False, True):
        held = f"chunks r and {2 * n - 1} - r of {2 * n}" if zigzag else f"tokens {T // n}r .. {T // n}r+{T // n - 1}"
        say(f"\n{'zig-zag' if zigzag else 'contiguous'}: rank r holds {held} ("
            + ", ".join(f"r{r} {tokens(sequence_chunks(T, n, r, zigzag))}" for r in range(n)) + ")")
        if zigzag:
            say("  letters: (early q, early k) (early q, late k) (late q, early k) (late q, late k)")
        codes = {}
        for r, s, _, _, kind in blocks(n, T, zigzag):
            codes[s, r] = codes.get((s, r), "") + LETTER[kind]
        say("  step  " + "".join(f"rank {r:<17}" for r in range(n)).rstrip())
        for s in range(n):
            say(f"  {s:>4}  " + "".join(f"kv {tokens(sequence_chunks(T, n, (r - s) % n, zigzag)):<12} "
                                        f"{codes[s, r]:<4}   " for r in range(n)).rstrip())
        say("  work  " + "".join(f"{w:<22g}" for w in causal_work(T, n, zigzag)).rstrip())
        # the trace: replay who received from whom; rank r must hold rank (r - s) mod n's K/V at step s
        hops, nbytes = traced_hops(group, T, zigzag)
        owner = list(range(n))
        for s in range(n - 1):
            assert all(hops[hops[r, 1, s], 0, s] == r for r in range(n)), "a send and a receive do not match"
            owner = [owner[hops[r, 1, s]] for r in range(n)]
            assert owner == [(r - s - 1) % n for r in range(n)], f"step {s + 1}: rank r holds {owner}'s K/V"
    say(f"\ntrace of a real ring_attention forward (both layouts), {nbytes} B per K/V hop:")
    for s in range(n - 1):
        say(f"  hop {s + 1}: " + "  ".join(f"{r}->{hops[r, 0, s]}" for r in range(n)))
    say("  replaying every rank's receives: at step s rank r holds rank (r - s) mod n's K/V, as above")


class Stopwatch:
    """The cp group as ring_attention sees it, adding up the CPU time spent in its waits, so that
    busy = the call's CPU time - waited. CPU time (time.thread_time) does not charge a rank for
    waiting for a core (4 ranks on 2 cores) nor, with ``waited`` taken off, for a message (MPI's
    waits poll, which would be charged)."""

    def __init__(self, group):
        self.group, self.waited = group, 0.0

    def __getattr__(self, name):  # size, rank, trace, ...: the group's
        return getattr(self.group, name)

    def isend(self, *args, **labelled):
        return self.timed(self.group.isend(*args, **labelled))

    def irecv(self, *args, **labelled):
        return self.timed(self.group.irecv(*args, **labelled))

    def timed(self, request):
        def wait(untimed=request.wait):
            t0 = time.thread_time()
            untimed()
            self.waited += time.thread_time() - t0
        request.wait = wait
        return request


def part2(group):
    """Median over REPEATS of (busy CPU ms, wall ms) of one ring forward + backward, per rank."""
    L = BIG_T // group.size
    rng = np.random.default_rng(group.rank)
    q, k, v, dy = (rng.standard_normal((1, NH, L, 32)) for _ in range(4))  # (1, nh, T/cp, hs) each
    measured = []
    for zigzag in (False, True):
        busy, wall = [], []
        for _ in range(REPEATS + 1):  # the first is a warm-up
            Q, K, V = (Tensor(a.copy(), requires_grad=True) for a in (q, k, v))
            watch = Stopwatch(group)
            group.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            ring_attention(Q, K, V, watch, zigzag).backward(dy)
            busy.append(time.thread_time() - c0 - watch.waited)
            wall.append(time.perf_counter() - t0)
        measured.append([np.median(busy[1:]) * 1e3, np.median(wall[1:]) * 1e3])
    return group.all_gather(np.array([measured]))  # (n, 2 layouts, busy / wall)


def part3(group):
    """Ulysses on (1, nh, T/cp, hs) labelled q: value 100 h + t says which head and token it is."""
    n, T = group.size, 4 * group.size
    mine = np.arange(group.rank * T // n, (group.rank + 1) * T // n)  # contiguous tokens
    x = np.zeros((1, NH, T // n, HS)) + (100 * np.arange(NH)[:, None] + mine)[None, :, :, None]  # (1, nh, T/n, hs)
    y = sequence_to_heads(x, group, head_axis=1, what="x")  # (1, nh/n, T, hs)
    back = heads_to_sequence(y, group, head_axis=1, what="y")  # (1, nh, T/n, hs)
    heads, toks = y[0, :, :, 0] // 100, y[0, :, :, 0] % 100  # (nh/n, T) each
    assert (toks == np.arange(T)).all() and (heads == heads[:, :1]).all() and np.array_equal(back, x)
    return group.all_gather(np.array([[*x.shape, *y.shape, heads[0, 0], heads[-1, 0]]]))  # (n, 10)


def part4(group):
    """Worst relative errors against one process, per algorithm: (attention, GPT loss, GPT grads)."""
    T = CONFIG.block_size
    rng = np.random.default_rng(0)
    q, k, v, dy = (rng.standard_normal((B, NH, T, HS)) for _ in range(4))  # (B, nh, T, hs)
    Q, K, V = (Tensor(a.copy(), requires_grad=True) for a in (q, k, v))
    y = scaled_dot_product_attention(Q, K, V, is_causal=True)  # one process: (B, nh, T, hs)
    y.backward(dy)
    ref_attn = (y.data, Q.grad, K.grad, V.grad)
    idx, targets = rng.integers(0, CONFIG.vocab_size, (2, B, T))  # (B, T) each
    ref = GPT(CONFIG, seed=0, dtype="float64")
    _, ref_loss = ref(idx, targets)
    ref_loss.backward()
    rel = lambda a, b: float(np.abs(a - b).max() / np.abs(b).max())  # noqa: E731
    rows = []
    for algorithm in ALGORITHMS:
        cp = ContextParallel(group, algorithm)
        pos = cp.positions(T, np)  # my tokens, in the algorithm's order
        Qc, Kc, Vc = (Tensor(a[:, :, pos].copy(), requires_grad=True) for a in (q, k, v))  # (B, nh, T/cp, hs)
        y = cp.attend_heads(Qc, Kc, Vc)
        y.backward(dy[:, :, pos])
        attn = max(rel(a, b[:, :, pos]) for a, b in zip((y.data, Qc.grad, Kc.grad, Vc.grad), ref_attn))
        model = context_parallel(GPT(CONFIG, seed=0, dtype="float64"), group, algorithm)
        _, loss = model(idx, targets)  # every rank: the whole sequences' loss
        loss.backward()
        grads = max(rel(group.all_reduce(p.grad.copy(), op="sum"), r.grad)  # the cp sum: one replica's gradient
                    for p, r in zip(model.parameters(), ref.parameters(), strict=True))
        worst = group.all_reduce(np.array([attn, rel(loss.data, ref_loss.data), grads]), op="max")
        rows.append((algorithm, *worst, loss.item()))
    return rows


def lesson(group, png=None):
    n = group.size
    assert n >= 2 and NH % n == 0, "this lesson runs on 2 or 4 ranks"
    part1(group)
    timed = part2(group)  # (n, 2 layouts, busy / wall ms)
    ulysses = part3(group)  # (n, 10)
    proof = part4(group)
    contiguous, zigzag = causal_work(BIG_T, n, False), causal_work(BIG_T, n, True)
    assert contiguous == [r + 0.5 for r in range(n)] and zigzag == [n / 2] * n, "the causal work is not as claimed"
    worst = {row[0]: f"{max(row[1:4]):.1e}" for row in proof}
    assert max(max(row[1:4]) for row in proof) < 1e-10, f"differs from one process (relative error): {worst}"
    if group.rank != 0:
        return
    print(f"\n=== 2. zig-zag's balance: one ring forward + backward, (1, {NH}, {BIG_T} / {n}, 32) per rank ===")
    print("  work per rank, blocks of (T/cp)^2 (exact, causal_work):")
    for name, work in (("contiguous", contiguous), ("zig-zag", zigzag)):
        print(f"    {name:<11}" + "".join(f"{w:>8g}" for w in work) + f"   max/min {max(work) / min(work):g}")
    print(f"  measured busy ms per rank (CPU time outside the ring's waits, median of {REPEATS}):")
    for i, name in enumerate(("contiguous", "zig-zag")):
        busy, wall = timed[:, i, 0], timed[:, i, 1]
        print(f"    {name:<11}" + "".join(f"{b:>8.1f}" for b in busy) + f"   max/min {busy.max() / busy.min():.2f}"
              f"   wall {wall.min():.0f}-{wall.max():.0f} ms")
    print("  A diagonal block is computed whole and half masked, so the code's cost is r + 1 squares on\n"
          "  contiguous rank r (max/min n), plus fixed work per call; ranks share cores here, so times are\n"
          "  illustrative, the counts exact. Wall time is the whole ring's, about the same on every rank:\n"
          "  it moves at the slowest rank's pace.")
    print("\n=== 3. Ulysses: all-to-all (B, nh, T/cp, hs) -> (B, nh/cp, T, hs), attention, all-to-all back ===")
    for r, (b, h, t, s, b2, h2, t2, s2, h0, h1) in enumerate(ulysses.astype(int)):
        mine = f"heads {h0}-{h1}" if h1 > h0 else f"head {h0}"
        print(f"  rank {r}: ({b}, {h}, {t}, {s}) heads 0-{h - 1}, {f'tokens {r * t}-{r * t + t - 1}':<12} ->  "
              f"({b2}, {h2}, {t2}, {s2}) {mine}, tokens 0-{t2 - 1}  ->  back to ({b}, {h}, {t}, {s})")
    try:
        check_config(TrainConfig(n_head=6, n_embd=24, block_size=16, cp=4, cp_algorithm="ulysses"), 4)
        raise AssertionError("6 heads over cp 4 should be refused for ulysses")
    except ConfigError as e:
        print("  6 heads over cp 4 (python -m minidist.train --n-head 6 --n-embd 24 --cp 4 --cp-algorithm ulysses):"
              "\n    " + str(e).replace("\n", "\n    "))
    check_config(TrainConfig(n_head=6, n_embd=24, block_size=16, cp=4, cp_algorithm="zigzag"), 4)
    print("  the same with --cp-algorithm zigzag: accepted (the ring cuts the sequence, not the heads)")
    print("\n=== 4. against one process, float64, worst relative error over all ranks ===")
    print(f"  {'algorithm':<10} {'attention: out, dq, dk, dv':>27} {'GPT loss (rel. error)':>26}  "
          f"{'GPT grads (summed over cp)':>26}")
    for algorithm, attn, loss_err, grads, loss in proof:
        print(f"  {algorithm:<10} {attn:>27.1e} {f'{loss:.12f} ({loss_err:.0e})':>26}  {grads:>26.1e}")
    if png:
        draw(png, n, contiguous, zigzag, timed)
    print("\nTry:")
    print("  1. --local 2. Expect T = 8 tokens and one hop (0->1  1->0); contiguous work 0.5 and 1.5 blocks "
          "(max/min 3),\n     zig-zag 1 and 1 (r0 chunks 0-1,6-7, r1 2-3,4-5); Ulysses gives each rank 2 heads, "
          "(1, 2, 8, 8);\n     every error still ~1e-16.")
    print("  2. BIG_T, REPEATS = 4096, 3 (about 8 s). Expect the same counts, each busy time about 4x (T^2), and "
          "contiguous'\n     measured max/min rising toward the code's n = 4 (about 3, against about 2.3 at 2048): "
          "the fixed work per call\n     weighs less beside the T^2 work; zig-zag's stays about 1.0.")
    print("Ring, zig-zag and Ulysses attention equal one process's to 1e-10; zig-zag balances the causal work "
          f"(max/min {max(zigzag) / min(zigzag):g} against contiguous' {max(contiguous) / min(contiguous):g}). "
          "All checks passed.")


def draw(path, n, contiguous, zigzag, timed):
    """The T x T causal mask per layout, each computed block coloured by the rank that computes it
    (its queries' owner) and labelled with the ring step; then the work and busy time per rank."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Polygon, Rectangle
    T = 4 * n
    colours = plt.get_cmap("tab10").colors
    fig, axes = plt.subplots(1, 3, figsize=(15, 5), gridspec_kw={"width_ratios": [1, 1, 1.1]})
    for ax, zz in zip(axes, (False, True)):
        for r, s, (qa, qb), (ka, kb), kind in blocks(n, T, zz):
            if kind is None:  # skipped: its keys all come after its queries
                ax.add_patch(Rectangle((ka, qa), kb - ka, qb - qa, fc="0.93", ec="0.8", hatch="//"))
                continue
            tri = kind == "causal"  # computed whole, the upper triangle masked: draw the lower one
            corners = [(ka, qa), (ka, qb), (kb, qb)] + ([] if tri else [(kb, qa)])
            ax.add_patch(Polygon(corners, fc=colours[r], ec="k", alpha=0.85))
            ax.text(ka + (kb - ka) * (0.3 if tri else 0.5), qa + (qb - qa) * (0.7 if tri else 0.5), f"s{s}",
                    ha="center", va="center", fontsize=8, color="w", weight="bold")
        ax.set(xlim=(0, T), ylim=(T, 0), aspect="equal", xlabel="key position", ylabel="query position",
               title=f"{'zig-zag' if zz else 'contiguous'}: who computes each block (s = ring step)")
        ax.set_xticks(range(0, T + 1, T // (2 * n) if zz else T // n))
        ax.set_yticks(range(0, T + 1, T // (2 * n) if zz else T // n))
    legend = [Rectangle((0, 0), 0, 0, fc=colours[r], label=f"rank {r}") for r in range(n)]
    axes[0].legend(handles=legend + [Rectangle((0, 0), 0, 0, fc="0.93", ec="0.8", hatch="//", label="skipped")],
                   loc="upper right", fontsize=8)
    x = np.arange(n)
    bars = axes[2]
    for dx, name, work, i in ((-0.2, "contiguous", contiguous, 0), (0.2, "zig-zag", zigzag, 1)):
        bars.bar(x + dx, work, 0.4, label=name, color="tab:gray" if i == 0 else "tab:green")
        for r in range(n):
            bars.text(r + dx, work[r] + 0.05, f"{timed[r, i, 0]:.0f} ms", ha="center", fontsize=8)
    bars.set(xticks=x, xticklabels=[f"rank {r}" for r in range(n)], ylabel="causal work, blocks of (T/cp)$^2$",
             title=f"work per rank (bars, exact); measured busy ms (T = {BIG_T})")
    bars.legend()
    fig.suptitle(f"Ring attention, T = {T} tokens over cp = {n} ranks: each block is computed by the rank holding its "
                 f"queries, at ring step s.\nDiagonal blocks are computed whole with the upper triangle masked (white); "
                 f"hatched blocks are skipped (every key after every query).")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"  who computes what drawn in {path}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local", type=int, metavar="N", help="run N ranks as threads in this process (2 or 4)")
    ap.add_argument("--png", help="draw who computes each attention block into this PNG")
    args = ap.parse_args()
    check_launch(ap, args, ranks=(2, 4), alone=4)  # cp splits the heads (Ulysses) and the sequence
    if args.local:
        minidist.run_local(lambda group: lesson(group, args.png), args.local)
    else:
        minidist.run_anywhere(lambda world: lesson(world, args.png), threads=4)
