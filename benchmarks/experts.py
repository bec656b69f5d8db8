"""Expert-parallelism benchmark: step time, all-to-all bytes and expert memory per rank against ep and top-k.

    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/experts.py     (both parts, about 35 s on 2 shared cores)
    OMP_NUM_THREADS=1 python benchmarks/experts.py --local 4 --reps 10 --json /tmp/e.json --png /tmp/e.png
                                                                     (4 thread ranks in one process, about 10 s)

Bytes depend on the routing, hence on float rounding: with OMP_NUM_THREADS=1 the thread ranks and
the MPI processes route every token alike and count the same bytes.

Every configuration is dp = world size (4), float32, a GPT of 2 layers, 64 wide, 4 heads, block 64,
global batch 16 (4 rows = 256 tokens per rank), every block's MLP a mixture of E = 8 experts
(dropless, balance loss 0.01), AdamW, built as ``python -m minidist.train`` builds it
(``build_parallel``) and stepped with ``train_step``. ep cuts the dp axis: ep 1 is plain data
parallelism (every rank holds the 8 experts, no all-to-all), ep 2 two groups of 2 ranks holding 4
experts each, ep 4 one group of 4 holding 2 each.

Parts (``--parts``, default both):
  traffic  ep in {1, 2, 4} x top-k in {1, 2, 4}, and the dense GPT (its MLP is one expert: the
           active parameters of top-1), all built side by side and stepped in turn: --reps rounds
           after a warm-up round, each step's time the slowest rank's, median. Bytes per step per
           rank, in the four spans "moe dispatch", "moe combine" and their "... backward":
             buffer   the all_to_all events' nbytes in the trace (the whole send buffer, own chunk too);
             wire     the bytes of every message sent on the all-to-all tag, logged by a wrapper
                      around the transport (what leaves the rank: the own chunk is a local copy);
             routing  the prediction from the routing itself (ExpertParallel.sent / .received of
                      every MoE layer, read after the step): rows to other ranks x C x 4 bytes.
           Asserted on every step and every rank: wire == routing and buffer == all rows x C x 4,
           span by span. Beside it, the expectation with (ep-1)/ep of the k N assignments
           crossing, the counts all-to-all (int64, outside the spans), the other bytes each rank
           sends (gradient sync, clip norm, loss, call fingerprints) and the time inside the
           all-to-alls.
  memory   ZeRO-1, ep in {1, 2, 4}, top-k 2: bytes each rank holds in the expert parameters
           (``p.expert``), their gradients and their AdamW moments, measured from the live arrays
           after a step, against E/ep x (C 4C + 4C + 4C C + C) elements x 4 bytes per MoE layer
           (moments: 2 slots over the expert-data-parallel group of dp/ep ranks, numpy.array_split
           sizes). Asserted equal to the byte; and the ZeRO total against ``zero_memory.formula(zero)``.
The figure (figures/experts.png): step time, bytes on the wire and expert memory per rank against ep.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

import minidist
from minidist.comm import ProcessGroup
from minidist.comm.tags import TAG_ALL_TO_ALL
from minidist.comm.transport import Transport
from minidist.parallel.expert.experts import moe_layers
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.data.sampler import DistributedSampler
from minidist.parallel.step import train_step
from minidist.train.build import build_parallel, load_data
from minidist.train.config import TrainConfig
from minidist.inspect import zero_memory
from minidist.optim import OPTIMIZERS

HERE = Path(__file__).resolve().parent
PARTS = ("traffic", "memory")
N_EXPERTS, TOP_KS = 8, (1, 2, 4)
MODEL = dict(n_layer=2, n_head=4, n_embd=64, block_size=64, batch_size=16, dtype="float32", sample_tokens=0)
SPANS = ("moe dispatch", "moe combine", "moe combine backward", "moe dispatch backward")  # in the order they run
ITEMSIZE = 4  # float32


def per_expert(C: int) -> int:
    """Elements of one expert MLP: c_fc (4C, C) + bias 4C, c_proj (C, 4C) + bias C."""
    return C * 4 * C + 4 * C + 4 * C * C + C


class WireLog(Transport):
    """Wraps a transport and notes every message this rank sends, (time, tag, bytes), in ``log``
    (shared with the sub-transports of its splits): what leaves the rank, counted below the
    collectives and independently of the trace."""

    def __init__(self, inner, log=None):
        self.inner, self.rank, self.size, self.timeout, self.name = inner, inner.rank, inner.size, inner.timeout, inner.name
        self.log = log if log is not None else []

    def isend(self, buf, peer, tag=0):
        self.log.append((time.perf_counter(), tag, buf.nbytes))
        return self.inner.isend(buf, peer, tag)

    def irecv(self, buf, peer, tag=0):
        return self.inner.irecv(buf, peer, tag)

    def split(self, color, key):
        sub = self.inner.split(color, key)
        return None if sub is None else WireLog(sub, self.log)

    def abort(self, code=1):
        self.inner.abort(code)

    def peer_gone(self, peer):
        return self.inner.peer_gone(peer)


def logged_world(group):
    """``group``'s ranks again, every message they send logged (:class:`WireLog`); the same trace."""
    return ProcessGroup(WireLog(group.transport), trace=group.trace, name=group.name)


