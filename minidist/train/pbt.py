"""``python -m minidist.train --mode pbt``: population-based training over sub-groups of the world.

    mpiexec -n 8 python -m minidist.train --mode pbt --population 4 --ready-every 50 --explore lr \\
        --lr-range 1e-4 1e-2 --dp 2 --ckpt-dir ckpt --out run

The world of N ranks is split into K members of N / K ranks (ranks k N/K ... (k+1) N/K - 1 are member
k), and each member is a whole collective run in the layout the other flags give (dp, tp, pp, cp,
ZeRO, mixed precision, recompute...), with hyper-parameters of its own (train/population.py draws
them). Training goes in segments of ``--ready-every`` S steps. A segment is the trainer itself
(train/loop.py: ``train(..., stop_at=...)``) on the member's group, resuming from the member's own
checkpoints under ``--ckpt-dir``/member-<k> and saving at the segment's end, so a member's step is
the step of the same layout run alone with the same hyper-parameters, bitwise. At each ready point
(but the last, where only the losses are recorded):

    agree     one all-gather over the world of every rank's (member, validation loss): every rank
              then knows every member's loss, and computes the same decisions (population.py)
    exploit   a copying member's rank 0 replaces the member's newest checkpoint with its donor's of the
              same step (the same layout, the same files; a checkpoint reshards, so the member would
              read it in any layout): the member continues exactly as the donor would from there
    explore   with the donor's hyper-parameters perturbed; the checkpoints' identity leaves the
              explored ones out, so the copy resumes as the same run
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
import shutil
from pathlib import Path

import numpy as np

from minidist.checkpoint.format import step_dir, step_dirs, step_of
from minidist.checkpoint.hf import CONFIG, WEIGHTS
from minidist.checkpoint.training import ResumeRefused
from minidist.files import create, real_folder, write_atomically
from minidist.untrusted import read_json
from minidist.train.config import check_config
from minidist.train.divergence import Diverged
from minidist.train.loop import train
from minidist.train.population import EXPLORABLE, POPULATION, Member, draw, generation, ranked


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


def member_config(cfg, member: Member, k: int):
    """Member ``k``'s own run: its hyper-parameters, its folders, a save at each ready point."""
    sub = lambda folder: str(Path(folder) / f"member-{k}") if folder is not None else None  # noqa: E731
    floor = {} if "min_lr" in member.hparams else {"min_lr": min(cfg.min_lr, member.hparams.get("lr", cfg.lr))}
    return dataclasses.replace(cfg, mode="collective", **{**floor, **member.hparams}, ckpt_dir=sub(cfg.ckpt_dir),
                               out=sub(cfg.out),
                               trace=sub(cfg.trace), offload_dir=sub(cfg.offload_dir), save_every=cfg.ready_every,
                               keep=max(cfg.keep, 2), async_save=False, sample_tokens=0, export=None, export_hf=None)


def train_pbt(cfg, world, memory_bytes=None, stopping=None):
    """Run the population of ``cfg`` on ``world`` (module docstring). Returns (this rank's member's
    model, the population's history: one dict per member per ready point, the same on every rank).
    Sends, over the world: one split (an all-gather of colours), and at each ready point one
    all-gather of two float64 per rank and two barriers (with --resume, one more); everything else
    goes over the member's own group, as its trainer sends it."""
    check_config(cfg, world.size, memory_bytes)  # the population's flags, on every rank, before anything is sent
    k_ranks = world.size // cfg.population
    k = world.rank // k_ranks
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
    model = None
    for seg_start in range(start, cfg.steps, cfg.ready_every):
        seg_end = min(seg_start + cfg.ready_every, cfg.steps)
        mine = member_config(cfg, members[k], k)
        last = final_exports(cfg, k) if seg_end == cfg.steps else {}  # the member's final model, when asked for
        try:
            segment = dataclasses.replace(mine, resume=seg_start > 0, explain=cfg.explain and seg_start == start,
                                          **last)
            model, rows = train(segment, progress=False, world=group, keep_history=False, memory_bytes=memory_bytes,
                                stopping=stopping, stop_at=seg_end, explored=exempt, quiet=True)
            val_loss = rows[-1]["val_loss"]
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
        record(cfg, world, members, rows, seg_end)
    export_best(cfg, world, history[-cfg.population:])
    return model, history


