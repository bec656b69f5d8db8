"""Lesson 18: population-based training: a population of runs over sub-groups of the world, the worse
copying the better and perturbing what they copied.

    python tutorials/18_population_based_training.py                 (one process: 4 members, 2 thread ranks each)
    python tutorials/18_population_based_training.py --png pbt.png   (also draw the population)

Choosing a learning rate costs runs. Population-based training (Jaderberg et al. 2017) runs K of them
AT ONCE and lets them share what they learn: every S steps the members compare validation losses;
one in the bottom quantile copies the weights and optimizer state of one in the top quantile
(EXPLOIT) and then perturbs the hyper-parameters it copied, x0.8 or x1.2 (EXPLORE). The schedule
of each hyper-parameter is discovered during the run, not fixed before it.

minidist's version (``python -m minidist.train --mode pbt``, minidist/train/pbt.py) splits the world:
8 ranks and ``--population 4`` make 4 members of 2 ranks, each a whole collective run in the layout
the other flags give (here dp 2). The copy goes through the member's checkpoints (the same files a
restart reads, so it would reshard). Every decision is a function of the seed and of the losses
(minidist/train/population.py), so the whole history is reproducible.

  1. The draws: each member's first learning rate, log-uniform in --lr-range.
  2. The population trains: at each ready point one line, the losses and who copied whom.
  3. Checked: member k's first segment is its layout run alone with its learning rate, bitwise;
     the lineage file holds one row per member per ready point.
  4. The lineage: from which member each one's weights descend at the end, and the best member's
     final model, which --export writes.
"""
import argparse
import contextlib
import dataclasses
import io
import json
import tempfile
from pathlib import Path

import numpy as np

import minidist
from minidist.launch_check import check_launch
from minidist.train.life import Run
from minidist.train.config import TrainConfig
from minidist.train.pbt import train_pbt
from minidist.train.population import draw, ranked

K, RANKS = 4, 2  # members, ranks per member (dp 2)
SIZES = dict(n_layer=2, n_head=4, n_embd=32, block_size=32, batch_size=8, eval_iters=4, eval_every=1000,
             sample_tokens=0, warmup=5, dtype="float64")
RUN = dict(mode="pbt", population=K, ready_every=10, steps=80, lr_range=(3e-4, 3e-1), exploit="truncation",
           quantile=0.25, explore="lr", dp=RANKS, seed=2)


def part1(cfg):
    print(f"=== 1. {K} members of {RANKS} ranks (dp {RANKS}): their first learning rates, log-uniform in "
          f"[{cfg.lr_range[0]:g}, {cfg.lr_range[1]:g}] ===")
    members = draw(K, cfg.seed, {"lr": cfg.lr}, {"lr": cfg.lr_range})
    for m in members:
        print(f"  member {m.index}: ranks {m.index * RANKS}-{m.index * RANKS + RANKS - 1}, lr {m.hparams['lr']:.2e}")
    return members


def part2(cfg):
    print(f"\n=== 2. training: {cfg.steps} steps, every {cfg.ready_every} the members agree on their validation "
          f"losses; the bottom {cfg.quantile:.0%} copies the top ===")
    history = minidist.run_local(lambda g: train_pbt(cfg, g)[1], K * RANKS)[0]
    lineage = [json.loads(line) for line in open(Path(cfg.out) / "pbt.jsonl")]
    assert lineage == history and len(lineage) == K * (cfg.steps // cfg.ready_every + 1)  # step 0: the starts
    return history


def first_steps(cfg, world, steps: int) -> list[dict]:
    """The records of ``cfg``'s first ``steps`` steps, run alone on ``world``: one run's life
    (minidist/train/life.py), advanced only so far."""
    with Run(cfg, world, progress=False) as run:
        return run.advance(steps)


def part3(cfg, members, root: Path):
    print("\n=== 3. a member's steps are its layout's steps alone, with its learning rate ===")
    k = 1
    alone = dataclasses.replace(cfg, mode="collective", lr=members[k].hparams["lr"], ckpt_dir=None, out=None,
                                export=None)
    with contextlib.redirect_stdout(io.StringIO()):
        rows = minidist.run_local(lambda g: first_steps(alone, g, cfg.ready_every), RANKS)[0]
    ours = [json.loads(line) for line in open(root / "out" / f"member-{k}" / "metrics.jsonl")][:cfg.ready_every]
    same = all(a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] for a, b in zip(ours, rows))
    print(f"  member {k}'s first {cfg.ready_every} steps against dp {RANKS} alone at lr {members[k].hparams['lr']:.2e}: "
          f"losses and gradient norms equal bitwise: {same}")
    assert same


