"""What a population writes and reads back (train/pbt.py runs it): its lineage and its files.

    pbt.jsonl                    a row per member per ready point (``record``; step 0's rows: the starts)
    population/step-<n>.json     every member, its hyper-parameters and parent, at each ready point
                                 (``record``; ``--resume`` reads the newest back: ``resumed``)
    member-<k>/step-<n>          a copying member's checkpoint replaced by its donor's (``copy_checkpoints``)
    member-<k>/final.*           each member's final model; the best one's copied to ``--export`` (``export_best``)

Rank 0 writes (never through a link, atomically where a file is replaced); every read of a file from
disk goes through the one bounded reader and is checked for what it is used for.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from minidist.checkpoint.format import step_dir, step_dirs, step_of
from minidist.checkpoint.training import ResumeRefused
from minidist.files import create, real_folder, write_atomically
from minidist.train.outputs import copy_final_model
from minidist.train.population import EXPLORABLE, POPULATION, Member, ranked
from minidist.untrusted import read_json


def member_folder(cfg, k: int) -> Path:
    """Member ``k``'s checkpoint folder, where its last segment writes its final model."""
    return Path(cfg.ckpt_dir) / f"member-{k}"


def export_best(cfg, world, last_rows: list[dict]) -> None:
    """Rank 0: the best member's final model (lowest validation loss in ``last_rows``, the last ready
    point's) copied from where its last segment wrote it (outputs.py: ``final_exports``) to ``--export`` and
    ``--export-hf``, each file written atomically, never through a link. Every member had written
    its own before the last ready point's all-gather. Sends nothing."""
    if world.rank != 0 or (cfg.export is None and cfg.export_hf is None):
        return
    best = last_ranked(last_rows)[0]["member"]
    losses = {row["member"]: row["val_loss"] for row in last_rows}
    for flag, (written, asked) in copy_final_model(cfg, member_folder(cfg, best)).items():
        print(f"{flag}: member {best}'s final model (the best: val loss {losses[best]:.4f}), copied from {written} "
              f"to {asked}", flush=True)


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
