"""Lesson 19: hyper-parameter search: Bayesian optimization with a Gaussian process, and ASHA
stopping the trials that fall behind, each trial a collective run on a sub-group of the world.

    python tutorials/19_hyperparameter_search.py                    (one process: 2 sub-groups of 1 thread rank)
    python tutorials/19_hyperparameter_search.py --png search.png   (also draw the process after each round)

A learning rate is found by trying some. Random search tries them blindly. Bayesian optimization
fits a Gaussian process to the losses seen so far: a guess of the loss everywhere (its mean) and of
how unsure the guess is (its standard deviation). The next trial goes where the EXPECTED
IMPROVEMENT over the best loss is highest: low where the mean is low, or where nothing is known yet.
ASHA (asynchronous successive halving) spends less on bad trials: at each rung (grace, grace x 3,
...) a trial goes on only when it is in the top third of the losses seen at that rung, and a stopped
trial's sub-group takes the next trial at once.

minidist's version (``python -m minidist.train --mode search``, minidist/train/search.py) splits the
world into --parallel sub-groups, as population-based training does; the pure parts are in
minidist/tune/: the space, the process (gp.py: the Matérn 5/2 kernel, its length scale fitted by
maximizing the marginal likelihood), expected improvement (acquisition.py), the samplers and ASHA.
Every draw is a function of the seed and the results so far.

  1. The search: 10 trials, 2 at a time, the learning rate in [1e-4, 0.3] on a log scale; a line as
     each trial ends, then the trials as a table.
  2. Checked: every trial the process chose is chosen again from the results it was chosen from
     (and the others' points, believed); every trial ASHA stopped was outside the top third of its
     rung when it got there, every trial that went on inside it.
  3. The rounds: where the process put its mean, its doubt and its expected improvement when it
     chose each trial.
"""
import argparse
import math
import tempfile
from pathlib import Path

import numpy as np

import minidist
from minidist.inspect.trials import format_trials
from minidist.launch_check import check_launch
from minidist.train.config import TrainConfig
from minidist.train.search import final_line, search_space, train_search
from minidist.tune.acquisition import expected_improvement
from minidist.tune.asha import goes_on, rungs
from minidist.tune.gp import GaussianProcess
from minidist.tune.samplers import results, startup, suggest

K = 2  # trials at a time, one thread rank each
SIZES = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=8, eval_iters=2, eval_every=1000,
             sample_tokens=0, warmup=2, dtype="float64", seed=1)
RUN = dict(mode="search", trials=10, parallel=K, steps=36, lr_range=(1e-4, 0.3), log_scale="lr", sampler="gp",
           batch_rule="believer", scheduler="asha", grace=4, reduction=3)


def part1(cfg):
    print(f"=== 1. {cfg.trials} trials, {K} at a time, lr in [{cfg.lr_range[0]:g}, {cfg.lr_range[1]:g}] (log); "
          f"rungs at {rungs(cfg.grace, cfg.reduction, cfg.steps)} of {cfg.steps} steps ===")
    state = minidist.run_local(lambda g: train_search(cfg, g), K)[0]
    print(format_trials([t.to_json() for t in state.trials]))
    print("final: " + final_line(state))
    return state


def chosen_from(state, t):
    """(observed, pending) when trial ``t`` was chosen: the results of the trials that had ended, and
    the points of those still running (train/search.py: ``assign``)."""
    ended = [u for u in state.trials if u.spent is not None and u.spent <= t.started and u.index < t.index]
    running = [u for u in state.trials if u.index < t.index and u not in ended]
    return ended, running


def part2(cfg, state):
    print("\n=== 2. checked: each choice again from its results, each stop by ASHA's rule ===")
    space = search_space(cfg)
    first_gp = startup(len(space.dims))  # the trials before it are drawn at random
    for t in state.trials[first_gp:]:
        ended, running = chosen_from(state, t)
        batch = [u for u in state.trials if u.started == t.started and u.index < t.index]  # chosen with it, before it
        running = [u for u in running if u not in batch]
        again = suggest(cfg.sampler, 1, cfg.seed, t.index - len(batch), len(batch) + 1,
                        results(ended, space), [space.unit(u.hparams) for u in running],
                        cfg.batch_rule)[-1]
        assert space.values(again) == t.hparams, (t, again)
    print(f"  trials {first_gp}..{len(state.trials) - 1}: chosen again from the results each was chosen from: "
          f"the same learning rates, to the last bit")
    stops = 0
    for at in rungs(cfg.grace, cfg.reduction, cfg.steps):
        arrived = [u for u in state.trials if at in u.rungs]
        for u in arrived:  # segments are in step on every sub-group: the trials started before u, or with it,
            seen = {v.index: v.rungs[at] for v in arrived if v.started <= u.started}  # reached the rung before it or with it
            on = goes_on(u.index, seen, cfg.reduction)
            assert on == (u.step > at), (u, seen)
            stops += not on
    print(f"  {stops} trials stopped early at a rung, each outside the top 1/{cfg.reduction} of the losses seen "
          f"there; every other went on")


