"""``python -m minidist.train --mode search``: hyper-parameter search over sub-groups of the world.

    mpiexec -n 4 python -m minidist.train --mode search --trials 16 --parallel 2 --sampler gp \\
        --scheduler asha --grace 20 --reduction 3 --lr-range 1e-4 1e-2 --dp 2 --ckpt-dir ckpt --out run

The world of N ranks is split into K = ``--parallel`` sub-groups of N / K ranks, as a population's
members are (train/pbt.py): ranks k N/K ... (k+1) N/K - 1 are sub-group k. Each sub-group runs one
trial at a time, a whole run of the layout the other flags give, with the hyper-parameters the
sampler chose in the space of the ranges (minidist/tune/), and a budget of ``--steps`` steps. The
search goes in segments of the same length on every sub-group (the greatest common divisor of the
rungs, the budget and ``--save-every``), each ended by one agreement:

    advance   each sub-group trains its trial one segment on (train/trials.py), saving at its end
    agree     one all-gather over the world of every rank's (sub-group, validation loss)
    decide    every rank updates the same state: a trial at its budget completed, at a rung of
              ``--scheduler asha`` stopped early unless in the top 1 / --reduction there (tune/asha.py),
              a diverged one failed; a sub-group without a trial takes the next (``--trials`` in all),
              its point drawn by rank 0 (tune/samplers.py: a function of the seed and the results so
              far) and broadcast, so every rank holds the same numbers
    record    rank 0 writes the state to ``--ckpt-dir``/search/state.json and every trial so far to
              ``--out``/trials.jsonl (atomically), and prints a line for each trial that ended

An early-stopped or failed trial frees its sub-group at once: the next segment runs a new trial
there. At the end one line names the best trial (the lowest validation loss at the end of its
budget), its hyper-parameters and loss; ``--export`` / ``--export-hf`` get its final model.
``--resume`` continues from search/state.json: each running trial's checkpoints newer than it are
removed, and the trials go on from their checkpoints, as they would have.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np

from minidist.checkpoint.format import step_dirs, step_of
from minidist.checkpoint.training import ResumeRefused
from minidist.files import real_folder, write_atomically
from minidist.train.config import check_flags
from minidist.train.stopping import Stopping
from minidist.train.outputs import copy_final_model
from minidist.train.trials import start_trial, trial_folder
from minidist.tune.asha import goes_on, rungs, segment
from minidist.tune.samplers import results, suggest
from minidist.tune.space import SEARCHABLE, space_of
from minidist.tune.state import SearchState, Trial, read_state

STATE = "search"  # under --ckpt-dir: state.json


def search_space(cfg):
    """The space of ``cfg``'s ranges (``--lr-range`` ...) and ``--log-scale``."""
    return space_of({n: getattr(cfg, f"{n}_range") for n in SEARCHABLE}, names_of(cfg.log_scale))


def names_of(text: str) -> list[str]:
    return [n for n in text.split(",") if n]


def train_search(cfg, world, machines=None, memory_bytes=None, stopping=None) -> SearchState:
    """Run the search of ``cfg`` on ``world`` (module docstring). Returns its state, the same on every
    rank. Sends, over the world: one split, then per segment one all-gather of two float64 per
    rank, and where new trials start one broadcast of their points; with --resume one barrier.
    Everything else goes over a sub-group, as its trainer sends it."""
    check_flags(cfg, world.size)  # every rank, before anything is sent (each trial's run checks its own start)
    space = search_space(cfg)
    state = read_saved(cfg, space.names) if cfg.resume else SearchState([])  # refused before anything is sent too
    slot = world.rank // (world.size // cfg.parallel)
    stopping = stopping if stopping is not None else Stopping()
    with stopping.deferred():  # a split is collective: a stop waits for it (train/stopping.py)
        group = world.split(slot, world.rank, name=f"trials{slot}")
    size = world.size // cfg.parallel
    group_machines = machines.of_ranks(range(slot * size, (slot + 1) * size)) if machines is not None else None
    milestones = rungs(cfg.grace, cfg.reduction, cfg.steps) if cfg.scheduler == "asha" else []
    length = segment(milestones, cfg.steps, cfg.save_every)
    if cfg.resume:
        back_to_state(cfg, world, group, slot, state)
    start = lambda t: start_trial(cfg, t.index, t.hparams, t.step, length, group, group_machines,  # noqa: E731
                                  memory_bytes, stopping)
    run = next((start(t) for t in state.running() if t.slot == slot), None)
    try:
        while True:
            for trial in assign(cfg, world, state, space):
                if trial.slot == slot:
                    run = start(trial)
            if not state.running():
                break
            mine = next((t for t in state.running() if t.slot == slot), None)
            loss = run.advance(min(mine.step + length, cfg.steps)) if mine is not None else math.nan
            every = world.all_gather(np.array([slot, loss], dtype=np.float64),
                                     label="metric: every sub-group's validation loss (search)")
            ended = decide(cfg, state, milestones, length, {int(s): float(v) for s, v in every.reshape(-1, 2)})
            if mine is not None and mine in ended:
                run, ending = None, run
                ending.close()
            record(cfg, world, state, ended)
    finally:  # stopped, failed: the trial's run stops as any run does (train/life.py), leaving nothing behind
        if run is not None:
            run.close()
    export_best(cfg, world, state)
    return state