def final_exports(cfg, k: int) -> dict:
    """Where member ``k``'s last segment writes its final model for ``--export`` / ``--export-hf``: in
    its checkpoint folder, in the format the asked path names ({TrainConfig field: path})."""
    folder = Path(cfg.ckpt_dir) / f"member-{k}"
    found = {}
    if cfg.export is not None:
        found["export"] = str(folder / ("final.safetensors" if cfg.export.endswith(".safetensors") else "final.npz"))
    if cfg.export_hf is not None:
        found["export_hf"] = str(folder / "final-hf")
    return found


def export_best(cfg, world, last_rows: list[dict]) -> None:
    """Rank 0: the best member's final model (lowest validation loss in ``last_rows``, the last ready
    point's) copied from where its last segment wrote it (:func:`final_exports`) to ``--export`` and
    ``--export-hf``, each file written atomically, never through a link. Every member had written
    its own before the last ready point's all-gather. Sends nothing."""
    if world.rank != 0 or (cfg.export is None and cfg.export_hf is None):
        return
    best = last_ranked(last_rows)[0]["member"]
    losses = {row["member"]: row["val_loss"] for row in last_rows}
    for field, written in final_exports(cfg, best).items():
        asked = getattr(cfg, field)
        if field == "export":
            write_atomically(real_folder(Path(asked).parent) / Path(asked).name, Path(written).read_bytes())
        else:
            for name in (WEIGHTS, CONFIG):
                write_atomically(real_folder(asked) / name, (Path(written) / name).read_bytes())
        print(f"--{field.replace('_', '-')}: member {best}'s final model (the best: val loss {losses[best]:.4f}), "
              f"copied from {written} to {asked}", flush=True)


def agree(world, k: int, val_loss: float, population: int) -> list[float]:
    """Every member's validation loss, on every rank: one all-gather over the world of each rank's
    (member, loss), two float64 (the ranks of a member report the same loss)."""
    mine = np.array([k, val_loss], dtype=np.float64)  # (2,)
    every = world.all_gather(mine, label="metric: every member's validation loss (population-based training)")
    losses = [float("nan")] * population
    for member, loss in every.reshape(-1, 2):
        losses[int(member)] = float(loss)
    return losses


def copy_checkpoints(cfg, group, world, k: int, copies: dict, step: int) -> None:
    """Exploit: when member k copies a donor, the member's rank 0 replaces the member's checkpoint of
    ``step`` with the donor's, in two phases with a barrier over the world after each: every copier
    copies its donor's folder beside its own (a donor that copies too is still as it was), then
    every copier renames its copy into place. No member resumes before every copy is in place."""
    copying = k in copies and group.rank == 0
    root = Path(cfg.ckpt_dir)
    mine = step_dir(root / f"member-{k}", step)
    fresh = mine.with_name(mine.name + ".copying")
    if copying:
        shutil.rmtree(fresh, ignore_errors=True)
        shutil.copytree(step_dir(root / f"member-{copies[k]}", step), fresh)
    world.barrier(label="setup: every copying member has its donor's checkpoint beside its own")
    if copying:
        shutil.rmtree(mine, ignore_errors=True)  # (a member that diverged saved none)
        fresh.rename(mine)
    world.barrier(label="setup: every copying member's checkpoint is its donor's")


def start_row(member: Member, names, ranges: dict) -> dict:
    """Member ``member``'s start as a row of pbt.jsonl (the ready point of step 0): its first
    hyper-parameters and where each came from."""
    change = {n: f"drawn in [{ranges[n][0]:g}, {ranges[n][1]:g}]" if n in ranges else "given" for n in names}
    return dict(step=0, member=member.index, val_loss=None, before=None, donor=None, after=member.hparams,
                change=change)


def copy_text(row: dict, donors: dict) -> str:
    """``member 3 copies 0: lr 0.0131 -> 0.0157 (x1.2)``: a copy at a ready point, each explored
    hyper-parameter from the donor's value (``donors``: its row at that point) to the copy's, and how."""
    donor = donors[row["donor"]]["before"]
    return f"member {row['member']} copies {row['donor']}: " + ", ".join(
        f"{name} {donor[name]:.3g} -> {row['after'][name]:.3g} ({how})" for name, how in row["change"].items())