def draw_png(path, cfg, state):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    space = search_space(cfg)
    by_gp = [t for t in state.trials[startup(1):]  # the process chose them: 2 results or more to fit
             if sum(math.isfinite(loss) for _, loss in results(chosen_from(state, t)[0], space)) >= 2]
    rounds = sorted({t.started for t in by_gp})[:5]
    fig, axes = plt.subplots(len(rounds) + 1, 2, figsize=(12, 2.5 * (len(rounds) + 1)), squeeze=False,
                             gridspec_kw=dict(width_ratios=[3, 2]))
    grid = np.linspace(0, 1, 400)[:, None]
    lrs = [space.dims[0].value(u) for u in grid[:, 0]]
    for i, started in enumerate(rounds):
        picked = [t for t in by_gp if t.started == started]
        ended, running = chosen_from(state, picked[0])
        seen = results(ended, space)
        worst = max(loss for _, loss in seen if math.isfinite(loss))
        x, y = np.array([p for p, _ in seen]), np.array([loss if math.isfinite(loss) else worst for _, loss in seen])
        gp = GaussianProcess(x, y)
        mean, std = gp.predict(grid)
        ax, ei_ax = axes[i]
        ax.fill_between(lrs, mean - 2 * std, mean + 2 * std, color="#1f77b4", alpha=0.2, label="mean +- 2 std")
        ax.plot(lrs, mean, color="#1f77b4", label="the process's mean")
        ax.scatter([u.hparams["lr"] for u in ended], y, color="black", zorder=3, s=18, label="results so far")
        budget = max((s for u in ended for s, v in u.rungs.items() if math.isfinite(v) and
                      sum(s in w.rungs and math.isfinite(w.rungs[s]) for w in ended) >= 2), default=None)
        ei = expected_improvement(mean, std, float(y.min()))
        ei_ax.plot(lrs, ei, color="#2ca02c")
        for t in picked:
            for a in (ax, ei_ax):
                a.axvline(t.hparams["lr"], color="#d62728", ls="--", label="chosen" if a is ax and t is picked[0] else None)
        names = ", ".join(str(t.index) for t in picked)
        ax.set_title(f"after {started} steps: trial{'s' * (len(picked) > 1)} {names} chosen from {len(ended)} results "
                     f"at step {budget} ({len(running)} running)", fontsize=10, loc="left")
        ei_ax.set_title("expected improvement (before the batch's lies)", fontsize=10, loc="left")
        for a in (ax, ei_ax):
            a.set_xscale("log")
        ax.set_ylabel("val loss")
    axes[0][0].legend(fontsize=7, loc="upper center")
    ax, key = axes[len(rounds)]
    for t in state.trials:
        steps = sorted(t.rungs)
        ax.plot(steps, [t.rungs[s] for s in steps], "o-" if t.state == "completed" else "x-", ms=5,
                color="#1f77b4" if t.state == "completed" else "#ff7f0e" if t.state == "stopped early" else "#d62728")
    marks = rungs(cfg.grace, cfg.reduction, cfg.steps) + [cfg.steps]
    for at in marks:
        ax.axvline(at, color="grey", ls=":")
    ax.set_xscale("log"), ax.set_xticks(marks, [str(m) for m in marks]), ax.minorticks_off()
    ax.set_xlabel("step"), ax.set_ylabel("val loss")
    ax.set_title(f"ASHA's rungs: each trial's loss at each rung (x: stopped early), the best 1/{cfg.reduction} go on",
                 fontsize=10, loc="left")
    key.axis("off")
    key.text(0, 0.5, final_line(state).replace("; ", "\n"), fontsize=9, va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"\nwrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--png", help="draw the process and its expected improvement at each choice, and the rungs")
    args = parser.parse_args()
    check_launch(parser, args, mpiexec=False)
    with tempfile.TemporaryDirectory(prefix="minidist-lesson19-") as tmp:
        cfg = TrainConfig(**SIZES, **RUN, ckpt_dir=str(Path(tmp) / "ckpt"), out=str(Path(tmp) / "out"))
        state = part1(cfg)
        part2(cfg, state)
        if args.png:
            draw_png(args.png, cfg, state)
    print("\nTry:\n  1. RUN with sampler=\"random\": the same first trials, then blind draws\n"
          "  2. scheduler=\"none\": every trial runs its whole budget (more steps spent)\n"
          "  3. mpiexec -n 4 python -m minidist.train --mode search --trials 12 --parallel 2 --dp 2 --sampler gp "
          "--scheduler asha --grace 10 --steps 90 --lr-range 1e-4 0.3 --ckpt-dir ckpt --out run, then "
          "python -m minidist.inspect run")
    print("\nEach choice follows from the results before it, and each stop from its rung. All checks passed.")


if __name__ == "__main__":
    main()
