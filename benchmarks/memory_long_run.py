"""Memory on a long run: the resident set size (RSS) of every rank of the trainer, sampled as it trains.

    python benchmarks/memory_long_run.py [--steps 3000] [--every 100]     (about 3 minutes on 2 shared cores)

Runs the trainer (``minidist.train.train`` on ``minidist.init()``'s world, as ``python -m
minidist.train`` does) with a tiny, fast model (1 layer, 16 wide, T = 8, global batch 2, AdamW) for
STEPS steps, on one process and on 2 data-parallel ranks under ``mpiexec``, each four ways, one after
the other in this one run:

    ring           the default: the trace keeps its last KEEP_RECENT events, main()'s history its last record
    ring+stream    the same with --trace DIR: every event streamed to DIR/trace/rank<r>.jsonl as it happens
    thread/step    the default, but the dp group's communication thread ends as soon as its queue is
                   empty (``CommStream.linger = 0``, as before): a new OS thread every step
    old            all of the old behaviour: ``init(trace_keep=None)`` keeps every event in memory, the
                   history every step, and a new communication thread every step
    system malloc  the default with glibc's own malloc settings (--system-allocator): every variant
                   above keeps freed memory for the next step (minidist/allocator.py), as
                   python -m minidist.train does

``--model default`` trains the trainer's default GPT (2 layers, 64 wide, T 64, batch 16) instead of
the tiny one: arrays large enough for the allocator setting to matter.

This script (the driver) polls each run every 50 ms: the step it has reached (the lines of rank 0's
metrics.jsonl) and each rank's VmRSS (/proc/<pid>/status), keeping the first sample past each
multiple of EVERY steps. Growth per 1000 steps is the least-squares slope of RSS against step over
the second half of the run (after allocator warm-up), averaged over ranks. Writes
benchmarks/results/memory_long_run.json and prints a Markdown table.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
VARIANTS = ("ring", "ring+stream", "thread/step", "old", "system malloc")
TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=8, batch_size=2, eval_iters=1, sample_tokens=0)


def worker(variant: str, steps: int, out: str, data_dir: str, model: str) -> None:
    """One run of the trainer on this MPI job's world, as ``variant`` says (see the module docstring)."""
    import minidist
    from minidist.allocator import keep_freed_memory
    from minidist.comm.trace import KEEP_RECENT
    from minidist.comm.work import CommStream
    from minidist.train import train
    from minidist.train.config import TrainConfig

    if variant != "system malloc":
        keep_freed_memory()  # as python -m minidist.train does by default
    if variant in ("thread/step", "old"):
        CommStream.linger = 0.0  # the thread ends when its queue is empty: one per step
    world = minidist.init(trace_keep=None if variant == "old" else KEEP_RECENT)
    size = TINY if model == "tiny" else dict(eval_iters=1, sample_tokens=0)
    cfg = TrainConfig(steps=steps, dp=world.size, eval_every=steps, data_dir=data_dir, out=out,
                      trace=out if variant == "ring+stream" else None, **size)
    train(cfg, progress=False, world=world, keep_history=variant == "old")