def slowest(world, seconds):
    """A step lasts as long as its slowest rank."""
    return float(world.all_reduce(np.array([seconds]), op="max")[0])


def config(ep, top_k, n_experts=N_EXPERTS, dp=4, zero=0):
    return TrainConfig(**MODEL, dp=dp, ep=ep, n_experts=n_experts, top_k=top_k, zero=zero, lr=1e-3, warmup=0)


# ---- part 1: step time and bytes ---------------------------------------------------------------------

def measured_bytes(events, log):
    """Per span: the all_to_all buffers the trace recorded inside it, the bytes sent on the
    all-to-all tag while it ran, the seconds inside its all_to_alls and their count; "counts": the
    same for the all_to_alls outside the spans (the routing counts); "other": every other message."""
    spans = [e for e in events if e.kind == "compute" and e.op in SPANS]
    out = {name: dict(buffer=0, wire=0, seconds=0.0, calls=0) for name in SPANS + ("counts",)}

    def where(t0, t1):
        for s in spans:
            if s.start <= t0 and t1 <= s.end:
                return s.op
        return "counts"

    for e in events:
        if e.kind == "collective" and e.op == "all_to_all":
            o = out[where(e.start, e.end)]
            o["buffer"] += e.nbytes
            o["seconds"] += e.duration
            o["calls"] += 1
    other = 0
    for t, tag, nbytes in log:
        if tag == TAG_ALL_TO_ALL:
            out[where(t, t)]["wire"] += nbytes
        else:
            other += nbytes
    out["other"] = dict(wire=other)
    return out


def routing_bytes(model, C):
    """What the routing of the step says each span sends: buffers (all rows) and wire (rows to the
    other ranks), x C x 4 bytes, from every MoE layer's ExpertParallel.sent / .received (ep, E/ep).
    The combine's backward sends what the dispatch sent forward, the dispatch's backward what the
    combine sent. And the counts all-to-all: (ep, E/ep) int64, equal chunks."""
    row = C * ITEMSIZE
    out = {name: dict(buffer=0, wire=0) for name in SPANS + ("counts",)}
    rows_in = 0  # rows my experts computed (the load of this rank)
    for moe in moe_layers(model):
        ep = moe.expert_parallel
        if ep is None:
            continue
        me, sent, received = ep.group.rank, ep.sent, ep.received
        out_all, in_all = int(sent.sum()), int(received.sum())
        out_cross, in_cross = out_all - int(sent[me].sum()), in_all - int(received[me].sum())
        for span, (all_rows, cross) in (("moe dispatch", (out_all, out_cross)), ("moe combine", (in_all, in_cross)),
                                        ("moe combine backward", (out_all, out_cross)),
                                        ("moe dispatch backward", (in_all, in_cross))):
            out[span]["buffer"] += all_rows * row
            out[span]["wire"] += cross * row
        out["counts"]["buffer"] += sent.size * 8
        out["counts"]["wire"] += (sent.size - sent[me].size) * 8
        rows_in += in_all
    return out, rows_in


