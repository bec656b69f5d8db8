"""Random search, Bayesian optimization (GP), GP with ASHA and population-based training on the same
task and the same total steps: the best validation loss found against the steps spent.

    python benchmarks/search.py                          (3 seeds)
    python benchmarks/search.py --seeds 0 --budget 40    (a smoke run)

The task: the learning rate of a small GPT (1 layer x 32, 4 heads, B 8 x T 32, AdamW, warm-up 4,
cosine to --min-lr, float64, eval_iters 4 on the default corpus) in [--lr-range A B] (default 1e-4 ..
1, log scale), each run ``--budget`` S steps (default 60); ``--runs`` R such runs' steps in all
(default 8: 480 steps). For each seed of ``--seeds``, four arms, each on thread ranks in this
process (``run_local``), one rank per run at a time:

    random     --mode search --sampler random --trials R --parallel 2 (every trial its whole budget)
    gp         --sampler gp --batch-rule believer, the same trials (its first d + 1 = 2 are random's)
    gp+asha    --sampler gp --scheduler asha --grace S/10 --reduction 3, trials until R x S steps are spent
               (6 R trials asked, enough to spend them; its curve is read up to R x S)
    pbt        --mode pbt --population R, S steps each, ready every S / 6, truncation 0.25, explore lr:
               R x S steps; its curve has one point, at the end (the best member's loss at step S)

The loss compared is the validation loss at the end of a run's budget (S steps): a search's best
completed trial so far after every trial ends (its ``spent``: the steps every trial ran together,
early-stopped ones' included), PBT's best member at the end. Reported per seed: each arm's best at
a quarter, half and all of the R x S steps, and which arm found the lowest at the end; then the
mean over the seeds. Results: a Markdown table on stdout, benchmarks/results/search.json and
benchmarks/figures/search.png (each arm's best loss against the steps spent, a line per seed);
``uptime`` before and after.
"""
import argparse
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

os.environ["OMP_NUM_THREADS"] = "1"  # one BLAS thread per rank: before NumPy loads (as benchmarks/pbt.py)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from minidist import run_local  # noqa: E402
from minidist.inspect.trials import best_curve  # noqa: E402
from minidist.train.config import TrainConfig  # noqa: E402
from minidist.train.pbt import train_pbt  # noqa: E402
from minidist.train.search import train_search  # noqa: E402

TASK = dict(n_layer=1, n_head=4, n_embd=32, block_size=32, batch_size=8, eval_iters=4, eval_every=1000,
            sample_tokens=0, warmup=4, dtype="float64", min_lr=1e-5)
