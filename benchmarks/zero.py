"""ZeRO benchmark: bytes per rank against stage and dp size, and the step time of each stage.

    mpiexec -n 4 python benchmarks/zero.py                     (all parts, about 50 s on 2 shared cores)
    mpiexec -n 4 python benchmarks/zero.py --parts mixed pipeline

Parts (``--parts``, default all):
  float32    dp = 4 is the world, dp = 2 the world split in two pairs, dp = 1 each rank alone. For each
             stage a 4-layer, 128-wide float32 GPT (AdamW, B = 8 x T = 64 global): parameters,
             gradients, optimizer state, activations (the graph before backward) measured from the
             live arrays after backward and gradient reduction, next to the ZeRO formula; median step.
             -> results/zero.json, figures/zero_memory.png
  mixed      the same model in float16 with float32 masters and moments (AdamW, dp = 4): bytes rank 0
             holds per stage 0-3, split as the paper's 2 Psi + 2 Psi + 12 Psi, against it.
             -> results/zero_mixed_precision.json
  recompute  ZeRO-3 before and after removing its forced recomputation, in ONE run: no ZeRO, ZeRO-2,
             ZeRO-3 (saved-tensor hooks re-gather the weights for backward, activations kept) and
             ZeRO-3 + --recompute (= the old ZeRO-3: every block re-runs its forward in backward),
             float32, dp = 4, global batch 16 x 64; the step of each measured in turn, REPS rounds
             (interleaved, so load on the machine hits all alike), median; and each one's activation
             bytes. -> results/zero_recompute.json
  pipeline   ZeRO-2 and ZeRO-3 under a 2-stage 1F1B pipeline (dp 2 x pp 2, m = 2, 4, 8 micro-batches):
             the dp group's bytes per step from the trace (nccl-tests' factors) against
             (N-1)/N (G + P): one reduce-scatter of the gradients after the last backward, one
             all-gather of the parameters (ZeRO-2: after the update; ZeRO-3: at the first forward,
             kept to the last backward), whatever m. -> results/zero_pipeline.json
"""
import argparse
import json
import time
from pathlib import Path

import numpy as np

import minidist
from minidist.amp import DynamicLossScaler
from minidist.data import get_batch, inputs_and_targets
from minidist.model import GPT, GPTConfig
from minidist.inspect.accounting import bus_bytes, unique_nbytes
from minidist.parallel.mesh import DeviceMesh
from minidist.nn.recompute import recompute_blocks
from minidist.parallel.step import train_step
from minidist.parallel.zero.full_state import full_parameters
from minidist.parallel.zero.optimizer import ZeroOptimizer
from minidist.train.build import build_parallel
from minidist.train.config import TrainConfig
from minidist.inspect import zero_memory
from minidist.parallel.compose.gradients import apply_gradients

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
BATCH, STEPS = 8, 6
TIMED_BATCH, REPS = 16, 11  # recompute part: compute dominates the step
HERE = Path(__file__).resolve().parent
TOKENS = np.random.default_rng(0).integers(0, 256, size=100_000)
PARTS = ("float32", "mixed", "recompute", "pipeline")


def measure(group, stage):
    """(bytes held by this rank, median step seconds) for ``stage`` on dp group ``group``."""
    model = GPT(CONFIG, seed=0, dtype="float32")
    zero = ZeroOptimizer(model, group, stage, "adamw", lr=1e-3, weight_decay=0.1)
    rows = np.array_split(np.arange(BATCH), group.size)[group.rank]
    times, held = [], None
    for step in range(STEPS):
        idx, targets = inputs_and_targets(get_batch(TOKENS, step, BATCH, CONFIG.block_size))
        t0 = time.perf_counter()
        zero.zero_grad()
        _, loss = model(idx[rows], targets[rows])
        activations = zero_memory.activation_bytes(zero, loss)
        loss.backward()
        zero.reduce()
        if held is None:
            held = {**zero_memory.model_state_bytes(zero), "activations": activations,
                    "formula": sum(zero_memory.formula(zero).values())}
        apply_gradients(zero, 1e-3, 1.0)
        times.append(time.perf_counter() - t0)
    return held, float(np.median(times[1:]))


