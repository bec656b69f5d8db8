"""Population-based training against the best of K fixed runs from the same draws, at the same steps.

    python benchmarks/pbt.py                                   (3 seeds: 6.5 minutes on 2 cores at load 19)
    python benchmarks/pbt.py --seeds 0 --steps 80              (a smoke run: under a minute)
    python benchmarks/pbt.py --lr-range 1e-4 3e-1 --population 8 --steps 400

The question: on the default corpus, does population-based training (train/pbt.py) with K members
reach a lower final validation loss than the best of K fixed-hyper-parameter runs started from the
same initial draws, for the same steps? For each seed of ``--seeds``:

1. The draws: ``population.draw(K, seed, {"lr": ...}, {"lr": (A, B)})``, K learning rates log-uniform
   in ``--lr-range`` A B (default 3e-4 .. 3e-1: the default model trains well near 3e-3, so most seeds
   draw some rates too small for ``--steps`` and some too large). Only the learning rate is drawn and
   explored; every other flag is the trainer's default (the 2-layer, 64-wide GPT, B 16 x T 64, AdamW,
   warm-up 20, cosine to --min-lr, eval_iters 8), ``sample_tokens`` 0.
2. The fixed arm: K runs of the trainer (``train``), one after another in this process, run k with
   the k-th drawn rate, ``--steps`` S steps each, seed = the seed (so the same initial weights, data
   order and validation batches as every member).
3. The PBT arm: ``train_pbt`` on K thread ranks (``run_local``: one rank per member), the same seed,
   the same range (so it draws the same K rates itself), S steps per member, a ready point every
   ``--ready-every`` steps (default S / 8), truncation at quantile ``--quantile`` (0.25: with K 4 the
   worst member copies the best), exploring lr (x0.8 or x1.2, or a fresh draw with probability 0.25).
   Checkpoints and copies go through a temporary folder (the page cache). The script checks that the
   arms start from the same draws: each member's first segment (its loss, learning rate and gradient
   norm at every step, from its metrics.jsonl) equals the first segment of the fixed run with the same
   index, bitwise, or it fails.
4. Same total steps: K x S in each arm (every member runs S steps, like every fixed run; a member that
   copies takes its donor's weights, so PBT's best model has S steps behind it, like the best fixed one).

Reported per seed: the final validation loss of every fixed run (its last step's) and of every member
(at the last ready point: the same step, S - 1, the same 8 validation batches), the best of each arm,
their difference (PBT - fixed: negative means PBT ended lower) and whether PBT won; the wall time of
each arm (fixed: K runs in a row on one thread; PBT: K thread ranks at once, plus a checkpoint per
member per ready point, a model rebuilt and resumed per segment, and the copies; the K ranks are
threads of one interpreter, so on a loaded machine their steps are slower than the same steps run in
a row). A fixed run that diverges (a NaN or inf loss: the trainer stops it) counts as infinitely
bad; a PBT member that diverges copies a live member at the next ready point (population.py); a
population that fails as a whole is reported as a loss for PBT. The comparison is paired (same seed, same draws, same
validation batches), but those batches are 8 x 16 x 64 tokens: a difference of a few thousandths is
within what another draw of them would move.

Threads: one BLAS thread (set before NumPy loads), as the trainer gives each of several ranks on 2 cores.
Results: a Markdown table on stdout and benchmarks/results/pbt.json; ``uptime`` before and after.
"""
import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"  # one BLAS thread per rank: before NumPy loads (as benchmarks/plan.py)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from minidist import run_local  # noqa: E402
from minidist.train import train  # noqa: E402
from minidist.train.config import MIN_LR, TrainConfig  # noqa: E402
from minidist.train.divergence import Diverged  # noqa: E402
from minidist.train.pbt import train_pbt  # noqa: E402
from minidist.train.population import draw  # noqa: E402

SAME = ("step", "loss", "lr", "grad_norm")  # what a member's first segment and its fixed run must share, bitwise


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def base_config(args, seed: int) -> TrainConfig:
    """The trainer's defaults, but for the benchmark's steps, seed, evaluation and sample. --min-lr: the
    default (3e-4), or the range's low end where that is lower, in both arms (a member's --min-lr is the
    population's, and the trainer refuses a --lr below --min-lr: see the report)."""
    return TrainConfig(steps=args.steps, seed=seed, eval_iters=8, sample_tokens=0, min_lr=min(MIN_LR, args.lr_range[0]))


