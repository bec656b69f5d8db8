"""Context-parallelism benchmark: memory per rank, bytes moved, balance and step time against T and cp.

    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/context_parallel.py     (all parts, about 45 s on 2 shared cores)
    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/context_parallel.py --parts scaling balance

cp 4 is the world; cp 2 is the world split in two pairs (two copies of the job run side by side); cp 1
is every rank alone (four copies). So in every configuration all 4 processes compute at once and
share the machine's cores alike. A step is forward + backward of a float32 GPT (2 layers, 64 wide,
4 heads of 16, B = 2, one thread per rank, backend "ring"), no optimizer; its time is the slowest
rank's; configurations are timed in turn, --reps interleaved rounds after a warm-up round, median.

Parts (``--parts``, default all):
  scaling     step time and activation bytes per rank (accounting.activation_bytes, weights
              excluded: the arrays the graph keeps for backward) against T = 128..1024 for
              one process (ordinary attention, (T x T) probabilities kept), the ring at cp 1 (the
              same blockwise attention with nobody to talk to: no T x T kept), cp 2 and cp 4. Every
              layout's loss must equal one process's (1e-5 relative).
  algorithms  ring, zigzag and Ulysses at cp 2 and 4, T = 1024: the attention call alone
              (forward + backward of q, k, v (B, nh, T/cp, hs)) and the whole model step; bytes each
              rank sends per step read from the trace ("ring sendrecv kv"/"dkv" events, which the
              isend events must match; all_to_all buffers times (n-1)/n) against the docstrings'
              formulas: ring (3 cp - 2) blocks of 2 B nh L hs values per attention (forward cp - 1
              K/V; backward cp - 1 K/V and cp dK/dV), Ulysses 8 B nh L hs values of all-to-all
              buffers (4 each way), (cp-1)/cp of them sent. And each layout's activation bytes per rank.
  balance     contiguous ring against zig-zag at cp = world size, T = 1024: each rank's attention
              forward + backward, its wall time (waiting for neighbours included) and its own CPU
              time outside the ring's waits (the work it does), against ``causal_work`` (useful
              area) and the area computed (a causal diagonal pair is computed whole, then masked).
The figure (figures/context_parallel.png) is drawn from the parts that ran; ``--json PATH`` saves the
numbers.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import minidist
import minidist.parallel.context.ring_attention as ring_module
from minidist.autograd import Tensor
from minidist.comm.ops import bus_factor
from minidist.model import GPT, GPTConfig
from minidist.inspect.accounting import activation_bytes
from minidist.parallel.context.context_parallel import ContextParallel, context_parallel
from minidist.parallel.context.ring_attention import block_plan, causal_work, sequence_chunks

HERE = Path(__file__).resolve().parent
CONFIG = GPTConfig(vocab_size=256, block_size=1024, n_layer=2, n_head=4, n_embd=64)
B, T_LONG, TS = 2, 1024, (128, 256, 512, 1024)
HS = CONFIG.n_embd // CONFIG.n_head
PARTS = ("scaling", "algorithms", "balance")
ALGORITHMS = ("ring", "zigzag", "ulysses")


def cp_groups(world) -> dict:
    """{cp: the cp group this rank is in}: the world, pairs, each rank alone (sizes dividing the world)."""
    groups = {}
    for cp in (1, 2, 4, 8):
        if cp <= world.size and world.size % cp == 0:
            groups[cp] = world if cp == world.size else world.split(world.rank // cp, name=f"cp{cp}.{world.rank // cp}")
    return groups


def tokens(T, seed=0):
    """Inputs and targets (B, T), the same on every rank."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, CONFIG.vocab_size, (B, T)), rng.integers(0, CONFIG.vocab_size, (B, T))


def model_step(model, idx, targets, weights, keep_bytes):
    """Forward + backward; (seconds, loss, activation bytes or None)."""
    t0 = time.perf_counter()
    model.zero_grad()
    _, loss = model(idx, targets)
    kept = activation_bytes(loss, exclude=weights) if keep_bytes else None
    loss.backward()
    return time.perf_counter() - t0, loss.item(), kept