def record(cfg, world, members: list[Member], rows: list[dict], step: int) -> None:
    """Rank 0: the ready point in one line (each member's start at step 0), its rows appended to
    ``--out``/pbt.jsonl, the population to ``--ckpt-dir``/population/step-<n>.json (atomically).
    Sends nothing."""
    if world.rank != 0:
        return
    if step == 0:
        print("start: " + "; ".join(f"member {r['member']} {hparams_text(r['after'])} ({', '.join(r['change'].values())})"
                                    for r in rows), flush=True)
    else:
        by_member = {r["member"]: r for r in rows}
        copied = "; ".join(copy_text(r, by_member) for r in rows if r["donor"] is not None)
        last = rows[0]["after"] is None
        print(f"step {step:5d}  val loss " + ", ".join(f"{r['val_loss']:.4f}" for r in rows)
              + ("  (the end: no copy)" if last else f"  ({copied or 'no copy'})"), flush=True)
    if cfg.out is not None:
        with create(real_folder(cfg.out) / "pbt.jsonl", append=True, text=True) as f:  # never through a link
            f.writelines(json.dumps(r) + "\n" for r in rows)
    state = dict(step=step, members=[m.to_json() for m in members], rows=rows)
    write_atomically(real_folder(Path(cfg.ckpt_dir) / POPULATION) / f"step-{step:06d}.json", json.dumps(state).encode())


def resumed(cfg, world, group, k: int):
    """(members, step, history) from the newest population file under ``--ckpt-dir``; each member's
    checkpoints newer than it removed by the member's rank 0 (then a barrier over the world)."""
    folder = Path(cfg.ckpt_dir) / POPULATION
    files = sorted(folder.glob("step-*.json")) if folder.is_dir() else []
    if not files:
        raise ResumeRefused(f"--resume: no population file in {folder} (drop --resume to start from scratch)")
    state = read_population(files[-1], cfg.population)
    if group.rank == 0:
        for folder in step_dirs(Path(cfg.ckpt_dir) / f"member-{k}"):
            if step_of(folder) > state["step"]:
                shutil.rmtree(folder)
    world.barrier(label="setup: every member back at the population's step")
    history = [r for f in files for r in read_population(f, cfg.population)["rows"]]  # from step 0's: the starts
    members = [Member(m["index"], m["hparams"], m["parent"], m["val_loss"]) for m in state["members"]]
    return members, state["step"], history


POPULATION_BYTES = 1 << 24  # a population file: a few hundred bytes a member


def read_population(path: Path, population: int) -> dict:
    """The population file ``path`` (``record`` wrote it), read through the one bounded reader and
    checked for the fields ``--resume`` uses: a step, ``population`` members (index, hyper-parameters,
    parent, loss) and their rows. :class:`ResumeRefused` of one line naming the file otherwise."""
    state = read_json(path, POPULATION_BYTES, "a population file", error=ResumeRefused)
    number = (int, float)
    members = state.get("members") if isinstance(state, dict) else None
    fine = (isinstance(state, dict) and type(state.get("step")) is int and state["step"] >= 0
            and isinstance(members, list) and len(members) == population and isinstance(state.get("rows"), list)
            and all(isinstance(m, dict) and m.get("index") == i and type(m.get("parent")) is int
                    and 0 <= m["parent"] < population and isinstance(m.get("hparams"), dict)
                    and all(isinstance(v, number) and not isinstance(v, bool) for v in m["hparams"].values())
                    and (m.get("val_loss") is None or isinstance(m["val_loss"], number))
                    for i, m in enumerate(members))
            and all(isinstance(r, dict) for r in state["rows"]))
    if not fine:
        raise ResumeRefused(f"--resume: {path} is not a population file of {population} members (step, members with "
                            f"index, hparams, parent and val_loss, rows): remove it to resume from the one before")
    return state


def last_ranked(rows: list[dict]) -> list[dict]:
    """The rows of one ready point, best member first (population.ranked: the lowest loss, NaN last)."""
    order = ranked([r["val_loss"] for r in rows])
    return [rows[i] for i in order]


def final_line(history: list[dict], population: int) -> str:
    """The last ready point in one line: each member's validation loss and hyper-parameters, the best first."""
    last = last_ranked(history[-population:])
    return (f"the best member is {last[0]['member']}: val loss {last[0]['val_loss']:.4f} "
            f"({hparams_text(last[0]['before'])}); " + "; ".join(f"member {r['member']} {r['val_loss']:.4f}" for r in last[1:]))


def hparams_text(hparams: dict) -> str:
    """``lr 0.00433, weight_decay 0.1``: the explorable hyper-parameters of ``hparams``."""
    return ", ".join(f"{k} {v:.3g}" for k, v in hparams.items() if k in EXPLORABLE)
