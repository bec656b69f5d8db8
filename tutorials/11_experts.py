"""Lesson 11: mixture of experts and expert parallelism. Tokens travel to their experts and back.

    mpiexec -n 2 python tutorials/11_experts.py               (or alone: 2 threads)
    python tutorials/11_experts.py --local 2 --png moe.png    (also draw the routing and the load)

A mixture-of-experts (MoE) block replaces the block's one MLP by E expert MLPs and a router, and
each token goes through only k of them (Switch k = 1, GShard and Mixtral k = 2): E times the MLP
parameters for k times the MLP compute. For the N = B T tokens of a batch (minidist/moe.py):

    probs   = softmax(x @ router.T)      (N, E)   the router: one Linear without bias
    experts = route(probs, k)            (N, k)   the k largest, ties to the lower index
    weights = those probs / their sum    (N, k)   the gate weights (k = 1: the probability itself)
    out[n]  = sum_j weights[n, j] * MLP_{experts[n, j]}(x[n])

Expert parallelism (ep) gives each of the ep ranks E/ep of every MoE layer's experts (rank r holds
experts r E/ep .. (r+1) E/ep - 1) and keeps everything else replicated: the ep ranks are data-
parallel ranks, each with its own rows of the batch. Each routes ITS tokens, then
(minidist/parallel/expert/experts.py):

    counts    all_to_all of (ep, E/ep) int64: how many rows I send to each of your experts
    dispatch  all_to_all of the token rows, uneven splits: each row to the rank of its expert
    experts   the grouped MLPs of my E/ep experts on the rows that arrived (from every rank)
    combine   the mirror all_to_all: every output goes home, where the gate weights add them

and backward runs combine and dispatch again, reversed. Nothing else crosses: the router, the
gate weights and the balance loss stay on the token's rank. Two troubles come with routing:

  load imbalance  a router drifts to favour a few experts (they get the tokens, so they learn,
                  so they get the tokens), and the ranks holding them compute while the others
                  wait in the combine. Switch's auxiliary loss (per sequence here)
                      aux = coef E sum_e f_e P_e,  f_e: share of the k T assignments to e,
                                                   P_e: mean router probability of e
                  is smallest (= coef) when the load is even; f is a count, so its gradient
                  pushes down the probabilities of the busiest experts.
  capacity        a fixed budget per expert (fixed shapes, bounded memory): with capacity factor
                  c, an expert takes at most ceil(c k T / E) assignments of each sequence, first
                  choices before second choices, earlier tokens first; the rest are dropped (the
                  residual connection carries the token on). c = 0 (the default) is dropless.

  1. Routing 2 sequences of 8 tokens over 4 experts, top-2, on ep = 2 ranks: each token's
     probabilities, its two experts and their ranks, the (ep, E/ep) counts sent and received, all
     derived from ``route`` and equal to what the MoE forward sent; confirmed by the trace's
     all_to_all bytes (rows x C x 8 bytes).
  2. Load balance: a tiny MoE GPT (8 experts) trained 200 steps on the ep ranks without and with
     the auxiliary loss: tokens per expert, max/mean, and the rows each rank's experts computed.
  3. Capacity: which assignments a capacity factor drops in one sequence, and the forward's
     output checked against sum over KEPT choices of gate weight x expert output.
  4. The proof: the MoE GPT on ep ranks, loss and every gradient equal one process's on the full
     batch (float64, dropless and with a capacity factor). Each rank backpropagates its mean loss
     with seed 1/ep and sets every MoE layer's ``aux_loss_seed`` to 1/ep (the batch's loss is the
     mean of the ranks' means; the trainer seeds 1 and averages over dp instead). Then
       - every non-expert gradient (router included) is the part this rank's rows contribute:
         summed over the ep ranks it is one process's (the trainer's dp all-reduce does it);
       - an expert's gradient already holds every rank's tokens (they came to it): rank r's
         experts' gradients ARE block r of one process's, with nothing to add.

Picture (``--png PATH``): left, part 1's routing as a matrix: a row per token (seq r t0..t7,
coloured by its rank, a black line between ranks), a column per expert (grouped by rank, with the
rows it computes under its name), each cell shaded and labelled by the router's probability as the
text prints it; each token's two experts outlined in the colour of the expert's rank, solid where
the expert lives on the token's rank, dashed where the dispatch sends the token to another rank.
Right, part 2: assignments per expert without and with the aux loss (a bar per layer, the even load
dotted, each rank's band shaded and headed by the rows its experts computed).
"""
import argparse
from dataclasses import replace

