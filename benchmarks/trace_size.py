"""The size of a ``--trace`` run directory, compact against plain, and the time inspect takes to read it.

    OMP_NUM_THREADS=1 python benchmarks/trace_size.py [--steps 200] [--ranks 8]     (about 2 minutes on 2 shared cores)

Runs the trainer under ``mpiexec`` with a tiny model (2 layers, 16 wide, T 16) on 8 ranks (dp 2 x
pp 2 x tp 2, 4 micro-batches; ``--ranks 4``: dp 2 x tp 2) for STEPS steps with ``--trace DIR --out
DIR``: the trainer streams every rank's events in the compact format (``Trace.stream``). Then
writes the very same events in the plain format (``Trace.save``: one JSON object per event, what
``--trace`` wrote before) to a second run directory, so both hold identical events, and times
``load_run`` (what ``python -m minidist.inspect`` reads first) on each, median of 3, the two
alternating, and the whole ``python -m minidist.inspect DIR`` once on each (read, merge the
Chrome trace, draw, print). Writes benchmarks/results/trace_size.json and prints a Markdown table.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAYOUTS = {8: ["--dp", "2", "--pp", "2", "--tp", "2", "--micro-batches", "4"], 4: ["--dp", "2", "--tp", "2"]}
TINY = ["--n-layer", "2", "--n-head", "4", "--n-embd", "16", "--block-size", "16"]


def load() -> str:
    """The load average over 1, 5 and 15 minutes, as ``uptime`` prints it."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ranks", type=int, default=8, choices=sorted(LAYOUTS))
    args = p.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from minidist.comm import Trace
    from minidist.inspect import load_run, write_trace

    work = Path(tempfile.mkdtemp(prefix="trace_size_"))
    compact, plain = work / "compact", work / "plain"
    command = ["mpiexec", "-n", str(args.ranks), sys.executable, "-m", "minidist.train", *LAYOUTS[args.ranks], *TINY,
               "--steps", str(args.steps), "--trace", str(compact), "--out", str(compact)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    before = load()
    t = time.perf_counter()
    subprocess.run(command, check=True, env=env, cwd=HERE.parent, stdout=subprocess.DEVNULL)
    train_s = time.perf_counter() - t
    for r in range(args.ranks):  # the same events, in the plain format
        write_trace(plain, Trace.load(compact / "trace" / f"rank{r}.jsonl"))
    shutil.copy(compact / "metrics.jsonl", plain / "metrics.jsonl")
    shutil.copytree(compact / "memory", plain / "memory")
    times = {"compact": [], "plain": []}
    events = {}
    for _ in range(3):
        for name, folder in (("compact", compact), ("plain", plain)):
            t = time.perf_counter()
            run = load_run(folder)
            times[name].append(time.perf_counter() - t)
            events[name] = [trace.events for trace in run.traces]
    assert events["compact"] == events["plain"], "the two formats read back different events"
    inspect_s = {}
    for name, folder in (("compact", compact), ("plain", plain)):  # the whole command: read, merge, draw, tables
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "minidist.inspect", str(folder)], check=True, env=env, cwd=HERE.parent,
                       stdout=subprocess.DEVNULL)
        inspect_s[name] = time.perf_counter() - t
    sizes = {name: folder_bytes(folder / "trace") for name, folder in (("compact", compact), ("plain", plain))}
    result = dict(command=" ".join(["OMP_NUM_THREADS=1", *command[:3], "python", *command[4:]]).replace(str(compact), "DIR"),
                  steps=args.steps, ranks=args.ranks, events=sum(len(e) for e in events["compact"]),
                  bytes=sizes, ratio=sizes["plain"] / sizes["compact"],
                  load_run_s={k: statistics.median(v) for k, v in times.items()}, inspect_s=inspect_s, train_s=train_s,
                  loadavg_before=before, loadavg_after=load(), cpus=os.cpu_count())
    shutil.rmtree(work)
    out = HERE / "results" / "trace_size.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"`{result['command']}` ({result['events']:,} events, trained in {train_s:.0f} s)\n")
    print("| format | trace bytes (all ranks) | bytes per event | load_run (median of 3) | python -m minidist.inspect |")
    print("|---|---|---|---|---|")
    for name in ("plain", "compact"):
        print(f"| {name} | {sizes[name]:,} | {sizes[name] / result['events']:.1f} | {result['load_run_s'][name]:.2f} s "
              f"| {inspect_s[name]:.1f} s |")
    print(f"\nplain / compact: {result['ratio']:.2f}x; load average {before} -> {result['loadavg_after']}; wrote {out}")


if __name__ == "__main__":
    main()