def slowest(world, seconds):
    """The largest of the ranks' ``seconds``: a step lasts as long as its slowest rank."""
    return float(world.all_reduce(np.array([seconds]), op="max")[0])


# ---- part 1: scaling with T and cp ---------------------------------------------------------------

def part_scaling(world, reps):
    groups = cp_groups(world)
    variants = {"one process": (None, 1)}
    variants.update({f"ring cp {cp}": (groups[cp], cp) for cp in groups})
    models = {}
    for name, (group, cp) in variants.items():
        model = GPT(CONFIG, seed=0, dtype="float32")
        weights = [p.data for p in model.parameters()]
        models[name] = (context_parallel(model, group, "ring") if group is not None else model, weights)
    times = {(name, T): [] for name in variants for T in TS}
    kept, losses = {}, {}
    for rep in range(reps + 1):  # round 0: warm-up, bytes and losses
        for T in TS:
            idx, targets = tokens(T)
            for name, (model, weights) in models.items():
                world.barrier()
                seconds, loss, nbytes = model_step(model, idx, targets, weights, rep == 0)
                seconds = slowest(world, seconds)
                if rep == 0:
                    kept[name, T], losses[name, T] = nbytes, loss
                else:
                    times[name, T].append(seconds)
    for (name, T), loss in losses.items():  # every layout computes one process's loss
        assert abs(loss - losses["one process", T]) <= 1e-5 * abs(losses["one process", T]), (name, T, loss)
    # every rank of a cp group keeps the same bytes; take the max over the world to be safe
    rows = []
    for name, (_, cp) in variants.items():
        for T in TS:
            rows.append(dict(layout=name, cp=cp, T=T, ms=1e3 * float(np.median(times[name, T])),
                             activation_bytes=int(world.all_reduce(np.array([kept[name, T]]), op="max")[0]),
                             loss=losses[name, T]))
    if world.rank == 0:
        by = {(r["layout"], r["T"]): r for r in rows}
        print(f"ring context parallelism, {CONFIG.n_layer}L {CONFIG.n_embd}d {CONFIG.n_head} heads, B = {B}, float32, "
              f"{world.size} ranks busy in every layout, median of {reps}")
        print(f"{'layout':>12} {'T':>5} {'ms/step':>8} {'/ 1 proc':>8} {'activ. MiB':>10} {'/ 1 proc':>8} "
              f"{'/ ring cp1':>10} {'1/cp':>6}")
        for r in rows:
            one, ring1 = by["one process", r["T"]], by["ring cp 1", r["T"]]
            print(f"{r['layout']:>12} {r['T']:>5} {r['ms']:>8.1f} {r['ms'] / one['ms']:>8.2f} "
                  f"{r['activation_bytes'] / 2**20:>10.2f} {r['activation_bytes'] / one['activation_bytes']:>8.3f} "
                  f"{r['activation_bytes'] / ring1['activation_bytes']:>10.3f} {1 / r['cp']:>6.3f}")
    return rows


# ---- part 2: ring vs zigzag vs Ulysses: time and bytes --------------------------------------------

def sent_bytes(events, group):
    """What this rank sent over ``group`` in ``events``: ring K/V and dK/dV hops, the isends (which
    must equal them), all-to-all and other collectives (buffer x nccl-tests' bus factor)."""
    n, mine = group.size, [e for e in events if e.group == group.name]
    out = dict(kv=sum(e.nbytes for e in mine if e.op == "ring sendrecv kv"),
               dkv=sum(e.nbytes for e in mine if e.op == "ring sendrecv dkv"),
               isend=sum(e.nbytes for e in mine if e.op == "isend"),
               all_to_all=sum(e.nbytes * (n - 1) / n for e in mine if e.op == "all_to_all"),
               other=sum(e.nbytes * (bus_factor(e.op, n) or 0) for e in mine
                         if e.kind == "collective" and e.op != "all_to_all"))
    out["attention"] = out["kv"] + out["dkv"] + out["all_to_all"]
    return out


