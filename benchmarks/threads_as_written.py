"""The README's commands as a learner types them, against their ``OMP_NUM_THREADS=1`` form.

    python benchmarks/threads_as_written.py              (about 3 minutes on 2 lightly loaded cores)
    python benchmarks/threads_as_written.py --before     (and OMP_NUM_THREADS=<cores>: every rank a
                                                          whole BLAS pool, as the commands ran before
                                                          minidist limited its threads; minutes more)
    python benchmarks/threads_as_written.py --only lesson05

NumPy's BLAS starts a thread pool as large as the machine in every process, so 8 ranks on 2 cores
ran 16 spinning threads: issue 36 measured the README's context-parallel command at 2 min 37 s as
written and 24.6 s with OMP_NUM_THREADS=1. The trainer and every lesson now take their share of the
cores themselves (minidist/threads.py). Each command below runs as written (no OMP_NUM_THREADS in its
environment) and with OMP_NUM_THREADS=1, one after the other, and the script reports the wall time
of the whole command (start-up included) and the ratio; both forms must print the same final
losses (the trainer) or pass (the lesson). With ``--before`` a third form sets OMP_NUM_THREADS to the
machine's cores: an explicit setting is respected, so that is the old behaviour as written.

Results: benchmarks/results/threads_as_written.json and a Markdown table on stdout (RESULTS.md).
Every run works in a temporary folder (no runs/ left in the repository).
"""
import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from minidist.launchers import find_mpiexec, mpiexec_flags
from minidist.threads import machine_cores

REPO = Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, "-m", "minidist.train"]
COMMANDS = {  # name: (README section, ranks, the command after `mpiexec -n N`)
    "lesson05": ("Learn it: lesson 05", 4, [sys.executable, str(REPO / "tutorials" / "05_zero.py")]),
    "cp_zigzag": ("Run and inspect: context parallelism", 8,
                  TRAIN + "--dp 2 --cp 2 --cp-algorithm zigzag --tp 2 --sequence-parallel --zero 2 "
                          "--block-size 128 --explain --steps 50".split()),
    "main_job": ("Quickstart: the main job, without its OMP_NUM_THREADS=1", 8,
                 TRAIN + "--dp 2 --tp 2 --pp 2 --zero 1 --schedule 1f1b --micro-batches 8 --steps 200".split()),
}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def run(ranks: int, command: list, omp: str | None, cwd: str) -> dict:
    """One launch of ``mpiexec -n ranks command`` with OMP_NUM_THREADS ``omp`` (None: unset): its
    wall seconds, exit status, the trainer's final line and whether it said it limited threads."""
    mpiexec = find_mpiexec()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    start = time.perf_counter()
    done = subprocess.run([mpiexec, *mpiexec_flags(mpiexec, allow_root=os.geteuid() == 0), "-n", str(ranks), *command],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=1800)
    seconds = time.perf_counter() - start
    final = re.findall(r"^final: .*$", done.stdout, flags=re.M)
    said = re.findall(r"^\d+ ranks share this machine's .*$", done.stdout, flags=re.M)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} (OMP_NUM_THREADS={omp}) exited {done.returncode}:\n{done.stdout[-2000:]}\n"
                 f"{done.stderr[-2000:]}")
    return {"omp_num_threads": omp, "seconds": round(seconds, 2), "final": final[-1] if final else None,
            "threads_line": said[0] if said else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=list(COMMANDS), action="append", help="run only these commands (repeatable)")
    ap.add_argument("--before", action="store_true", help="also OMP_NUM_THREADS=<cores> (the old behaviour as written)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "threads_as_written.json"))
    args = ap.parse_args()
    cores = machine_cores()
    forms = [None, "1"] + [str(cores)] * args.before  # as written, OMP_NUM_THREADS=1, (the old pools)
    meta = {"cores": cores, "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
            "uptime_start": uptime()}
    print(f"{cores} cores; {meta['uptime_start']}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="threads_as_written.") as cwd:
        for name in args.only or list(COMMANDS):
            section, ranks, command = COMMANDS[name]
            runs = [run(ranks, command, omp, cwd) for omp in forms]
            if len({r["final"] for r in runs}) != 1:
                sys.exit(f"{name}: the forms trained to different losses: {[r['final'] for r in runs]}")
            row = {"name": name, "section": section, "command": f"mpiexec -n {ranks} " + " ".join(
                       "python" if c == sys.executable else os.path.relpath(c, REPO) if c.startswith(str(REPO)) else c
                       for c in command), "runs": runs, "uptime_after": uptime()}
            row["as_written_over_omp1"] = round(runs[0]["seconds"] / runs[1]["seconds"], 2)
            if args.before:
                row["before_over_omp1"] = round(runs[2]["seconds"] / runs[1]["seconds"], 2)
            rows.append(row)
            print(f"{name}: as written {runs[0]['seconds']:.1f} s, OMP_NUM_THREADS=1 {runs[1]['seconds']:.1f} s"
                  + (f", OMP_NUM_THREADS={cores} {runs[2]['seconds']:.1f} s" if args.before else "")
                  + f"; {row['uptime_after']}", flush=True)
    meta["uptime_end"] = uptime()
    Path(args.out).write_text(json.dumps({"machine": meta, "rows": rows}, indent=1) + "\n")
    before = f" | OMP_NUM_THREADS={cores} (before) s | before / =1" if args.before else ""
    print(f"\n| command | as written s | OMP_NUM_THREADS=1 s | as written / =1{before} | load after (1 min) |")
    print("|---|---|---|---|" + "---|---|" * args.before + "---|")
    for row in rows:
        runs, load = row["runs"], row["uptime_after"].split("load average:")[-1].split(",")[0].strip()
        extra = f" | {runs[2]['seconds']:.1f} | {row['before_over_omp1']:.2f}x" if args.before else ""
        print(f"| `{row['command']}` | {runs[0]['seconds']:.1f} | {runs[1]['seconds']:.1f} | "
              f"{row['as_written_over_omp1']:.2f}x{extra} | {load} |")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