def fixed_runs(args, seed: int, lrs: list[float]) -> tuple[list[dict], float]:
    """The K fixed runs, one after another: ([{lr, val_loss, diverged, rows}], wall seconds)."""
    runs, t0 = [], time.perf_counter()
    for k, lr in enumerate(lrs):
        cfg = dataclasses.replace(base_config(args, seed), lr=lr)
        try:
            history = train(cfg, progress=False, quiet=True)[1]
            runs.append(dict(lr=lr, val_loss=history[-1]["val_loss"], diverged=False,
                             first=[{n: r[n] for n in SAME} for r in history[:args.ready_every]]))
        except Diverged as e:
            runs.append(dict(lr=lr, val_loss=math.inf, diverged=str(e), first=None))
        print(f"seed {seed}: fixed run {k} (lr {lr:.3g}): final val loss {runs[-1]['val_loss']:.4f}", file=sys.stderr,
              flush=True)
    return runs, time.perf_counter() - t0


def population(args, seed: int, folder: Path) -> tuple[dict, float]:
    """The PBT arm on K thread ranks: ({members at the last ready point, history, first segments} or
    {error}, wall seconds)."""
    cfg = dataclasses.replace(base_config(args, seed), mode="pbt", population=args.population,
                              ready_every=args.ready_every, explore="lr", exploit="truncation", quantile=args.quantile,
                              lr_range=tuple(args.lr_range), ckpt_dir=str(folder / "ckpt"), out=str(folder / "out"))
    t0 = time.perf_counter()
    try:  # a generous timeout per wait: a loaded machine may hold a member a whole segment behind the others
        history = run_local(lambda g: train_pbt(cfg, g)[1], args.population, timeout=1800.0)[0]
    except Exception as e:  # noqa: BLE001 -- a member that diverges (or a refused member) fails the population
        return dict(error=f"{type(e).__name__}: {e}"), time.perf_counter() - t0
    wall = time.perf_counter() - t0
    last = [r for r in history if r["step"] == args.steps]
    first = []
    for k in range(args.population):
        lines = (folder / "out" / f"member-{k}" / "metrics.jsonl").read_text().splitlines()[:args.ready_every]
        first.append([{n: json.loads(line)[n] for n in SAME} for line in lines])
    copies = sum(r["donor"] is not None for r in history)  # copies made (none at the last point)
    return dict(members=last, history=history, copies=copies, first=first), wall


def one_seed(args, seed: int) -> dict:
    lrs = [m.hparams["lr"] for m in draw(args.population, seed, {"lr": TrainConfig.lr}, {"lr": tuple(args.lr_range)})]
    fixed, fixed_s = fixed_runs(args, seed, lrs)
    with tempfile.TemporaryDirectory(prefix="minidist-bench-pbt-") as tmp:
        pbt, pbt_s = population(args, seed, Path(tmp))
    if "error" not in pbt:  # the same draws: member k's first segment is fixed run k's, bitwise
        for k, run in enumerate(fixed):
            if run["first"] is not None:
                assert pbt["first"][k] == run["first"], (seed, k, "member's first segment differs from its fixed run")
    best_k = min(range(len(fixed)), key=lambda k: fixed[k]["val_loss"])
    best_fixed = fixed[best_k]["val_loss"]
    row = dict(seed=seed, lrs=lrs, fixed=[{k: v for k, v in r.items() if k != "first"} for r in fixed],
               fixed_wall_s=fixed_s, pbt_wall_s=pbt_s, best_fixed=best_fixed, best_fixed_lr=lrs[best_k])
    if "error" in pbt:
        return dict(row, pbt_error=pbt["error"], best_pbt=math.inf, difference=None, pbt_won=False)
    best = min(pbt["members"], key=lambda r: r["val_loss"])
    return dict(row, pbt_members=pbt["members"], pbt_history=pbt["history"], pbt_copies=pbt["copies"],
                best_pbt=best["val_loss"], best_pbt_member=best["member"], best_pbt_lr=best["lr"],
                difference=best["val_loss"] - best_fixed, pbt_won=best["val_loss"] < best_fixed)