def part_traffic(world, reps):
    eps = [ep for ep in (1, 2, 4, 8) if world.size % ep == 0 and N_EXPERTS % ep == 0]
    meshes = {ep: DeviceMesh(world, dp=world.size, ep=ep) for ep in eps}
    variants = {("dense", 0, 0): config(1, 1, n_experts=0, dp=world.size)}
    variants.update({("moe", ep, k): config(ep, k, dp=world.size) for ep in eps for k in TOP_KS})
    log = world.transport.log
    built = {}
    for key, cfg in variants.items():
        mesh = meshes[key[1] or 1]
        model, state, _ = build_parallel(cfg, mesh)
        sampler = DistributedSampler(TOKENS, cfg.batch_size, cfg.block_size, cfg.seed, mesh.dp_rank, cfg.dp)
        built[key] = (cfg, mesh, model, state, sampler)
    times = {key: [] for key in variants}
    sums = {key: None for key in variants}  # this rank's bytes, summed over the timed steps
    for rep in range(reps + 1):  # round 0: warm-up
        for key, (cfg, mesh, model, state, sampler) in built.items():
            batch = sampler.batch(rep)
            world.barrier()
            log.clear()
            with world.trace.capture() as events:
                t0 = time.perf_counter()
                train_step(model, state, batch, cfg.lr, cfg.grad_clip, mesh=mesh, trace=world.trace)
                seconds = time.perf_counter() - t0
            got = measured_bytes(events, list(log))
            want, rows_in = routing_bytes(model, cfg.n_embd)
            for span in SPANS + ("counts",):  # the trace, the wire and the routing agree, span by span
                assert got[span]["wire"] == want[span]["wire"], (key, rep, world.rank, span, got[span], want[span])
                assert got[span]["buffer"] == want[span]["buffer"], (key, rep, world.rank, span, got[span], want[span])
                moe = cfg.n_experts > 0 and cfg.ep > 1
                assert got[span]["calls"] == (cfg.n_layer if moe else 0), (key, span, got[span])
            seconds = slowest(world, seconds)
            if rep:
                times[key].append(seconds)
                flat = np.array([got[s][f] for s in SPANS + ("counts",) for f in ("buffer", "wire", "seconds")]
                                + [got["other"]["wire"], rows_in], dtype=np.float64)
                sums[key] = flat if sums[key] is None else sums[key] + flat
    rows = []
    N = MODEL["batch_size"] // world.size * MODEL["block_size"]  # tokens per rank
    for key, cfg in variants.items():
        per_step = sums[key] / reps  # this rank's mean per timed step
        everyone = world.all_gather(per_step[None])  # (world, fields)
        names = [f"{s}|{f}" for s in SPANS + ("counts",) for f in ("buffer", "wire", "seconds")] + ["other", "rows_in"]
        mean, lo, hi = everyone.mean(axis=0), everyone.min(axis=0), everyone.max(axis=0)
        kind, ep, k = key
        C = cfg.n_embd
        expected = (ep - 1) / ep * k * N * C * ITEMSIZE * cfg.n_layer if kind == "moe" else 0.0  # per span
        row = dict(kind=kind, ep=ep, top_k=k, n_experts=cfg.n_experts, ms=1e3 * float(np.median(times[key])),
                   ms_min=1e3 * min(times[key]), ms_steps=[1e3 * t for t in times[key]], tokens_per_rank=N, expected_wire_per_span=expected,
                   mean={n: float(v) for n, v in zip(names, mean)}, min={n: float(v) for n, v in zip(names, lo)},
                   max={n: float(v) for n, v in zip(names, hi)})
        row["wire_moe"] = sum(row["mean"][f"{s}|wire"] for s in SPANS)
        row["wire_moe_max_rank"] = float(everyone[:, [names.index(f"{s}|wire") for s in SPANS]].sum(axis=1).max())
        row["buffer_moe"] = sum(row["mean"][f"{s}|buffer"] for s in SPANS)
        row["a2a_ms"] = 1e3 * sum(row["mean"][f"{s}|seconds"] for s in SPANS + ("counts",))
        rows.append(row)
    if world.rank == 0:
        dense = next(r for r in rows if r["kind"] == "dense")
        print(f"MoE GPT {MODEL['n_layer']}L {MODEL['n_embd']}d, E = {N_EXPERTS}, dp = {world.size}, {N} tokens per "
              f"rank, float32; median of {reps} steps; bytes per step per rank (mean over ranks), KiB")
        print(f"{'model':>6} {'ep':>3} {'k':>2} {'ms/step':>8} {'/dense':>6} {'min ms':>7} {'disp':>7} {'comb':>7} {'comb bw':>7} "
              f"{'disp bw':>7} {'wire':>8} {'max rank':>8} {'(ep-1)/ep':>9} {'buffer':>8} {'counts B':>8} "
              f"{'other':>8} {'a2a ms':>7} {'rows max/mean':>13}")
        for r in rows:
            m = r["mean"]
            kib = [m[f"{s}|wire"] / 1024 for s in SPANS]
            imbalance = r["max"]["rows_in"] / m["rows_in"] if m["rows_in"] else float("nan")
            print(f"{r['kind']:>6} {r['ep']:>3} {r['top_k']:>2} {r['ms']:>8.1f} {r['ms'] / dense['ms']:>6.2f} {r['ms_min']:>7.1f} "
                  + "".join(f"{x:>8.1f}" for x in kib)
                  + f"{r['wire_moe'] / 1024:>9.1f}{r['wire_moe_max_rank'] / 1024:>9.1f}"
                  f"{4 * r['expected_wire_per_span'] / 1024:>10.1f}{r['buffer_moe'] / 1024:>9.1f}"
                  f"{m['counts|wire']:>9.0f}{m['other'] / 1024:>9.1f}{r['a2a_ms']:>8.2f}{imbalance:>14.2f}")
    return rows