ARMS = ("random", "gp", "gp+asha", "pbt")


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def search_arm(args, seed: int, arm: str, folder: Path) -> list[tuple[int, float]]:
    """The arm's curve: (steps spent, best loss at the end of a budget so far), up to R x S steps."""
    asha = arm == "gp+asha"
    cfg = TrainConfig(**TASK, seed=seed, steps=args.budget, mode="search", parallel=2, lr_range=tuple(args.lr_range),
                      log_scale="lr", sampler="random" if arm == "random" else "gp", batch_rule="believer",
                      scheduler="asha" if asha else "none", grace=max(1, args.budget // 10), reduction=3,
                      trials=6 * args.runs if asha else args.runs, ckpt_dir=str(folder / "ckpt"), out=str(folder / "out"))
    state = run_local(lambda g: train_search(cfg, g), 2, timeout=1800.0)[0]
    rows = [t.to_json() for t in state.trials]
    return [(spent, loss) for spent, loss in best_curve(rows) if spent <= args.runs * args.budget]


def pbt_arm(args, seed: int, folder: Path) -> list[tuple[int, float]]:
    """PBT's curve: one point, R x S steps and its best member's loss at the end."""
    cfg = TrainConfig(**TASK, seed=seed, steps=args.budget, mode="pbt", population=args.runs,
                      ready_every=max(1, args.budget // 6), explore="lr", exploit="truncation", quantile=0.25,
                      lr_range=tuple(args.lr_range), ckpt_dir=str(folder / "ckpt"), out=str(folder / "out"))
    history = run_local(lambda g: train_pbt(cfg, g)[1], args.runs, timeout=1800.0)[0]
    last = [r["val_loss"] for r in history if r["step"] == args.budget and math.isfinite(r["val_loss"])]
    return [(args.runs * args.budget, min(last))] if last else []


def best_at(curve, spent: int) -> float:
    """The best loss of ``curve`` found within ``spent`` steps (inf: none yet)."""
    return min((loss for s, loss in curve if s <= spent), default=math.inf)


def draw(path: str, results: dict, total: int) -> None:
    """Each arm's best loss against the steps spent: thin, each seed's; thick, their mean wherever every
    seed has found one (PBT: a point at the end, each seed's and the mean)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colours = dict(zip(ARMS, ("#7f7f7f", "#1f77b4", "#2ca02c", "#d62728")))
    grid = list(range(results["budget"], total + 1, max(1, results["budget"] // 10)))
    for arm in ARMS:
        curves = [row["curves"][arm] for row in results["seeds"]]
        if arm == "pbt":
            ends = [best_at(c, total) for c in curves if c]
            ax.plot([total] * len(ends), ends, "D", color=colours[arm], alpha=0.35, ms=5)
            ax.plot([total], [statistics.mean(ends)], "D", color=colours[arm], ms=9, label=f"{arm} (mean)")
            continue
        for c in curves:
            ax.plot(grid, [best_at(c, s) for s in grid], color=colours[arm], alpha=0.25, lw=1, drawstyle="steps-post")
        means = [(s, statistics.mean(best_at(c, s) for c in curves)) for s in grid]
        means = [(s, m) for s, m in means if math.isfinite(m)]
        ax.plot(*zip(*means), color=colours[arm], lw=2.5, drawstyle="steps-post", label=f"{arm} (mean)",
                ls="--" if arm == "random" else "-")  # (random and gp share their first trials)
    finite = [best_at(row["curves"][a], total) for row in results["seeds"] for a in ARMS]
    ax.set_ylim(min(finite) - 0.05, max(finite) + 0.3)
    ax.set_xlabel("steps spent (every run's together)")
    ax.set_ylabel("best validation loss at the end\nof a run's budget, found so far")
    ax.set_title(f"{len(results['seeds'])} seeds, {results['budget']} steps a run, {total} in all", fontsize=10, loc="left")
    ax.legend(fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--budget", type=int, default=60, help="S: steps of every run")
    p.add_argument("--runs", type=int, default=8, help="R: the total steps are R x S")
    p.add_argument("--lr-range", type=float, nargs=2, default=[1e-4, 1.0], metavar=("A", "B"))
    p.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "search.json"))
    p.add_argument("--png", default=str(REPO / "benchmarks" / "figures" / "search.png"))
    p.add_argument("--redraw", action="store_true", help="only draw --png from the results in --json")
    args = p.parse_args()
    if args.redraw:
        results = json.loads(Path(args.json).read_text())
        draw(args.png, results, results["runs"] * results["budget"])
        return
    total = args.runs * args.budget
    marks = [total // 4, total // 2, total]
    results = dict(machine=platform.machine(), python=platform.python_version(), load_before=uptime(),
                   budget=args.budget, runs=args.runs, lr_range=args.lr_range, task=TASK, seeds=[])
    for seed in args.seeds:
        row = dict(seed=seed, curves={}, wall_s={})
        for arm in ARMS:
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="minidist-bench-search-") as tmp:
                row["curves"][arm] = pbt_arm(args, seed, Path(tmp)) if arm == "pbt" else search_arm(args, seed, arm,
                                                                                                    Path(tmp))
            row["wall_s"][arm] = time.perf_counter() - t0
            print(f"seed {seed}: {arm}: {row['curves'][arm]} ({row['wall_s'][arm]:.0f} s)", file=sys.stderr, flush=True)
        results["seeds"].append(row)
    results["load_after"] = uptime()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    draw(args.png, results, total)

    print(f"load before: {results['load_before']}\nload after:  {results['load_after']}\n")
    print(f"lr in [{args.lr_range[0]:g}, {args.lr_range[1]:g}] (log), {args.budget} steps a run, {total} steps in all\n")
    print("| seed | arm | " + " | ".join(f"best after {m} steps" for m in marks) + " | lowest at the end? | wall |\n|---|---|"
          + "---|" * len(marks) + "---|---|")
    text = lambda x: f"{x:.4f}" if math.isfinite(x) else "-"  # noqa: E731
    for row in results["seeds"]:
        ends = {arm: best_at(row["curves"][arm], total) for arm in ARMS}
        for arm in ARMS:
            print(f"| {row['seed']} | {arm} | " + " | ".join(text(best_at(row["curves"][arm], m)) for m in marks)
                  + f" | {'yes' if ends[arm] == min(ends.values()) else ''} | {row['wall_s'][arm]:.0f} s |")
    print("\nMean over the seeds of the best at each mark:\n")
    print("| arm | " + " | ".join(f"after {m} steps" for m in marks) + " | seeds lowest at the end |\n|---|"
          + "---|" * len(marks) + "---|")
    for arm in ARMS:
        means = [statistics.mean(best_at(r["curves"][arm], m) for r in results["seeds"]) for m in marks]
        wins = sum(best_at(r["curves"][arm], total) == min(best_at(r["curves"][a], total) for a in ARMS)
                   for r in results["seeds"])
        print(f"| {arm} | " + " | ".join(text(x) for x in means) + f" | {wins} of {len(results['seeds'])} |")


if __name__ == "__main__":
    main()