def loss_text(x: float) -> str:
    return "diverged" if not math.isfinite(x) else f"{x:.4f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--population", type=int, default=4, help="K: members, and fixed runs")
    p.add_argument("--steps", type=int, default=200, help="S: steps of every fixed run and of every member")
    p.add_argument("--ready-every", type=int, default=None, help="steps between ready points (default S / 8)")
    p.add_argument("--quantile", type=float, default=0.25)
    p.add_argument("--lr-range", type=float, nargs=2, default=[3e-4, 3e-1], metavar=("A", "B"))
    p.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "pbt.json"))
    args = p.parse_args()
    args.ready_every = args.ready_every or max(1, args.steps // 8)
    results = dict(machine=platform.machine(), python=platform.python_version(), load_before=uptime(),
                   population=args.population, steps=args.steps, ready_every=args.ready_every, quantile=args.quantile,
                   lr_range=args.lr_range, min_lr=min(MIN_LR, args.lr_range[0]), exploit="truncation", explore="lr",
                   model="trainer defaults: 2 layers x 64, 4 heads, B 16 x T 64, AdamW, warmup 20, eval_iters 8",
                   seeds=[])
    for seed in args.seeds:
        results["seeds"].append(one_seed(args, seed))
    results["load_after"] = uptime()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))

    s = results["seeds"]
    print(f"load before: {results['load_before']}\nload after:  {results['load_after']}\n")
    print(f"K {args.population}, S {args.steps} steps each (ready every {args.ready_every}), lr drawn in "
          f"[{args.lr_range[0]:g}, {args.lr_range[1]:g}], truncation quantile {args.quantile}, explore lr\n")
    print("| seed | drawn lr | best fixed (its lr) | PBT's best member (its final lr) | PBT - fixed | PBT lower? | "
          "copies | fixed wall | PBT wall |\n|---|---|---|---|---|---|---|---|---|")
    for r in s:
        drawn = ", ".join(f"{lr:.3g}" for lr in r["lrs"])
        fixed = f"{loss_text(r['best_fixed'])} ({r['best_fixed_lr']:.3g})"
        if "pbt_error" in r:
            print(f"| {r['seed']} | {drawn} | {fixed} | failed: {r['pbt_error'][:80]} | - | no | - | "
                  f"{r['fixed_wall_s']:.0f} s | {r['pbt_wall_s']:.0f} s |")
            continue
        print(f"| {r['seed']} | {drawn} | {fixed} | {r['best_pbt']:.4f} ({r['best_pbt_lr']:.3g}) | "
              f"{r['difference']:+.4f} | {'yes' if r['pbt_won'] else 'no'} | {r['pbt_copies']} | "
              f"{r['fixed_wall_s']:.0f} s | {r['pbt_wall_s']:.0f} s |")
    print("\nEvery run's final validation loss (fixed run k and member k start from the k-th draw):\n")
    print("| seed | " + " | ".join(f"fixed {k}" for k in range(args.population)) + " | "
          + " | ".join(f"member {k}" for k in range(args.population)) + " |\n|---|"
          + "---|" * (2 * args.population))
    for r in s:
        members = ([loss_text(m["val_loss"]) for m in r["pbt_members"]] if "pbt_members" in r
                   else ["failed"] * args.population)
        print(f"| {r['seed']} | " + " | ".join(loss_text(f["val_loss"]) for f in r["fixed"]) + " | "
              + " | ".join(members) + " |")
    won = sum(r["pbt_won"] for r in s)
    diffs = [r["difference"] for r in s if r["difference"] is not None]
    spread = (f"; PBT - best fixed: median {statistics.median(diffs):+.4f}, from {min(diffs):+.4f} to "
              f"{max(diffs):+.4f}" if diffs else "")
    print(f"\nPBT ended lower on {won} of {len(s)} seeds{spread}")


if __name__ == "__main__":
    main()