# ---- part 2: memory per rank ---------------------------------------------------------------------------

def part_memory(world, reps):
    eps = [ep for ep in (1, 2, 4, 8) if world.size % ep == 0 and N_EXPERTS % ep == 0]
    rows = []
    for ep in eps:
        cfg = config(ep, 2, dp=world.size, zero=1)
        mesh = DeviceMesh(world, dp=world.size, ep=ep)
        model, state, _ = build_parallel(cfg, mesh)
        sampler = DistributedSampler(TOKENS, cfg.batch_size, cfg.block_size, cfg.seed, mesh.dp_rank, cfg.dp)
        train_step(model, state, sampler.batch(0), cfg.lr, cfg.grad_clip, mesh=mesh, trace=world.trace)
        experts = [p for p in model.parameters() if p.expert]
        others = [p for p in model.parameters() if not p.expert]
        expert_shards = [s for s in state.shards if s.unit.params[0][1].expert]
        n_moe = len(moe_layers(model))
        unit = N_EXPERTS // ep * per_expert(cfg.n_embd)  # elements of one layer's experts on this rank
        replicas = mesh.expert_dp_group.size  # dp / ep: the ranks holding the same experts
        shard = len(np.array_split(np.arange(unit), replicas)[mesh.expert_dp_group.rank])
        measured = dict(parameters=sum(p.data.nbytes for p in experts), gradients=sum(p.grad.nbytes for p in experts),
                        optimizer=sum(a.nbytes for s in expert_shards for a in s.state.values()),
                        dense_parameters=sum(p.data.nbytes for p in others))
        formula = dict(parameters=n_moe * unit * ITEMSIZE, gradients=n_moe * unit * ITEMSIZE,
                       optimizer=n_moe * shard * len(OPTIMIZERS[cfg.optimizer].slots) * ITEMSIZE)
        for name, value in formula.items():
            assert measured[name] == value, (ep, world.rank, name, measured[name], value)
        total, want = zero_memory.model_state_bytes(state), zero_memory.formula(state)
        assert total == want, (ep, world.rank, total, want)
        mine = np.array([measured[n] for n in ("parameters", "gradients", "optimizer", "dense_parameters")]
                        + [sum(total.values())], dtype=np.float64)
        everyone = world.all_gather(mine[None])  # (world, 5)
        rows.append(dict(ep=ep, zero=1, top_k=2, n_moe_layers=n_moe, experts_per_rank=N_EXPERTS // ep,
                         per_expert_elements=per_expert(cfg.n_embd), expert_dp=replicas, formula=formula,
                         per_rank=[dict(zip(("parameters", "gradients", "optimizer", "dense_parameters",
                                             "model_states_total"), map(int, r))) for r in everyone]))
    if world.rank == 0:
        print(f"\nexpert memory per rank, ZeRO-1, AdamW, float32, E = {N_EXPERTS}, dp = {world.size} (bytes; "
              f"every rank measured equal to the formula)")
        print(f"{'ep':>3} {'experts':>7} {'edp':>4} {'params':>10} {'formula':>10} {'grads':>10} {'moments':>10} "
              f"{'formula':>10} {'dense params':>12} {'all states':>11}")
        for r in rows:
            p, f = r["per_rank"][0], r["formula"]
            print(f"{r['ep']:>3} {r['experts_per_rank']:>7} {r['expert_dp']:>4} {p['parameters']:>10,} "
                  f"{f['parameters']:>10,} {p['gradients']:>10,} {p['optimizer']:>10,} {f['optimizer']:>10,} "
                  f"{p['dense_parameters']:>12,} {p['model_states_total']:>11,}")
    return rows


