"""``python -m minidist.train --mode pbt``: population-based training over sub-groups of the world.

    mpiexec -n 8 python -m minidist.train --mode pbt --population 4 --ready-every 50 --explore lr \\
        --lr-range 1e-4 1e-2 --dp 2 --ckpt-dir ckpt --out run

The world of N ranks is split into K members of N / K ranks (ranks k N/K ... (k+1) N/K - 1 are member
k), and each member is a whole collective run in the layout the other flags give (dp, tp, pp, cp,
ZeRO, mixed precision, recompute...), with hyper-parameters of its own (train/population.py draws
them). Each member is one run (train/life.py: ``Run``) on the member's group, made once at the start and
continued in segments of ``--ready-every`` S steps, saving its checkpoint under
``--ckpt-dir``/member-<k> at each segment's end, so a member's step is the step of the same layout
run alone with the same hyper-parameters, bitwise. At each ready point
(but the last, where only the losses are recorded):

    agree     one all-gather over the world of every rank's (member, validation loss): every rank
              then knows every member's loss, and computes the same decisions (population.py)
    exploit   a copying member's rank 0 replaces the member's newest checkpoint with its donor's of the
              same step (the same layout, the same files; a checkpoint reshards, so the member would
              read it in any layout), and the member's run reloads it in place: it continues exactly
              as the donor would from there
    explore   with the donor's hyper-parameters perturbed; the checkpoints' identity leaves the
              explored ones out, so the copy continues as the same run
    record    rank 0 prints one line (the losses; each copy, its hyper-parameters before and after and
              how they changed: x0.8, x1.2 or a fresh draw) and appends a row per member to
              ``--out``/pbt.jsonl, and writes the population (every member, its hyper-parameters and
              parent) to ``--ckpt-dir``/population/step-<n>.json

A row of pbt.jsonl is one member at one ready point: ``step``, ``member``, ``val_loss`` (which
decided), ``before`` and ``after`` (its hyper-parameters up to it and from it; null at the end),
``donor`` (whom it copies, or null) and ``change`` ({name: "x0.8" | "x1.2" | "fresh draw"}). Step 0's
rows are the starts. ``parent`` (population files): the member whose weights it last took.

``--export`` and ``--export-hf`` get the best member's final model (the lowest validation loss at the
last ready point): each member's last segment writes its own under its checkpoint folder
(``final.npz``, ``final.safetensors``, ``final-hf/``), and rank 0 copies the best one's there.

``--resume`` continues from the newest population file: each member's checkpoints newer than it (a
crash between a member's save and the population's) are removed, and the run goes on bitwise.
Each member writes its metrics to ``--out``/member-<k>/metrics.jsonl.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from minidist.files import create, real_folder
from minidist.train.config import check_flags
from minidist.train.divergence import Diverged
from minidist.train.life import Run
from minidist.train.lineage import copy_checkpoints, export_best, member_folder, record, resumed, start_row
from minidist.train.outputs import final_exports
from minidist.train.population import Member, draw, generation
from minidist.train.stopping import Stopping


def names_of(cfg) -> list[str]:
    """The hyper-parameters ``--explore`` names, in its order."""
    return [n for n in cfg.explore.split(",") if n]


def exempt_of(cfg) -> tuple:
    """The fields a member's checkpoint identity leaves out: what it explores (and --min-lr with --lr:
    a member's cosine floor follows its learning rate, member_config)."""
    names = names_of(cfg)
    return tuple(names) + (("min_lr",) if "lr" in names and "min_lr" not in names else ())


def ranges_of(cfg) -> dict:
    """{name: (lo, hi)} of the explored hyper-parameters given a range."""
    given = {"lr": cfg.lr_range, "weight_decay": cfg.weight_decay_range}
    return {n: tuple(given[n]) for n in names_of(cfg) if given.get(n) is not None}


def hparams_of(cfg, member: Member) -> dict:
    """Member ``member``'s hyper-parameters as config fields: its own, and (unless it explores it) a
    cosine floor that follows its learning rate."""
    floor = {} if "min_lr" in member.hparams else {"min_lr": min(cfg.min_lr, member.hparams.get("lr", cfg.lr))}
    return {**floor, **member.hparams}


def member_config(cfg, member: Member, k: int):
    """Member ``k``'s own run: its hyper-parameters, its folders, a save at each ready point."""
    sub = lambda folder: str(Path(folder) / f"member-{k}") if folder is not None else None  # noqa: E731
    return dataclasses.replace(cfg, mode="collective", **hparams_of(cfg, member), ckpt_dir=sub(cfg.ckpt_dir),
                               out=sub(cfg.out),
                               trace=sub(cfg.trace), offload_dir=sub(cfg.offload_dir), save_every=cfg.ready_every,
                               keep=max(cfg.keep, 2), async_save=False, sample_tokens=0, export=None, export_hf=None)