def part_float32(world):
    groups = {world.size: world, 2: world.split(world.rank // 2, name="pair"), 1: world.split(world.rank, name="self")}
    rows = []
    for dp in sorted(groups):
        for stage in (0, 1, 2, 3):
            world.barrier()
            held, seconds = measure(groups[dp], stage)
            rows.append(dict(dp=dp, stage=stage, **held, ms_per_step=1e3 * seconds))
    if world.rank == 0:
        print(f"{'dp':>3} {'stage':>5} {'params':>9} {'grads':>9} {'optim':>9} {'states':>9} {'formula':>9} "
              f"{'activ.':>9} {'ms/step':>8}   (KiB per rank)")
        for r in rows:
            states = r["parameters"] + r["gradients"] + r["optimizer"]
            print(f"{r['dp']:>3} {r['stage']:>5} {r['parameters'] / 1024:>9.0f} {r['gradients'] / 1024:>9.0f} "
                  f"{r['optimizer'] / 1024:>9.0f} {states / 1024:>9.0f} {r['formula'] / 1024:>9.0f} "
                  f"{r['activations'] / 1024:>9.0f} {r['ms_per_step']:>8.1f}")
        save("zero.json", rows)
        plot(rows)


def part_mixed(world):
    """float16 + AdamW on dp = world: what rank 0 holds per stage, against 2 Psi + 2 Psi + 12 Psi."""
    rows = []
    rank_rows = np.array_split(np.arange(BATCH), world.size)[world.rank]
    for stage in (0, 1, 2, 3):
        model = GPT(CONFIG, seed=0, dtype="float16")
        zero = ZeroOptimizer(model, world, stage, "adamw", lr=1e-3, weight_decay=0.1, mixed_precision="float16",
                             scaler=DynamicLossScaler(group=world))
        idx, targets = inputs_and_targets(get_batch(TOKENS, 0, BATCH, CONFIG.block_size))
        zero.zero_grad()
        _, loss = model(idx[rank_rows], targets[rank_rows])
        loss.backward(np.full_like(loss.data, zero.scaler.scale))
        zero.reduce()
        held = zero_memory.model_state_bytes(zero)
        masters = unique_nbytes([s.param.data for s in zero.shards])
        psi = sum(s.unit.numel for s in zero.shards)  # full units, every stage
        n = world.size
        paper = {"parameters": 2 * psi / (n if stage >= 3 else 1), "gradients": 2 * psi / (n if stage >= 2 else 1),
                 "masters": 4 * psi / (n if stage >= 1 else 1), "moments": 8 * psi / (n if stage >= 1 else 1)}
        measured = {"parameters": held["parameters"], "gradients": held["gradients"], "masters": masters,
                    "moments": held["optimizer"] - masters}
        rows.append(dict(dp=n, stage=stage, psi=psi, measured=measured, paper=paper,
                         formula_total=sum(zero_memory.formula(zero).values())))
        assert apply_gradients(zero, 1e-3, 1.0, zero.scaler) is not None  # no overflow
    if world.rank == 0:
        print(f"\nfloat16 + AdamW, dp = {world.size}, Psi = {rows[0]['psi']:,}: bytes rank 0 holds after backward")
        print(f"{'stage':>5} {'params f16':>11} {'grads f16':>11} {'master f32':>11} {'moments f32':>12} "
              f"{'total':>11} {'paper':>11} {'bytes/Psi':>9}")
        for r in rows:
            m, total = r["measured"], sum(r["measured"].values())
            print(f"{r['stage']:>5} " + "".join(f"{m[k]:>12,}" for k in m)[1:]
                  + f" {total:>11,} {sum(r['paper'].values()):>11,.0f} {total / r['psi']:>9.2f}")
            assert m == {k: int(v) for k, v in r["paper"].items()} and total == r["formula_total"]
        save("zero_mixed_precision.json", rows)


def part_recompute(world):
    """No ZeRO, ZeRO-2, ZeRO-3 (hooks), ZeRO-3 + recompute: step times interleaved, activation bytes."""
    variants = {"no ZeRO": (0, False), "ZeRO-2": (2, False), "ZeRO-3": (3, False), "ZeRO-3 + recompute": (3, True)}
    built = {}
    for name, (stage, recompute) in variants.items():
        model = GPT(CONFIG, seed=0, dtype="float32")
        if recompute:
            recompute_blocks(model)  # the old ZeRO-3 did this to every block, forced
        built[name] = (model, ZeroOptimizer(model, world, stage, "adamw", lr=1e-3, weight_decay=0.1))
    rows = np.array_split(np.arange(TIMED_BATCH), world.size)[world.rank]
    times = {name: [] for name in variants}
    activations = {}
    for rep in range(REPS + 1):  # round 0: warm-up
        idx, targets = inputs_and_targets(get_batch(TOKENS, rep, TIMED_BATCH, CONFIG.block_size))
        for name, (model, zero) in built.items():
            world.barrier()
            t0 = time.perf_counter()
            zero.zero_grad()
            _, loss = model(idx[rows], targets[rows])
            if rep == 0:
                activations[name] = zero_memory.activation_bytes(zero, loss)
            loss.backward()
            apply_gradients(zero, 1e-3, 1.0)
            world.barrier()
            if rep > 0:
                times[name].append(time.perf_counter() - t0)
    for name, (model, zero) in built.items():  # the same updates whatever the memory trade-off
        with full_parameters(zero):
            ref = built["no ZeRO"][0].transformer.h[0].attn.c_attn.weight.data
            w = model.transformer.h[0].attn.c_attn.weight.data
            assert np.allclose(w, ref, rtol=1e-5, atol=1e-6), name
    med = {name: float(np.median(t)) for name, t in times.items()}
    out = [dict(variant=name, stage=variants[name][0], recompute=variants[name][1], ms_median=1e3 * med[name],
                ms_all=[1e3 * t for t in times[name]], ratio_to_zero2=med[name] / med["ZeRO-2"],
                activation_bytes=activations[name]) for name in variants]
    if world.rank == 0:
        print(f"\nfloat32, dp = {world.size}, global batch {TIMED_BATCH} x {CONFIG.block_size}, "
              f"{REPS} interleaved rounds (median):")
        print(f"{'variant':>20} {'ms/step':>9} {'/ ZeRO-2':>9} {'activations KiB':>16}")
        for r in out:
            print(f"{r['variant']:>20} {r['ms_median']:>9.1f} {r['ratio_to_zero2']:>9.2f} "
                  f"{r['activation_bytes'] / 1024:>16.0f}")
        save("zero_recompute.json", out)


def part_pipeline(world):
    """ZeRO-2 / ZeRO-3 under dp 2 x pp 2 (1F1B): dp bytes per step from the trace vs (N-1)/N (G + P)."""
    if world.size != 4:
        return
    mesh = DeviceMesh(world, dp=2, pp=2)
    out = []
    for zero_stage in (2, 3):
        for m in (2, 4, 8):
            cfg = TrainConfig(dp=2, pp=2, zero=zero_stage, micro_batches=m, schedule="1f1b", n_layer=CONFIG.n_layer,
                              n_head=CONFIG.n_head, n_embd=CONFIG.n_embd, block_size=CONFIG.block_size,
                              batch_size=TIMED_BATCH, lr=1e-3)
            model, optimizer, engine = build_parallel(cfg, mesh)
            n = mesh.dp_group.size
            rows = np.array_split(np.arange(TIMED_BATCH), n)[mesh.dp_rank]
            sent, seconds = [], []
            for step in range(3):  # step 0: warm-up
                batch = get_batch(TOKENS, step, TIMED_BATCH, CONFIG.block_size)[rows]  # (B/dp, T+1)
                world.barrier()
                t0 = time.perf_counter()
                with world.trace.capture() as events:
                    train_step(model, optimizer, batch, 1e-3, 1.0, engine=engine, mesh=mesh, n_micro=m,
                               trace=world.trace)
                seconds.append(time.perf_counter() - t0)
                sent.append(bus_bytes(events, mesh.dp_group.name, n))
            numel = sum(s.unit.numel for s in optimizer.shards)  # this pipeline stage's full units
            p_bytes = numel * 4  # float32: P = G = 4 bytes x numel
            formula = (n - 1) / n * (p_bytes + p_bytes)
            last = sent[-1]
            out.append(dict(zero=zero_stage, pp_rank=mesh.pp_rank, micro_batches=m, stage_numel=numel,
                            reduce_scatter=last["reduce_scatter"], all_gather=last["all_gather"],
                            all_reduce=last["all_reduce"], total=last["total"], formula=formula,
                            ms_median=1e3 * float(np.median(seconds[1:]))))
    everyone = world.all_gather(np.array([[r["zero"], r["pp_rank"], r["micro_batches"], r["stage_numel"],
                                           r["reduce_scatter"], r["all_gather"], r["all_reduce"], r["formula"],
                                           r["ms_median"]] for r in out])[None])  # (world, rows, 9)
    if world.rank == 0:
        keys = ("zero", "pp_rank", "micro_batches", "stage_numel", "reduce_scatter", "all_gather", "all_reduce",
                "formula", "ms_median")
        table = [dict(zip(keys, map(float, row)), world_rank=r) for r, rank_rows in enumerate(everyone)
                 for row in rank_rows]
        print("\nZeRO under dp 2 x pp 2 (1F1B), float32: bytes each rank sends over its dp group per step")
        print(f"{'zero':>4} {'pp rank':>7} {'m':>3} {'stage numel':>11} {'reduce-scatter':>14} {'all-gather':>11} "
              f"{'scalars':>8} {'(N-1)/N (G+P)':>14} {'ms/step':>8}")
        seen = set()
        for t in sorted(table, key=lambda t: (t["zero"], t["pp_rank"], t["micro_batches"])):
            key = (t["zero"], t["pp_rank"], t["micro_batches"])
            if key in seen:
                continue  # the other dp rank of the same stage sends the same
            seen.add(key)
            rs_ag = t["reduce_scatter"] + t["all_gather"]
            assert rs_ag == t["formula"], (key, rs_ag, t["formula"])
            print(f"{t['zero']:>4.0f} {t['pp_rank']:>7.0f} {t['micro_batches']:>3.0f} {t['stage_numel']:>11,.0f} "
                  f"{t['reduce_scatter']:>14,.0f} {t['all_gather']:>11,.0f} {t['all_reduce']:>8,.0f} "
                  f"{t['formula']:>14,.0f} {t['ms_median']:>8.1f}")
        save("zero_pipeline.json", table)


def save(name, rows):
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / name).write_text(json.dumps(rows, indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    args = ap.parse_args()
    world = minidist.init()
    for part in args.parts:
        t0 = time.perf_counter()
        globals()[f"part_{part}"](world)
        world.barrier()
        if world.rank == 0:
            print(f"[{part}: {time.perf_counter() - t0:.0f} s]", flush=True)


def plot(rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for stage in (0, 1, 2, 3):
        pts = [r for r in rows if r["stage"] == stage]
        ax.plot([r["dp"] for r in pts], [(r["parameters"] + r["gradients"] + r["optimizer"]) / 2**20 for r in pts],
                marker="o", label=f"stage {stage}")
    ax.set(xlabel="data-parallel ranks N", ylabel="model states per rank (MiB)", xticks=[1, 2, 4],
           title="ZeRO: parameters + gradients + AdamW state per rank (float32)")
    ax.legend()
    (HERE / "figures").mkdir(exist_ok=True)
    fig.savefig(HERE / "figures" / "zero_memory.png", dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