def rss_kib(pid: int) -> int | None:
    """VmRSS of process ``pid`` in KiB (None once it has gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def ranks_of(token: str) -> list[int]:
    """The pids of the worker processes whose command line holds ``token`` (this run's directory)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--worker" in cmdline and token.encode() in cmdline and b"mpiexec" not in cmdline[0]:
                pids.append(int(entry.name))
    return sorted(pids)


def steps_done(metrics: Path) -> int:
    """How many steps rank 0 has written to metrics.jsonl."""
    try:
        with open(metrics, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def measure(ranks: int, variant: str, steps: int, every: int, data_dir: str, mpiexec: str, model: str) -> dict:
    """Run one variant on ``ranks`` processes; returns its samples [(step, [RSS KiB per rank])], the
    wall seconds, and the growth per 1000 steps."""
    out = tempfile.mkdtemp(prefix=f"memory_{ranks}_{variant.replace('+', '_').replace('/', '_')}_")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--steps", str(steps),
           "--out", out, "--data-dir", data_dir, "--model", model]
    if ranks > 1:
        cmd = [mpiexec, "-n", str(ranks)] + cmd
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples, next_step, pids = [], 1, []  # from the first step done to the last: training, not start-up or exit
    while proc.poll() is None:
        if len(pids) < ranks:
            pids = ranks_of(out)
        done = steps_done(Path(out) / "metrics.jsonl")
        if len(pids) == ranks and next_step <= done < steps:
            rss = [rss_kib(pid) for pid in pids]
            if None not in rss:
                samples.append((done, rss))
                next_step = (done // every + 1) * every
        time.sleep(0.05)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr.read()[-3000:]}")
    trace_bytes = sum(p.stat().st_size for p in (Path(out) / "trace").glob("*.jsonl")) if variant == "ring+stream" else 0
    shutil.rmtree(out, ignore_errors=True)
    late = [(s, np.mean(r)) for s, r in samples if s >= steps // 2]
    slope = float(np.polyfit([s for s, _ in late], [r for _, r in late], 1)[0]) if len(late) >= 2 else float("nan")
    return dict(ranks=ranks, variant=variant, model=model, steps=steps, seconds=seconds, samples=samples,
                rss_first_mib=float(np.mean(samples[0][1])) / 1024, rss_last_mib=float(np.mean(samples[-1][1])) / 1024,
                growth_kib_per_1000_steps=1000 * slope, trace_file_bytes=trace_bytes)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000, help="training steps per run (default %(default)s)")
    ap.add_argument("--every", type=int, default=100, help="sample RSS every this many steps (default %(default)s)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="world sizes (default 1 2)")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--model", choices=("tiny", "default"), default="tiny")
    ap.add_argument("--json", default=str(HERE / "results" / "memory_long_run.json"))
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)  # one run, started by the driver
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--data-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.out, args.data_dir, args.model)
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None and max(args.ranks) > 1:
        sys.exit("mpiexec not found (the 2-rank runs need it); --ranks 1 runs one process only")
    from minidist.train.build import load_data
    from minidist.train.config import TrainConfig
    data_dir = tempfile.mkdtemp(prefix="memory_data_")
    load_data(TrainConfig(data_dir=data_dir))  # the corpus once, before any run times or samples
    rows = []
    try:
        for ranks in args.ranks:
            for variant in args.variants:
                rows.append(measure(ranks, variant, args.steps, args.every, data_dir, mpiexec, args.model))
                r = rows[-1]
                print(f"{ranks} rank(s) {variant:<12} {r['seconds']:6.1f} s  RSS {r['rss_first_mib']:.1f} -> "
                      f"{r['rss_last_mib']:.1f} MiB  growth {r['growth_kib_per_1000_steps']:8.1f} KiB / 1000 steps",
                      flush=True)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1))
    print("\n| ranks | variant | steps | ms / step | RSS after step 1 (MiB) | RSS at the end (MiB) | "
          "growth / 1000 steps (KiB) | growth vs old | trace on disk (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        old = next((o for o in rows if o["ranks"] == r["ranks"] and o["variant"] == "old"), None)
        ratio = f"{r['growth_kib_per_1000_steps'] / old['growth_kib_per_1000_steps']:.3f}x" if old else "-"
        disk = f"{r['trace_file_bytes'] / 2**20:.1f}" if r["trace_file_bytes"] else "-"
        print(f"| {r['ranks']} | {r['variant']} | {r['steps']} | {1e3 * r['seconds'] / r['steps']:.1f} | "
              f"{r['rss_first_mib']:.1f} | {r['rss_last_mib']:.1f} | {r['growth_kib_per_1000_steps']:.1f} | "
              f"{ratio} | {disk} |")


if __name__ == "__main__":
    main()