# ---- the figure -------------------------------------------------------------------------------------

def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in PARTS if p in results]
    fig, axes = plt.subplots(1, 2 * ("traffic" in results) + ("memory" in results), figsize=(16, 4.4), squeeze=False)
    axes = list(axes[0])
    colors = {1: "tab:blue", 2: "tab:orange", 4: "tab:green"}
    if "traffic" in panels:
        rows = results["traffic"]
        dense = next(r for r in rows if r["kind"] == "dense")
        ax_t, ax_b = axes[0], axes[1]
        for k in TOP_KS:
            pts = [r for r in rows if r["kind"] == "moe" and r["top_k"] == k]
            eps = [r["ep"] for r in pts]
            ax_t.plot(eps, [r["ms"] for r in pts], marker="o", color=colors[k], label=f"MoE top-{k}, median")
            ax_t.plot(eps, [r["ms_min"] for r in pts], marker="o", mfc="none", ls=":", color=colors[k],
                      label=f"MoE top-{k}, fastest step")
            ax_b.plot(eps, [r["wire_moe"] / 1024 for r in pts], marker="o", color=colors[k],
                      label=f"all-to-all, top-{k} (mean rank)")
            ax_b.plot(eps, [r["wire_moe_max_rank"] / 1024 for r in pts], marker="v", ls="none", color=colors[k],
                      alpha=0.6)
            ax_b.plot(eps, [4 * r["expected_wire_per_span"] / 1024 for r in pts], ls="--", color="black", lw=0.8,
                      label="4 x (ep-1)/ep x k N C x 4 B x layers" if k == TOP_KS[0] else None)
        moe_k = [r for r in rows if r["kind"] == "moe" and r["top_k"] == TOP_KS[0]]
        ax_b.plot([r["ep"] for r in moe_k], [r["mean"]["other"] / 1024 for r in moe_k], marker="s", color="gray",
                  label="all other messages (gradient sync, ...), any k")
        ax_t.axhline(dense["ms"], color="black", ls="-", lw=0.8, label="dense GPT (= top-1 active params), median")
        ax_t.axhline(dense["ms_min"], color="black", ls=":", lw=0.8, label="dense GPT, fastest step")
        ax_t.set(ylabel="ms per step (slowest rank, median)", title="Step time, dp 4 (4 ranks on 2 cores)")
        ax_t.set_ylim(bottom=0)
        ax_b.set(ylabel="KiB sent per step per rank (wire)",
                 title="Bytes each rank sends per step")
        ax_b.plot([], [], marker="v", ls="none", color="gray", label="busiest rank")
        for ax in (ax_t, ax_b):
            ax.set_xscale("log", base=2)
            ax.set_xticks([1, 2, 4], ["1", "2", "4"])
            ax.set_xlabel("expert-parallel ranks ep (E = 8 experts)")
            ax.grid(True, alpha=0.3)
        ax_t.set_ylim(0, 1.45 * max(r["ms"] for r in rows))
        ax_t.legend(fontsize=6.5, ncol=2, loc="upper left")
        ax_b.legend(fontsize=7)
    if "memory" in panels:
        ax = axes[-1]
        rows = results["memory"]
        eps = [r["ep"] for r in rows]
        x = np.arange(len(eps))
        for i, (name, label) in enumerate((("parameters", "expert parameters"), ("gradients", "expert gradients"),
                                           ("optimizer", "expert AdamW moments (ZeRO-1)"),
                                           ("dense_parameters", "non-expert parameters"))):
            vals = [r["per_rank"][0][name] / 2**20 for r in rows]
            ax.bar(x + (i - 1.5) * 0.2, vals, 0.2, label=label)
        ax.plot(x - 0.3, [r["formula"]["parameters"] / 2**20 for r in rows], "k_", markersize=16, mew=2,
                label="formula (E/ep x per-expert x 4 B x layers; moments / (dp/ep) x 2)")
        ax.plot(x + 0.1, [r["formula"]["optimizer"] / 2**20 for r in rows], "k_", markersize=16, mew=2)
        ax.set_xticks(x, [f"ep {e}\n({N_EXPERTS // e} experts/rank)" for e in eps])
        ax.set(ylabel="MiB per rank", title="Expert memory per rank (ZeRO-1, dp 4)")
        ax.set_ylim(0, 1.45 * max(r["per_rank"][0]["parameters"] for r in rows) / 2**20)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Expert parallelism: MoE GPT {MODEL['n_layer']}L {MODEL['n_embd']}d, E = {N_EXPERTS}, "
                 f"block {MODEL['block_size']}, batch {MODEL['batch_size']}, float32", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=120)