def train_pbt(cfg, world, machines=None, memory_bytes=None, stopping=None):
    """Run the population of ``cfg`` on ``world`` (module docstring; ``machines``: which machine each
    rank of it is on, None: one). Returns (this rank's member's model, the population's history: one
    dict per member per ready point, the same on every rank). Sends, over the world: one split (an
    all-gather of colours), and at each ready point one all-gather of two float64 per rank and two
    barriers (with --resume, one more); everything else goes over the member's own group, as its run
    sends it. Each member's run (train/life.py) is made once, at the start, and continued: a stop
    signal never meets a member being built."""
    check_flags(cfg, world.size)  # the population's flags, on every rank, before anything is sent
    k_ranks = world.size // cfg.population
    k = world.rank // k_ranks
    stopping = stopping if stopping is not None else Stopping()
    with stopping.deferred():  # a split is collective: a stop waits for it (train/stopping.py)
        group = world.split(k, world.rank, name=f"member{k}")
    names, ranges, exempt = names_of(cfg), ranges_of(cfg), exempt_of(cfg)
    if cfg.resume:
        members, start, history = resumed(cfg, world, group, k)
    else:
        members, start, history = draw(cfg.population, cfg.seed, {n: getattr(cfg, n) for n in names}, ranges), 0, []
    if world.rank == 0 and cfg.out is not None:  # the lineage so far (none, or the resumed population's), then appended
        with create(real_folder(cfg.out) / "pbt.jsonl", text=True) as f:
            f.writelines(json.dumps(r) + "\n" for r in history)
    if not cfg.resume:  # each member's start, recorded as the ready point of step 0
        starts = [start_row(m, names, ranges) for m in members]
        history += starts
        record(cfg, world, members, starts, 0)
    mine = dataclasses.replace(member_config(cfg, members[k], k), resume=start > 0)
    member_machines = machines.of_ranks(range(k * k_ranks, (k + 1) * k_ranks)) if machines is not None else None
    with Run(mine, group, machines=member_machines, memory_bytes=memory_bytes, stopping=stopping, quiet=True,
             progress=False, explored=exempt, keep_history=False) as run:
        for seg_end in range(start + cfg.ready_every, cfg.steps + cfg.ready_every, cfg.ready_every):
            seg_end = min(seg_end, cfg.steps)
            try:
                val_loss = run.advance(seg_end)[-1]["val_loss"]
                if seg_end == cfg.steps:
                    run.finish(**final_exports(cfg, member_folder(cfg, k)))  # the member's final model, when asked for
            except Diverged:  # every rank of the member at once, no checkpoint of this step: it copies another
                val_loss = float("nan")
            losses = agree(world, k, val_loss, cfg.population)
            if not any(np.isfinite(losses)):
                raise Diverged(f"every member of the population diverged before step {seg_end}")
            before = members
            if seg_end < cfg.steps:  # exploit and explore; at the end only the losses count
                members, copies, changes = generation(members, losses, rule=cfg.exploit, quantile=cfg.quantile,
                                                      names=names, ranges=ranges, seed=cfg.seed, step=seg_end)
            else:
                members, copies, changes = [dataclasses.replace(m, val_loss=losses[m.index]) for m in members], {}, {}
            rows = [dict(step=seg_end, member=m.index, val_loss=losses[m.index], before=m.hparams,
                         donor=copies.get(m.index), after=members[m.index].hparams if seg_end < cfg.steps else None,
                         change=changes.get(m.index, {})) for m in before]
            history += rows
            if seg_end < cfg.steps:
                copy_checkpoints(cfg, group, world, k, copies, seg_end)
                if k in copies or not np.isfinite(val_loss):  # the donor's state; or, diverged, its own newest
                    run.reload()
                if k in copies:  # then the donor's hyper-parameters, explored
                    run.explore(hparams_of(cfg, members[k]))
            record(cfg, world, members, rows, seg_end)
    export_best(cfg, world, history[-cfg.population:])
    return run.model, history


def agree(world, k: int, val_loss: float, population: int) -> list[float]:
    """Every member's validation loss, on every rank: one all-gather over the world of each rank's
    (member, loss), two float64 (the ranks of a member report the same loss)."""
    mine = np.array([k, val_loss], dtype=np.float64)  # (2,)
    every = world.all_gather(mine, label="metric: every member's validation loss (population-based training)")
    losses = [float("nan")] * population
    for member, loss in every.reshape(-1, 2):
        losses[int(member)] = float(loss)
    return losses