def assign(cfg, world, state: SearchState, space) -> list[Trial]:
    """The new trials, one on each free sub-group while ``--trials`` allows: their points drawn on
    rank 0 and broadcast over the world (the same floats on every rank)."""
    busy = {t.slot for t in state.running()}
    free = [s for s in range(cfg.parallel) if s not in busy][:cfg.trials - len(state.trials)]
    if not free:
        return []
    points = np.zeros((len(free), len(space.dims)), dtype=np.float64)
    if world.rank == 0:
        observed = results([t for t in state.trials if t.state != "running"], space)
        pending = [space.unit(t.hparams) for t in state.trials if t.state == "running"]
        points[:] = suggest(cfg.sampler, len(space.dims), cfg.seed, len(state.trials), len(free), observed, pending,
                            cfg.batch_rule)
    world.broadcast(points, 0, label="setup: the new trials' hyper-parameters (search)")
    new = [Trial(len(state.trials) + i, s, space.values(p), started=state.spent)
           for i, (s, p) in enumerate(zip(free, points))]
    state.trials += new
    return new


def decide(cfg, state: SearchState, milestones: list[int], length: int, losses: dict) -> list[Trial]:
    """Every running trial one segment on with its sub-group's loss (``losses``: {slot: loss}): its
    rung's loss recorded; completed at the budget, failed when NaN, stopped early at a rung where it
    is not in the top 1 / --reduction. Returns the trials that ended."""
    running = state.running()
    for t in running:
        to = min(t.step + length, cfg.steps)
        state.spent += to - t.step
        t.step = to
        if to in milestones or to == cfg.steps or not math.isfinite(losses[t.slot]):
            t.rungs[to] = losses[t.slot]
    for t in running:
        if not math.isfinite(losses[t.slot]):
            t.state = "failed"
        elif t.step == cfg.steps:
            t.state = "completed"
        elif t.step in milestones:
            recorded = {u.index: u.rungs[t.step] for u in state.trials if t.step in u.rungs}
            t.state = "running" if goes_on(t.index, recorded, cfg.reduction) else "stopped early"
    ended = [t for t in running if t.state != "running"]
    for t in ended:
        t.spent = state.spent
    return ended


def record(cfg, world, state: SearchState, ended: list[Trial]) -> None:
    """Rank 0: a line per trial that ended, the state to ``--ckpt-dir``/search/state.json and every
    trial to ``--out``/trials.jsonl, each written atomically. Sends nothing."""
    if world.rank != 0:
        return
    for t in ended:
        loss = "no loss (diverged)" if t.state == "failed" else f"val loss {t.loss:.4f}"
        print(f"trial {t.index} {t.state} at step {t.step}: {loss} ({hparams_text(t.hparams)}); "
              f"{state.spent} steps spent", flush=True)
    write_atomically(real_folder(Path(cfg.ckpt_dir) / STATE) / "state.json", json.dumps(state.to_json()).encode())
    if cfg.out is not None:
        lines = "".join(json.dumps(t.to_json()) + "\n" for t in state.trials)
        write_atomically(real_folder(cfg.out) / "trials.jsonl", lines.encode())


def read_saved(cfg, names: list[str]) -> SearchState:
    """The state in ``--ckpt-dir``/search/state.json (each rank reads it), or :class:`ResumeRefused`
    of one line naming the file."""
    path = Path(cfg.ckpt_dir) / STATE / "state.json"
    if not path.is_file():
        raise ResumeRefused(f"--resume: no search state {path} (drop --resume to start from scratch)")
    return read_state(path, names, cfg.trials, cfg.parallel, error=ResumeRefused)


def back_to_state(cfg, world, group, slot: int, state: SearchState) -> None:
    """Each of ``state``'s running trials' checkpoints newer than its step (a crash between a trial's
    save and the state's) removed by its sub-group's rank 0, then a barrier over the world."""
    for t in state.running():
        if t.slot == slot and group.rank == 0:
            for folder in step_dirs(Path(trial_folder(cfg.ckpt_dir, t.index))):
                if step_of(folder) > t.step:
                    shutil.rmtree(folder)
    world.barrier(label="setup: every running trial back at the search's step")


def export_best(cfg, world, state: SearchState) -> None:
    """Rank 0: the best trial's final model, which its last segment wrote (trials.py), copied to
    ``--export`` and ``--export-hf``, each file atomically, never through a link. Sends nothing."""
    best = state.best()
    if world.rank != 0 or best is None or (cfg.export is None and cfg.export_hf is None):
        return
    for flag, (_, asked) in copy_final_model(cfg, trial_folder(cfg.ckpt_dir, best.index)).items():
        print(f"{flag}: trial {best.index}'s final model (the best), copied to {asked}", flush=True)


def final_line(state: SearchState) -> str:
    """The search in one line: the best trial, its hyper-parameters and loss, and what the others did."""
    best = state.best()
    counts = {s: sum(t.state == s for t in state.trials) for s in ("completed", "stopped early", "failed")}
    done = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    if best is None:
        return f"no trial completed ({done}): no best trial"
    return (f"the best trial is {best.index}: val loss {best.loss:.4f} ({hparams_text(best.hparams)}); "
            f"{len(state.trials)} trials ({done}), {state.spent} steps spent")


def hparams_text(hparams: dict) -> str:
    """``lr 0.00433, warmup 12``: a trial's hyper-parameters."""
    return ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in hparams.items())