def run(world, args):
    """Every part on ``world`` (every rank); rank 0 prints, and returns the results."""
    world = logged_world(world)
    results = {"load_start": list(os.getloadavg())}
    for part in args.parts:
        t0 = time.perf_counter()
        results[part] = globals()[f"part_{part}"](world, args.reps)
        world.barrier()
        if world.rank == 0:
            print(f"[{part}: {time.perf_counter() - t0:.0f} s]", flush=True)
    results["load_end"] = list(os.getloadavg())
    return results if world.rank == 0 else None


TOKENS = load_data(TrainConfig(**MODEL))[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--reps", type=int, default=30, help="timed steps of each configuration after one warm-up step")
    ap.add_argument("--local", type=int, metavar="N", help="N thread ranks in this process instead of MPI")
    ap.add_argument("--json", default=str(HERE / "results" / "experts.json"))
    ap.add_argument("--png", default=str(HERE / "figures" / "experts.png"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.local:
        results = minidist.run_local(lambda group: run(group, args), args.local)[0]
        transport = f"{args.local} thread ranks in one process (LocalTransport)"
    else:
        world = minidist.init(backend="ring")
        results = run(world, args)
        transport = f"{world.size} MPI processes (mpi4py), backend 'ring'"
    if results is None:
        return
    results.update(transport=transport, wall_s=time.perf_counter() - t0, nproc=os.cpu_count(),
                   machine=platform.platform(), omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
                   model=dict(MODEL, n_experts=N_EXPERTS), reps=args.reps)
    print(f"load average {results['load_start']} -> {results['load_end']}, {results['wall_s']:.0f} s")
    if "traffic" in results or "memory" in results:
        plot(results, Path(args.png))
    Path(args.json).parent.mkdir(exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