def ancestry(history, k: int) -> list[int]:
    """The members member ``k``'s final weights passed through, oldest first."""
    chain = [k]
    for s in sorted({r["step"] for r in history}, reverse=True):
        row = next(r for r in history if r["step"] == s and r["member"] == chain[-1])
        if row["donor"] is not None:
            chain.append(row["donor"])
    return chain[::-1]


def part4(history, root: Path):
    print("\n=== 4. the lineage: whose weights each member holds at the end ===")
    last = max(r["step"] for r in history)
    final = sorted((r for r in history if r["step"] == last), key=lambda r: r["val_loss"])
    for r in final:
        chain = ancestry(history, r["member"])
        came = (f"its weights came through member{'s' * (len(chain) > 1)} {' -> '.join(map(str, chain))}"
                if chain != [r["member"]] else "its own weights all along")
        print(f"  member {r['member']}: val loss {r['val_loss']:.4f}, lr {r['before']['lr']:.2e}; {came}")
    copies = sum(r["donor"] is not None for r in history)
    points = last // RUN["ready_every"]
    print(f"  {copies} copies at the {points - 1} ready points that exploit ({points} in all: the last, at step "
          f"{last}, only ranks); the best member ends at val loss {final[0]['val_loss']:.4f}")
    best = root / "ckpt" / f"member-{final[0]['member']}" / "final.npz"  # each member's last segment wrote its own
    with np.load(root / "best.npz") as exported:
        n = sum(exported[name].size for name in exported.files if name != "lm_head.weight")  # (tied to wte)
    assert (root / "best.npz").read_bytes() == best.read_bytes()
    print(f"  --export best.npz: member {final[0]['member']}'s final model ({n:,} parameters), the best one")


def changes(history):
    """Every copy as (step, copier, donor, new lr, how), as pbt.jsonl records it: "x0.8" or "x1.2"
    when the copied lr was perturbed, "fresh draw" when it was drawn again from the range."""
    return [(r["step"], r["member"], r["donor"], r["after"]["lr"], r["change"]["lr"].split(",")[0])
            for r in history if r["donor"] is not None]