def formula_bytes(algorithm, n, L):
    """Bytes one attention call (forward + backward) sends per rank, by the module docstrings."""
    x = B * CONFIG.n_head * L * HS * 4  # one (B, nh, L, hs) float32 block
    if algorithm == "ulysses":
        return 8 * x * (n - 1) / n  # q,k,v + y forward, dy + dq,dk,dv backward; (n-1)/n leaves the rank
    return (3 * n - 2) * 2 * x  # (n-1) K/V forward, (n-1) K/V + n dK/dV backward


def part_algorithms(world, reps):
    groups = {cp: g for cp, g in cp_groups(world).items() if cp > 1}
    idx, targets = tokens(T_LONG)
    rng = np.random.default_rng(1)
    cases = {}
    for cp, group in groups.items():
        L = T_LONG // cp
        for algorithm in ALGORITHMS:
            cp_obj = ContextParallel(group, algorithm)
            qkv = [rng.standard_normal((B, CONFIG.n_head, L, HS)).astype("float32") for _ in range(4)]
            model = context_parallel(GPT(CONFIG, seed=0, dtype="float32"), group, algorithm)
            cases[cp, algorithm] = (group, cp_obj, qkv, model, [p.data for p in model.parameters()])
    times = {(key, what): [] for key in cases for what in ("attention", "model")}
    sent, kept = {}, {}
    for rep in range(reps + 1):
        for key, (group, cp_obj, (q, k, v, dout), model, weights) in cases.items():
            world.barrier()
            with world.trace.capture() as events:
                t0 = time.perf_counter()
                qt, kt, vt = (Tensor(a.copy(), requires_grad=True) for a in (q, k, v))
                cp_obj.attend(qt, kt, vt).backward(dout)
                seconds = time.perf_counter() - t0
            attention = sent_bytes(events, group)
            seconds = slowest(world, seconds)
            if rep:
                times[key, "attention"].append(seconds)
            world.barrier()
            with world.trace.capture() as events:
                seconds, _, nbytes = model_step(model, idx, targets, weights, rep == 0)
            whole = sent_bytes(events, group)
            if rep == 0:
                kept[key] = nbytes
            seconds = slowest(world, seconds)
            if rep:
                times[key, "model"].append(seconds)
            sent[key] = (attention, whole)
    rows = []
    for (cp, algorithm), (attention, whole) in sent.items():
        formula = formula_bytes(algorithm, cp, T_LONG // cp)
        # the same on every rank? take min and max over the world
        lo_hi = world.all_reduce(np.array([attention["attention"], -attention["attention"]]), op="min")
        key = (cp, algorithm)
        rows.append(dict(cp=cp, algorithm=algorithm, attention_ms=1e3 * float(np.median(times[key, "attention"])),
                         model_ms=1e3 * float(np.median(times[key, "model"])),
                         activation_bytes=int(world.all_reduce(np.array([kept[key]]), op="max")[0]),
                         attention_bytes=attention, model_bytes=whole, formula_attention=formula,
                         formula_model=CONFIG.n_layer * formula, min_rank=float(lo_hi[0]), max_rank=float(-lo_hi[1])))
    for r in rows:  # what the trace says against what the docstrings say
        a, m = r["attention_bytes"], r["model_bytes"]
        r["isend_matches_ring_events"] = a["isend"] == a["kv"] + a["dkv"] and m["isend"] == m["kv"] + m["dkv"]
        r["matches_formula"] = (a["attention"] == r["formula_attention"] and m["attention"] == r["formula_model"]
                                and r["min_rank"] == r["max_rank"])
    if world.rank == 0:
        print(f"\nT = {T_LONG}, B = {B}, {CONFIG.n_head} heads of {HS}, float32; median of {reps}; bytes = what one "
              f"rank sends per step (KiB)")
        print(f"{'cp':>3} {'algorithm':>9} {'attn ms':>8} {'model ms':>9} {'attn KiB':>9} {'formula':>9} "
              f"{'K/V':>8} {'dK/dV':>8} {'a2a':>8} {'model KiB':>10} {'formula':>9} {'loss AR B':>9} "
              f"{'activ MiB':>9} {'ok':>3}")
        for r in rows:
            a, m = r["attention_bytes"], r["model_bytes"]
            print(f"{r['cp']:>3} {r['algorithm']:>9} {r['attention_ms']:>8.1f} {r['model_ms']:>9.1f} "
                  f"{a['attention'] / 1024:>9.0f} {r['formula_attention'] / 1024:>9.0f} {a['kv'] / 1024:>8.0f} "
                  f"{a['dkv'] / 1024:>8.0f} {a['all_to_all'] / 1024:>8.0f} {m['attention'] / 1024:>10.0f} "
                  f"{r['formula_model'] / 1024:>9.0f} {m['other']:>9.0f} {r['activation_bytes'] / 2**20:>9.2f} "
                  f"{'yes' if r['matches_formula'] and r['isend_matches_ring_events'] else 'NO':>3}")
        bad = [r for r in rows if not (r["matches_formula"] and r["isend_matches_ring_events"])]
        if bad:
            print("MISMATCH between the trace and the docstring formulas:", [(r["cp"], r["algorithm"]) for r in bad])
    return rows


# ---- part 3: balance, contiguous vs zig-zag --------------------------------------------------------

class RingWaitClock:
    """Wraps the ring's ``wait`` to add up the CPU time spent inside it (polling for a hop), so that a
    rank's CPU time minus it is the work the rank did. Installed for this part only."""

    def __init__(self):
        self.cpu = 0.0
        self._wait = ring_module._Ring.wait

    def __enter__(self):
        clock, wait = self, self._wait

        def timed(ring, *args, **kwargs):
            c0 = time.process_time()
            try:
                return wait(ring, *args, **kwargs)
            finally:
                clock.cpu += time.process_time() - c0
        ring_module._Ring.wait = timed
        return self

    def __exit__(self, *exc):
        ring_module._Ring.wait = self._wait


def computed_blocks(T, n, zigzag):
    """Per rank, the (T/cp x T/cp)-block area RingAttention computes: like ``causal_work`` but a causal
    pair counts its whole area (its scores are computed, then the upper triangle is set to -inf)."""
    area, out = (T / n) ** 2, []
    for r in range(n):
        mine = sequence_chunks(T, n, r, zigzag)
        out.append(sum((mine[i][1] - mine[i][0]) * (theirs[j][1] - theirs[j][0])
                       for src in range(n) for theirs in [sequence_chunks(T, n, src, zigzag)]
                       for i, j, _ in block_plan(mine, theirs)) / area)
    return out


def part_balance(world, reps):
    reps *= 3  # cheap: more rounds
    n, L = world.size, T_LONG // world.size
    rng = np.random.default_rng(2 + world.rank)
    q, k, v, dout = (rng.standard_normal((B, CONFIG.n_head, L, HS)).astype("float32") for _ in range(4))
    layouts = {"contiguous": ContextParallel(world, "ring"), "zigzag": ContextParallel(world, "zigzag")}
    wall = {name: [] for name in layouts}
    work = {name: [] for name in layouts}
    with RingWaitClock() as clock:
        for rep in range(reps + 1):
            for name, cp_obj in layouts.items():
                world.barrier()
                clock.cpu = 0.0
                c0, t0 = time.process_time(), time.perf_counter()
                qt, kt, vt = (Tensor(a.copy(), requires_grad=True) for a in (q, k, v))
                cp_obj.attend(qt, kt, vt).backward(dout)
                seconds, cpu = time.perf_counter() - t0, time.process_time() - c0 - clock.cpu
                if rep:
                    wall[name].append(seconds)
                    work[name].append(cpu)
    mine = np.array([[np.median(wall[name]), np.median(work[name])] for name in layouts])  # (2, 2)
    everyone = world.all_gather(mine[None])  # (n, 2 layouts, 2)
    rows = []
    for i, name in enumerate(layouts):
        units = causal_work(T_LONG, n, name == "zigzag")
        rows.append(dict(layout=name, wall_ms=[1e3 * float(x) for x in everyone[:, i, 0]],
                         work_ms=[1e3 * float(x) for x in everyone[:, i, 1]], causal_work=units,
                         computed_blocks=computed_blocks(T_LONG, n, name == "zigzag")))
    if world.rank == 0:
        print(f"\nring attention forward + backward alone, cp = {n}, T = {T_LONG}, B = {B}; per rank, median of {reps}")
        print(f"{'layout':>10} {'':>12} " + "".join(f"{'rank ' + str(r):>9}" for r in range(n)) + f"{'max/min':>9}")
        for r in rows:
            for label, key, fmt in (("causal_work", "causal_work", ".2f"), ("computed", "computed_blocks", ".2f"),
                                    ("work CPU ms", "work_ms", ".1f"),
                                    ("wall ms", "wall_ms", ".1f")):
                vals = r[key]
                print(f"{r['layout']:>10} {label:>12} " + "".join(f"{x:>9{fmt}}" for x in vals)
                      + f"{max(vals) / min(vals):>9.2f}")
    return rows


# ---- the figure -------------------------------------------------------------------------------------

def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 + ("balance" in results)
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2))
    styles = {"one process": dict(color="black", ls="--", marker="s")}
    colors = {1: "tab:gray", 2: "tab:blue", 4: "tab:orange", 8: "tab:green"}
    rows = results["scaling"]
    for name in dict.fromkeys(r["layout"] for r in rows):
        pts = [r for r in rows if r["layout"] == name]
        style = styles.get(name, dict(color=colors.get(pts[0]["cp"]), marker="o"))
        label = {"one process": "one process (keeps T x T probabilities)",
                 "ring cp 1": "ring cp 1 (blockwise, no T x T kept)"}.get(name, name)
        axes[0].plot([r["T"] for r in pts], [r["ms"] for r in pts], label=label, **style)
        axes[1].plot([r["T"] for r in pts], [r["activation_bytes"] / 2**20 for r in pts], label=label, **style)
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(TS, [str(t) for t in TS])
        ax.set_xlabel("sequence length T")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set(ylabel="ms per step (forward + backward), slowest rank",
                title="Step time (4 ranks on 2 cores: not a speed-up test)")
    axes[1].set(ylabel="activations kept for backward per rank (MiB)", title="Activation memory per rank")
    for ax in axes[:2]:
        ax.legend(fontsize=8)
    if "balance" in results:
        ax = axes[2]
        bal = results["balance"]
        n = len(bal[0]["work_ms"])
        x = np.arange(n)
        for i, r in enumerate(bal):
            bars = ax.bar(x + (i - 0.5) * 0.4, r["work_ms"], 0.4, label=f"{r['layout']}")
            for bar, c, u in zip(bars, r["computed_blocks"], r["causal_work"]):
                ax.annotate(f"{c:g}\n({u:g})", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
        ax.margins(y=0.18)
        ax.set_xlabel("labels: blocks computed (causal_work: useful blocks)")
        ax.set_xticks(x, [f"rank {r}" for r in range(n)])
        ax.set(ylabel="CPU ms per rank outside ring waits (fwd + bwd)",
               title=f"Ring attention work per rank, cp {n}, T {T_LONG}")
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"Context parallelism: GPT {CONFIG.n_layer}L {CONFIG.n_embd}d, {CONFIG.n_head} heads, B {B}, float32",
                 fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--reps", type=int, default=7, help="interleaved timed rounds after one warm-up round "
                    "(balance: 3 x as many)")
    ap.add_argument("--json", help="also save the numbers here")
    ap.add_argument("--png", default=str(HERE / "figures" / "context_parallel.png"))
    args = ap.parse_args()
    world = minidist.init(backend="ring")
    results = {}
    for part in args.parts:
        t0 = time.perf_counter()
        results[part] = globals()[f"part_{part}"](world, args.reps)
        world.barrier()
        if world.rank == 0:
            print(f"[{part}: {time.perf_counter() - t0:.0f} s]", flush=True)
    if world.rank == 0:
        if "scaling" in results:
            plot(results, Path(args.png))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
    main()