import numpy as np

import minidist
from minidist.autograd import Tensor, no_grad, softmax
from minidist.data import get_batch, grammar_text, inputs_and_targets
from minidist.launch_check import check_launch
from minidist.model import GPT, GPTConfig
from minidist.moe import MoE, capacity, capacity_keep, route
from minidist.nn.init import normal
from minidist.optim import AdamW
from minidist.parallel.expert.experts import expert_parallel, moe_layers
from minidist.parallel.tensor.layout import ep_block

# parts 1, 3 and 4: C = 8, E = 4 experts, top-2, T = 8 tokens per sequence
CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8, n_experts=4, top_k=2,
                   aux_loss_coef=0.1)
T, C, E, K = CONFIG.block_size, CONFIG.n_embd, CONFIG.n_experts, CONFIG.top_k
CAPACITY_FACTORS = (1.0, 0.5)  # part 3
PROOF_BATCH = 4  # part 4: sequences in the global batch
# part 2: a byte-level MoE GPT with 8 experts, AdamW, the load counted over the last LAST steps
TRAIN = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16, n_experts=8, top_k=2)
STEPS, LAST, BATCH, LR, COEFS = 200, 20, 8, 1e-2, (0.0, 0.1)


def rel(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def router_layer(capacity_factor=0.0):
    """One MoE layer (CONFIG) with seeded random weights, the same on every rank: a router sharper
    than a fresh one's (std 0.5), so that its choices are easy to read."""
    moe = MoE(CONFIG, dtype="float64")
    moe.capacity_factor = capacity_factor
    for name, p in moe.named_parameters():
        p.data[...] = normal(0, name, p.shape, 0.5 if name.startswith("router") else 0.2)
    return moe


def tiny_batch(n):
    """The layer's input for parts 1 and 3, (n, T, C): sequence r lives on rank r."""
    return np.random.default_rng(0).standard_normal((n, T, C))


def sum_replicated_grads(model, group):
    """Sum every gradient but the experts' over the ep group, in one flat all-reduce: each rank's
    is the part its own rows contribute. The experts' gradients are complete already."""
    shared = [p for p in model.parameters() if not p.expert]
    flat = group.all_reduce(np.concatenate([p.grad.ravel() for p in shared]), op="sum")
    start = 0
    for p in shared:
        p.grad = flat[start:start + p.grad.size].reshape(p.grad.shape)
        start += p.grad.size


def part1(group):
    """Route this rank's sequence, predict the counts from ``route``, run the real forward and
    backward under expert parallelism, and read the all_to_alls from the trace. Returns what
    rank 0 prints (and draws), gathered from every rank."""
    n, r = group.size, group.rank
    L = E // n
    moe = router_layer()
    x = tiny_batch(n)[r:r + 1]  # (1, T, C): my sequence
    with no_grad():
        probs = softmax(moe.router(Tensor(x.reshape(T, C)))).data  # (T, E), as the forward computes it
    experts = route(probs, K)  # (T, k)
    planned = np.bincount(experts.ravel(), minlength=E).reshape(n, L)  # (ep, E/ep): rows to rank s's expert e
    expert_parallel(moe, group)
    X = Tensor(x.copy(), requires_grad=True)
    with group.trace.capture() as events:
        y = moe(X)  # (1, T, C)
        y.backward(np.random.default_rng(1 + r).standard_normal(y.shape))
    sent, received = moe.expert_parallel.sent, moe.expert_parallel.received  # (ep, E/ep) each
    assert np.array_equal(sent, planned), f"rank {r}: the forward sent {sent.tolist()}, route says {planned.tolist()}"
    everyone = group.all_gather(sent[None])  # (n, ep, E/ep): what each rank sent to each rank's experts
    assert np.array_equal(received, everyone[:, r]), f"rank {r}: received {received.tolist()}"
    assert np.array_equal(moe.load, np.bincount(experts.ravel(), minlength=E)), "moe.load != route's count"
    # the trace: every all_to_all, labelled by the compute span it ran in ("counts": none)
    spans = [e for e in events if e.kind == "compute"]
    traced = []
    for e in events:
        if e.kind == "collective" and e.op == "all_to_all":
            inside = [s for s in spans if s.start <= e.start and e.end <= s.end]
            traced.append((max(inside, key=lambda s: s.start).op if inside else "counts", e.nbytes))
    M, R = int(sent.sum()), int(received.sum())  # rows I send (my k T assignments), rows I receive
    expected = [("counts", n * L * 8), ("moe dispatch", M * C * 8), ("moe combine", R * C * 8),
                ("moe combine backward", M * C * 8), ("moe dispatch backward", R * C * 8)]
    assert traced == expected, f"rank {r}: the trace shows {traced}, expected {expected}"
    return (group.all_gather(probs[None]), group.all_gather(np.concatenate([sent, received])[None]),
            group.all_gather(np.array([[b for _, b in traced]])), [w for w, _ in traced])


def print_part1(n, probs, counts, nbytes, where):
    L = E // n
    held = f"experts {L}r..{L}r+{L - 1}" if L > 1 else "expert r"
    print(f"=== 1. routing {n} sequences of T = {T} tokens over E = {E} experts, top-{K}, on ep = {n} ranks:\n"
          f"    rank r holds sequence r and {held}; * marks a token's {K} largest probabilities, whose\n"
          f"    renormalised values are its gate weights ===")
    for r in range(n):
        experts = route(probs[r], K)  # (T, k)
        print(f"\nrank {r}, sequence {r}:\n  token  " + " ".join(f"p(e{e})" for e in range(E))
              + "   experts (gate weights)   their ranks")
        for t in range(T):
            row = " ".join(f"{p:4.2f}{'*' if e in experts[t] else ' '}" for e, p in enumerate(probs[r, t]))
            gates = probs[r, t, experts[t]] / probs[r, t, experts[t]].sum()
            chosen = "  ".join(f"e{e} ({g:.2f})" for e, g in zip(experts[t], gates))
            print(f"  {t:>5}  {row}   {chosen}     " + " ".join(f"r{e // L}" for e in experts[t]))
        sent, received = counts[r, :n], counts[r, n:]
        print("  sent     (ep, E/ep) rows to   " + "   ".join(
            f"r{s}: " + " ".join(f"e{s * L + e}={sent[s, e]}" for e in range(L)) for s in range(n))
            + "   = route's choices, counted per expert")
        print("  received (ep, E/ep) rows from " + "   ".join(
            f"r{s}: " + " ".join(f"e{r * L + e}={received[s, e]}" for e in range(L)) for s in range(n))
            + f"   = what each rank sent to rank {r}'s experts")
    work = counts[:, n:].sum(axis=(1, 2))
    away = [T * K - counts[r, r].sum() for r in range(n)]  # my rows for other ranks' experts
    print("\n  rows each rank's experts compute: " + ", ".join(f"rank {r} {w}" for r, w in enumerate(work))
          + f" of {n * T * K}: the router, not the ranks, decides the work")
    print("  rows that leave their rank in the dispatch: " + ", ".join(f"rank {r} {a} of {T * K}" for r, a in
                                                                  enumerate(away)) + " (the rest: a local copy)")
    print(f"\n  trace of one forward + backward: every all_to_all and its bytes (the whole send buffer, local\n"
          f"  rows too: rows x C={C} x 8 B)")
    print(f"  {'where':<24}" + "".join(f"{f'rank {r}':>16}" for r in range(n)))
    for i, label in enumerate(where):
        cells = "".join(f"{f'{b // (C * 8)} rows {b} B' if i else f'{b} B':>16}" for b in nbytes[:, i])
        print(f"  {label:<24}{cells}")
    print("  = ep x E/ep int64 counts, then my k T rows out, my received rows back, and both again in backward")


def train(group, coef):
    """STEPS AdamW steps of a TRAIN GPT (aux_loss_coef ``coef``) on the ep ranks, each on its rows
    of the global batch. Returns the assignments per (layer, expert) over the last LAST steps
    (summed over ranks), the rows this rank's experts computed per layer, and the last loss."""
    n, r = group.size, group.rank
    model = GPT(replace(TRAIN, aux_loss_coef=coef), seed=0, dtype="float64")
    expert_parallel(model, group)
    layers = moe_layers(model)
    for moe in layers:
        moe.aux_loss_seed = 1 / n  # the aux loss of the batch: the mean of the ranks' (part 4)
    opt = AdamW(model.named_parameters(), lr=LR)
    tokens = np.frombuffer(grammar_text(20_000).encode(), dtype=np.uint8)
    rows = BATCH // n
    computed = np.zeros(len(layers), dtype=np.int64)
    for step in range(STEPS):
        if step == STEPS - LAST:
            for moe in layers:
                moe.reset_stats()
        idx, targets = inputs_and_targets(get_batch(tokens, step, BATCH, TRAIN.block_size)[r * rows:(r + 1) * rows])
        opt.zero_grad()
        _, loss = model(idx, targets)
        loss.backward(np.full_like(loss.data, 1 / n))
        sum_replicated_grads(model, group)
        opt.step()
        if step >= STEPS - LAST:
            computed += [int(moe.expert_parallel.received.sum()) for moe in layers]
    load = group.all_reduce(np.array([moe.load for moe in layers]), op="sum")  # (layers, E)
    mean_loss = group.all_reduce(np.array([loss.item()]), op="sum")[0] / n
    return load, group.all_gather(computed[None]), mean_loss  # (layers, E), (n, layers), float


def part2(group):
    results = [train(group, coef) for coef in COEFS]
    n, L = group.size, TRAIN.n_experts // group.size
    for load, computed, _ in results:
        per_rank = load.reshape(len(load), n, L).sum(axis=2)  # (layers, n): rows rank r's experts got
        assert np.array_equal(per_rank, computed.T), "the rows each rank computed != the load of its experts"
    imbalance = [load.max(axis=1) / load.mean(axis=1) for load, _, _ in results]  # max/mean per layer
    assert (imbalance[1] < imbalance[0]).all(), f"the aux loss did not even out the load: {imbalance}"
    return results, [i.max() for i in imbalance]


def print_part2(n, results):
    E2, L = TRAIN.n_experts, TRAIN.n_experts // n
    total = LAST * BATCH * TRAIN.block_size * TRAIN.top_k
    print(f"\n=== 2. load balance: a MoE GPT ({TRAIN.n_layer} MoE layers, {E2} experts, top-{TRAIN.top_k}, "
          f"C={TRAIN.n_embd}) trained {STEPS} AdamW steps\n    on ep = {n} ranks ({BATCH // n} of {BATCH} sequences "
          f"each), without and with the auxiliary loss ===")
    print(f"  assignments per expert over the last {LAST} steps ({total} per layer; even: {total // E2} each)")
    print(f"  {'aux coef':<9}{'layer':<6}" + "".join(f"{f'e{e}':>6}" for e in range(E2))
          + f"{'max/mean':>10}{'loss':>8}   rows each rank's experts computed")
    for coef, (load, computed, loss) in zip(COEFS, results):
        for i, row in enumerate(load):
            work = " ".join(f"{c:>5}" for c in computed[:, i])
            print(f"  {coef:<9g}{i:<6}" + "".join(f"{c:>6}" for c in row) + f"{row.max() / row.mean():>10.2f}"
                  + (f"{loss:>8.3f}" if i == 0 else " " * 8) + f"   {work}")
    (_, without, _), (_, with_aux, _) = results[0], results[-1]
    print(f"  Without it the router piles the tokens on a few experts, and the rank holding them ({L} experts\n"
          f"  each) computes up to {(without.max(axis=0) / without.min(axis=0)).max():.1f}x the rows of another: "
          f"every all-to-all waits for it. With coef {COEFS[-1]:g}\n"
          f"  the busiest rank computes at most {(with_aux.max(axis=0) / with_aux.min(axis=0)).max():.2f}x the "
          f"least busy's, for about the same loss.")


def part3(group):
    """Each rank runs its sequence of part 1 through the layer with each capacity factor under expert
    parallelism; checks the dropped count and the output against the formula over KEPT choices."""
    n, r = group.size, group.rank
    x = tiny_batch(n)[r:r + 1]  # (1, T, C)
    full = router_layer()
    with no_grad():
        probs = softmax(full.router(Tensor(x.reshape(T, C)))).data  # (T, E)
        every = full.experts(Tensor(np.tile(x.reshape(T, C), (E, 1))), [T] * E).data.reshape(E, T, C)  # all (e, t)
    experts = route(probs, K)  # (T, k)
    gates = np.take_along_axis(probs, experts, axis=1)
    gates /= gates.sum(axis=1, keepdims=True)  # (T, k)
    dropped = []
    for cf in (0.0,) + CAPACITY_FACTORS:
        moe = router_layer(cf)
        expert_parallel(moe, group)
        out = moe(Tensor(x.copy(), requires_grad=True)).data.reshape(T, C)
        keep = capacity_keep(experts[None], capacity(cf, T, K, E), E)[0] if cf else np.ones((T, K), bool)  # (T, k)
        expected = sum(keep[:, j, None] * gates[:, j, None] * every[experts[:, j], np.arange(T)] for j in range(K))
        assert rel(out, expected) < 1e-12, f"rank {r}, capacity factor {cf}: out != sum over kept choices"
        assert moe.dropped == (~keep).sum(), f"rank {r}: the forward dropped {moe.dropped}, not {(~keep).sum()}"
        if cf:
            assert (out[~keep.any(axis=1)] == 0).all(), "a token with every choice dropped must get 0"
            dropped.append((~keep).sum())
    return group.all_gather(np.array([dropped]))  # (n, factors)


def print_part3(n, probs, dropped):
    experts = route(probs[0], K)[None]  # (1, T, k): sequence 0, rank 0's
    print(f"\n=== 3. capacity: each expert takes at most ceil(c k T / E) assignments of a sequence, queued\n"
          f"    first choices of tokens 0..{T - 1}, then second choices; 't3.2' is token 3's second choice ===")
    for cf in CAPACITY_FACTORS:
        cap = capacity(cf, T, K, E)
        keep = capacity_keep(experts, cap, E)[0]  # (T, k)
        print(f"  c = {cf:g}: capacity ceil({cf:g} x {K} x {T} / {E}) = {cap}; sequence 0:")
        for e in range(E):
            queue = [f"t{t}.{j + 1}" for j in range(K) for t in range(T) if experts[0, t, j] == e]
            shown = " ".join(queue[:cap]) + ("  | dropped: " + " ".join(queue[cap:]) if len(queue) > cap else "")
            print(f"    e{e}: {shown}")
        lost = [t for t in range(T) if not keep[t].any()]
        first = int((~keep[:, 0]).sum())
        print(f"    {int((~keep).sum())} of {T * K} dropped ({first} of them first choices)"
              + (f"; token{'s' * (len(lost) > 1)} {', '.join(map(str, lost))} lost every expert: "
                 f"the MoE adds 0 and the residual carries {'them' if len(lost) > 1 else 'it'} on" if lost else ""))
    print("  the MoE forward on each rank's own sequence dropped " + ", ".join(
        f"{'/'.join(str(d) for d in dropped[r])} (rank {r})" for r in range(n))
        + f" at c = {'/'.join(f'{cf:g}' for cf in CAPACITY_FACTORS)}, as capacity_keep says;\n"
        "  each token's output = sum over its KEPT choices of gate weight x expert output (checked; the\n"
        "  gate weights are not renormalised over the kept ones)")


def part4(group):
    """Worst relative errors against one process per capacity factor: (loss and aux, router grads,
    expert grads, every other grad), and the loss; the loads must be equal."""
    n, r = group.size, group.rank
    rows = PROOF_BATCH // n
    idx, targets = np.random.default_rng(2).integers(0, CONFIG.vocab_size, (2, PROOF_BATCH, T))  # (B, T) each
    results = []
    for cf in (0.0, 1.0):
        config = replace(CONFIG, capacity_factor=cf)
        ref = GPT(config, seed=0, dtype="float64")  # one process, the full batch
        _, ref_loss = ref(idx, targets)
        ref_loss.backward()
        model = GPT(config, seed=0, dtype="float64")
        expert_parallel(model, group)
        for moe in moe_layers(model):
            moe.aux_loss_seed = 1 / n
        _, loss = model(idx[r * rows:(r + 1) * rows], targets[r * rows:(r + 1) * rows])  # my rows
        loss.backward(np.full_like(loss.data, 1 / n))
        sum_replicated_grads(model, group)
        mean = group.all_reduce(np.array([loss.item()] + [m.aux_loss for m in moe_layers(model)]), op="sum") / n
        ref_stats = np.array([ref_loss.item()] + [m.aux_loss for m in moe_layers(ref)])
        worst = {"loss": rel(mean, ref_stats), "router": 0.0, "experts": 0.0, "other": 0.0}
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            if p.expert:
                err = rel(p.grad, q.grad[ep_block(E, r, n)])  # my block of experts, nothing added
            else:
                err = rel(p.grad, q.grad)  # summed over the ep ranks
            kind = "experts" if p.expert else "router" if ".router." in name else "other"
            worst[kind] = max(worst[kind], err)
        for m, q in zip(moe_layers(model), moe_layers(ref)):
            assert np.array_equal(group.all_reduce(m.load.copy(), op="sum"), q.load), "the loads differ"
            assert group.all_reduce(np.array([m.dropped]), op="sum")[0] == q.dropped, "the drops differ"
        worst = group.all_reduce(np.array(list(worst.values())), op="max")
        dropped = sum(q.dropped for q in moe_layers(ref))
        assert bool(cf) == (dropped > 0), f"capacity factor {cf}: {dropped} dropped"  # the proof covers drops
        results.append((cf, *worst, ref_loss.item(), dropped))
    return results


def print_part4(n, proof):
    per_layer = PROOF_BATCH * T * K
    print(f"\n=== 4. the MoE GPT against one process on the full batch, float64: {PROOF_BATCH} sequences of {T}, "
          f"2 MoE layers\n    of {per_layer} assignments each, aux coef {CONFIG.aux_loss_coef:g}; rank r holds "
          f"experts block r and {PROOF_BATCH // n} sequence{'s' if PROOF_BATCH // n != 1 else ''};\n    worst relative error over all ranks ===")
    print(f"  {'capacity factor':<16}{'dropped':>8}{'loss':>17} {'loss, aux':>10} {'router grads':>13} "
          f"{'expert grads':>13} {'other grads':>12}")
    for cf, loss_err, router, experts, other, loss, dropped in proof:
        print(f"  {f'{cf:g}' + (' (dropless)' if not cf else ''):<16}{f'{dropped}/{2 * per_layer}':>8}"
              f"{loss:>17.12f} {loss_err:>10.1e} {router:>13.1e} {experts:>13.1e} {other:>12.1e}")
    print("  router and other grads: summed over the ep ranks; expert grads: rank r's block as it is (an\n"
          "  expert meets the same rows in the same order as in one process: they arrive in rank order, so\n"
          "  its error can be exactly 0); tokens per expert and dropped assignments: equal, to the token")


def lesson(group, png=None):
    n = group.size
    assert n in (2, 4), "this lesson runs on 2 or 4 ranks"
    probs, counts, nbytes, where = part1(group)
    trained, worst = part2(group)
    dropped = part3(group)
    proof = part4(group)
    err = max(max(row[1:5]) for row in proof)
    assert err < 1e-10, f"expert parallelism differs from one process by {err:.1e}"
    if group.rank != 0:
        return
    print_part1(n, probs, counts, nbytes, where)
    print_part2(n, trained)
    print_part3(n, probs, dropped)
    print_part4(n, proof)
    if png:
        draw(png, n, probs, trained)
    print("\nTry:")
    print("  1. --local 4 (one expert per rank in part 1, 2 of the 8 in part 2). Expect rows computed 13, 15, 19, 17 "
          "of 64\n     and combines of 832, 960, 1216, 1088 B; without the aux loss one rank computes up to 35.6x "
          "another's rows,\n     with it at most 1.32x (the same routing: max/mean still 3.23 -> 1.27); errors "
          "still ~1e-16.")
    print("  2. COEFS = (0.0, 1.0). Expect max/mean 1.14 and 1.22 by layer (0.1 gave 1.27 and 1.16: ten times the "
          "coefficient\n     barely evens it further), the busiest rank at most 1.13x the other's, loss 1.943 "
          "(2.104 without).")
    print(f"ep {n}: loss and every gradient = one process's to 1e-10; the aux loss evens the load "
          f"(max/mean {worst[0]:.2f} -> {worst[1]:.2f})")
    print("All checks passed.")


def draw(path, n, probs, trained):
    """Left: part 1's routing as a token x expert matrix, each cell shaded grey by the router's
    probability (as printed; a colour bar beside it), each token's top-k experts outlined in the colour
    of the expert's rank (dashed: sent to another rank). Right: part 2's assignments per expert."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LinearSegmentedColormap, to_hex
    from matplotlib.patches import Rectangle
    from minidist.inspect.colors import text_color
    L, L2 = E // n, TRAIN.n_experts // n
    shade = LinearSegmentedColormap.from_list("probability", ["white", "#4d4d4d"])  # grey: no rank's colour
    colours = plt.get_cmap("tab10").colors
    fig, axes = plt.subplots(1, 1 + len(COEFS), figsize=(17, 2 + 0.26 * n * T),
                             gridspec_kw={"width_ratios": [1.3, 1, 1]})
    ax = axes[0]
    image = ax.imshow(probs.reshape(n * T, E), cmap=shade, vmin=0, vmax=1, aspect="auto")  # (n T, E): row r T + t
    for r in range(n):
        experts = route(probs[r], K)  # (T, k)
        for t in range(T):
            y = r * T + t
            for e in range(E):
                chosen = e in experts[t]
                ax.text(e, y, f"{probs[r, t, e]:.2f}", ha="center", va="center", fontsize=9,
                        color=text_color(to_hex(shade(probs[r, t, e]))), weight="bold" if chosen else "normal")
            for e in experts[t]:
                ax.add_patch(Rectangle((e - 0.45, y - 0.42), 0.9, 0.84, fill=False, lw=2.5, edgecolor=colours[e // L],
                                       ls="-" if e // L == r else "--"))
        if r:
            ax.axhline(r * T - 0.5, color="black", lw=1.5)
    for s in range(1, n):
        ax.axvline(s * L - 0.5, color="black", lw=1.5)
    rows = [sum(int((route(probs[r], K) == e).sum()) for r in range(n)) for e in range(E)]
    ax.set_xticks(range(E), [f"e{e}\nrank {e // L}\n{rows[e]} rows" for e in range(E)], fontsize=9)
    for e, tick in enumerate(ax.get_xticklabels()):
        tick.set_color(colours[e // L])
    ax.xaxis.tick_top()
    ax.set_yticks(range(n * T), [f"seq {r} t{t} (rank {r})" for r in range(n) for t in range(T)], fontsize=9)
    for y, tick in enumerate(ax.get_yticklabels()):
        tick.set_color(colours[y // T])
    ax.set_xlabel(f"router probabilities; outlined: each token's top-{K} experts, in the colour of the expert's "
                  "rank;\nsolid: computed on the token's own rank, dashed: sent to another rank by the dispatch",
                  fontsize=9)
    ax.set_title(f"part 1: {n} sequences of {T} tokens routed to {E} experts", fontsize=11)
    bar = fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02, ticks=[0, 0.25, 0.5, 0.75, 1])
    bar.set_label("router probability (grey: the shading of each cell)", fontsize=9)
    bar.ax.tick_params(labelsize=8)
    top = max(load.max() for load, _, _ in trained) * 1.25
    width = 0.8 / TRAIN.n_layer
    for ax, coef, (load, computed, loss) in zip(axes[1:], COEFS, trained):
        for r in range(n):
            ax.axvspan(r * L2 - 0.5, (r + 1) * L2 - 0.5, color=colours[r], alpha=0.08)
            ax.text((r + 0.5) * L2 - 0.5, top * 0.97, f"rank {r}\n" + " + ".join(str(c) for c in computed[r])
                    + "\nrows", ha="center", va="top", fontsize=9 if n == 2 else 8, color=colours[r])
        x = np.arange(TRAIN.n_experts)
        for i, row in enumerate(load):
            ax.bar(x + (i - (TRAIN.n_layer - 1) / 2) * width, row, width, label=f"layer {i}: max/mean "
                   f"{row.max() / row.mean():.2f}", color=("0.35", "0.65")[i % 2])
        ax.axhline(load.mean(), color="k", ls=":", lw=1, label="even load")
        ax.set(xticks=x, xticklabels=[f"e{e}" for e in x], ylim=(0, top), ylabel="assignments (last "
               f"{LAST} steps)", title=f"part 2: {TRAIN.n_experts} experts, aux coef {coef:g} (loss {loss:.2f})")
        ax.set_xlabel("expert (shaded: the rank that holds it)", fontsize=9)
        ax.legend(loc="center right", fontsize=9)
    fig.suptitle(f"Expert parallelism on {n} ranks: the router decides which rank computes each token "
                 f"(E = {E}, top-{K}, {L} expert{'s' * (L > 1)} per rank), and the auxiliary loss keeps the work even")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"  the routing and the load drawn in {path}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local", type=int, metavar="N", help="run N ranks as threads in this process (2 or 4)")
    ap.add_argument("--png", help="draw the routing and the load per expert into this PNG")
    args = ap.parse_args()
    check_launch(ap, args, ranks=(2, 4), alone=2)  # ep splits the experts
    if args.local:
        minidist.run_local(lambda group: lesson(group, args.png), args.local)
    else:
        minidist.run_anywhere(lambda world: lesson(world, args.png), threads=2)