def draw_png(path: str, history, cfg):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplot_mosaic([["lr", "key"], ["tree", "raw"], ["gap", "raw"]], figsize=(12, 10.5),
                                   gridspec_kw=dict(height_ratios=[1.1, 0.8, 1.2], width_ratios=[3, 1]))
    lr_ax, tree_ax, gap_ax, raw_ax, key = (axes[name] for name in ("lr", "tree", "gap", "raw", "key"))
    tree_ax.sharex(gap_ax), lr_ax.sharex(gap_ax)
    colors = plt.cm.tab10(np.arange(K))
    steps = sorted({r["step"] for r in history} - {0})  # the ready points (step 0: each member's start)
    at = {(r["step"], r["member"]): r for r in history}
    final = [at[steps[-1], k]["val_loss"] for k in range(K)]
    winner = ranked(final)[0]  # the rule the export uses
    best = {s: min(at[s, k]["val_loss"] for k in range(K)) for s in steps}
    for k in range(K):
        lrs = [at[0, k]["after"]["lr"]] + [at[s, k]["after"]["lr"] for s in steps[:-1]] + [at[steps[-1], k]["before"]["lr"]]
        lr_ax.step([0] + steps, lrs, where="post", color=colors[k], lw=3.5 if k == winner else 1.5)
        tree_ax.plot([0, steps[-1]], [k, k], color=colors[k], lw=6, alpha=0.25)
        gap_ax.plot(steps, [at[s, k]["val_loss"] - best[s] for s in steps], "o-", color=colors[k], ms=5,
                    lw=3.5 if k == winner else 1.5)
    marks = {"x0.8": "v", "x1.2": "^", "fresh draw": "*"}
    for s, k, donor, lr, how in changes(history):
        lr_ax.plot(s, lr, marks[how], color=colors[k], mec="black", ms=14 if how == "fresh draw" else 9, zorder=3)
        lr_ax.annotate(how, (s, lr), xytext=(6, 4 if how != "x0.8" else -12), textcoords="offset points", fontsize=8)
        tree_ax.annotate("", xy=(s, k), xytext=(s, donor), arrowprops=dict(arrowstyle="->", color=colors[donor], lw=1.8))
    for bound in cfg.lr_range:
        lr_ax.axhline(bound, color="grey", ls=":", lw=1)
    lr_ax.text(steps[-1], cfg.lr_range[1], "--lr-range", color="grey", fontsize=8, va="bottom", ha="right")
    lr_ax.set_yscale("log"), lr_ax.set_ylabel("learning rate (log)")
    lr_ax.set_ylim(cfg.lr_range[0] / 1.6, cfg.lr_range[1] * 1.6)
    lr_ax.set_title("Each member's learning rate; a copier takes its donor's, x0.8 or x1.2, or one in four a fresh "
                    "draw", fontsize=10, loc="left")
    members = [Line2D([], [], color=colors[k], lw=3.5 if k == winner else 1.5,
                      label=f"member {k}" + (" (winner)" if k == winner else "")) for k in range(K)]
    kinds = [Line2D([], [], ls="", marker=m, color="white", mec="black", ms=9, label=how) for how, m in marks.items()]
    key.legend(handles=members + kinds, fontsize=9, loc="center left", title="members; a copied lr:", title_fontsize=9)
    key.axis("off")
    tree_ax.set_yticks(range(K), [f"member {k}" for k in range(K)])
    tree_ax.tick_params(axis="y", labelsize=9)
    tree_ax.set_title(f"Exploit: at each ready point the bottom {cfg.quantile:.0%} copies the weights of the top "
                      f"{cfg.quantile:.0%} (arrow: from donor to copier)", fontsize=10, loc="left")
    tree_ax.set_ylim(-0.5, K - 0.5)
    gap_ax.set_yscale("symlog", linthresh=1e-4)
    gap_ax.set_ylim(-2e-5, 10)
    star = gap_ax.plot(steps[-1], 0, "*", color=colors[winner], mec="black", ms=18, zorder=3, ls="",
                       label=f"the winner: member {winner}, val loss {final[winner]:.4f}, exported")
    gap_ax.legend(handles=star, fontsize=9, loc="upper right")
    gap_ax.set_ylabel("validation loss minus the best\nmember's at that point (symlog)")
    gap_ax.set_xlabel("step")
    gap_ax.set_title("The ranking behind each copy: each member's loss above the best one's (0: the best)",
                     fontsize=10, loc="left")
    for k in range(K):
        raw_ax.plot(steps, [at[s, k]["val_loss"] for s in steps], "o-", color=colors[k], ms=4,
                    lw=3 if k == winner else 1.2)
    raw_ax.set_title("the validation losses", fontsize=10, loc="left")
    raw_ax.set_xlabel("step"), raw_ax.set_ylabel("validation loss")
    raw_ax.tick_params(labelsize=8)
    fig.suptitle(f"Population-based training: {K} members x dp {RANKS}, ready every {cfg.ready_every} steps, "
                 f"truncation {cfg.quantile:.0%}, explore lr", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--png", help="draw each member's learning rate, the copies and the losses into this file")
    args = parser.parse_args()
    check_launch(parser, args, mpiexec=False)
    with tempfile.TemporaryDirectory(prefix="minidist-lesson18-") as tmp:
        root = Path(tmp)
        cfg = TrainConfig(**SIZES, **RUN, ckpt_dir=str(root / "ckpt"), out=str(root / "out"),
                          export=str(root / "best.npz"))
        members = part1(cfg)
        history = part2(cfg)
        part3(cfg, members, root)
        part4(history, root)
        if args.png:
            draw_png(args.png, history, cfg)
    print("\nTry:\n  1. RUN with exploit=\"tournament\": each member meets one other, drawn, and copies it if it is better\n"
          "  2. explore=\"lr,weight_decay\" and weight_decay_range=(0.01, 0.3): two hyper-parameters found at once\n"
          "  3. mpiexec -n 8 python -m minidist.train --mode pbt --population 4 --dp 2 --ready-every 25 --steps 200 "
          "--lr-range 3e-4 3e-1 --ckpt-dir ckpt --out run --export best.npz: the same, as 8 processes")
    print("\nThe members' steps are their layouts' steps, the copies went through checkpoints, and the lineage is "
          "recorded. All checks passed.")


if __name__ == "__main__":
    main()
