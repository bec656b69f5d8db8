"""Scaling of the README's main job: its 3D layout against one process on the same machine, and
where each rank's time goes, from the trace.

    python benchmarks/scaling.py [--steps 30] [--rounds 2]     # launches its own jobs, ~2 min
    python benchmarks/scaling.py --plot                        # table + figure from the saved JSON

Three runs of ``python -m minidist.train`` train the same model on the same global batch (16 x 64
tokens, AdamW, clipping, float32), taking turns ``--rounds`` times:

- **3D**: the main job, ``mpiexec -n 8 ... --dp 2 --tp 2 --pp 2 --zero 1 --schedule 1f1b
  --micro-batches 8``;
- **1 process**: ``mpiexec -n 1``, the whole batch at once;
- **dp 2**: ``mpiexec -n 2 ... --dp 2``, the layout that fits 2 cores.

tokens/s is the median of the per-step figure the trainer writes to metrics.jsonl, after 5 warm-up
steps. The 3D run is traced (``--trace``); each of its steps after the warm-up is cut out by the
optimizer spans (minidist/inspect/timeline.py) and every rank's share of the step is split into:

- **compute**: inside forward / backward / optimizer spans, but not inside a collective (a
  tensor-parallel all-reduce blocks inside forward: that time is communication);
- **communication**, by mesh axis: inside a collective on a tp group (the blocks' all-reduces, and
  the vocabulary-parallel loss's), on a dp group (ZeRO-1's reduce-scatter and all-gather, the loss
  average), or another (the pipeline's loss broadcast, the tied embedding's all-reduce, the norm
  over the world), whichever span it falls in;
- **pipeline wait**: from posting a receive from the neighbour stage to the next compute: the
  bubble, as this rank saw it;
- **idle**: the rest: Python between spans, and, with 8 ranks on 2 cores, waiting for a core.

Results: benchmarks/results/scaling.json, benchmarks/figures/scaling.png.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from minidist.inspect.load import load_run
from minidist.inspect.timeline import busy_seconds, step_window
from minidist.inspect.accounting import axis_of

HERE = Path(__file__).resolve().parent
RESULTS, FIGURE = HERE / "results" / "scaling.json", HERE / "figures" / "scaling.png"
MAIN_JOB = ["--dp", "2", "--tp", "2", "--pp", "2", "--zero", "1", "--schedule", "1f1b", "--micro-batches", "8"]
LAYOUTS = {"3D (dp2 tp2 pp2, ZeRO-1, 1F1B, 8 micro-batches)": (8, MAIN_JOB),
           "1 process": (1, []),
           "dp 2": (2, ["--dp", "2"])}
WARMUP = 5
PARTS = ("compute", "tp communication", "dp communication", "other communication", "pipeline wait", "idle")


def run_job(ranks: int, flags: list[str], steps: int, run_dir: Path, trace: bool) -> list[float]:
    """Train ``steps`` steps of ``python -m minidist.train`` on ``ranks`` MPI processes with ``flags``;
    returns tokens/s of each step after the warm-up (and leaves a trace in ``run_dir`` if asked)."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec), "-n", str(ranks), sys.executable, "-m", "minidist.train", *flags, "--steps", str(steps),
           "--eval-every", str(10 * steps), "--eval-iters", "1", "--sample-tokens", "0", "--out", str(run_dir)]
    cmd += ["--trace", str(run_dir)] if trace else []
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=600)
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line)["tokens_per_s"] for line in f][WARMUP:]


def breakdown(run_dir: Path, steps: int) -> list[dict]:
    """Per rank, the mean seconds per step in each of PARTS over the steps after the warm-up."""
    traces = load_run(run_dir).traces
    parts = np.zeros((len(traces), len(PARTS)))
    for step in range(WARMUP, steps):
        window = step_window(traces, step)
        for r, t in enumerate(traces):
            events = sorted(t.events, key=lambda e: e.start)
            compute = [e for e in events if e.kind == "compute"]
            collective = [e for e in events if e.kind == "collective"]
            busy_any = busy_seconds(compute + collective, window)
            comm = busy_seconds(collective, window)
            tp, dp = (busy_seconds([e for e in collective if axis_of(e.group) == axis], window) for axis in ("tp", "dp"))
            waits = [SimpleNamespace(start=e.start, end=next((c.start for c in compute if c.start >= e.start), e.start))
                     for e in events if e.kind == "p2p" and e.op == "irecv"]
            wait = busy_seconds(waits + compute + collective, window) - busy_any
            length = window[1] - window[0]
            parts[r] += (busy_any - comm, tp, dp, comm - tp - dp, wait, length - busy_any - wait)
    parts /= steps - WARMUP
    return [dict(rank=r, **{p: float(s) for p, s in zip(PARTS, row)}) for r, row in enumerate(parts)]


def measure(args) -> dict:
    uptime = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    tokens = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for name, (ranks, flags) in (LAYOUTS.items() if i % 2 == 0 else reversed(LAYOUTS.items())):
                run_dir = Path(tmp) / f"{ranks}-{i}"
                traced = ranks == 8 and i == 0
                tokens[name] += run_job(ranks, flags, args.steps, run_dir, trace=traced)
                if traced:
                    ranks_parts = breakdown(run_dir, args.steps)
                print(f"round {i + 1}/{args.rounds}: {name} done, load average {os.getloadavg()[0]:.2f}", flush=True)
    uptime.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    return dict(tokens_per_s={name: float(np.median(v)) for name, v in tokens.items()}, samples=tokens,
                breakdown=ranks_parts, steps=args.steps, rounds=args.rounds, uptime=uptime,
                machine=platform.machine(), cpus=os.cpu_count(), numpy=np.__version__,
                python=platform.python_version())


def table(result) -> str:
    one = result["tokens_per_s"]["1 process"]
    lines = ["| layout | ranks | tokens/s | against 1 process |", "|---|---:|---:|---:|"]
    for name, (ranks, _) in LAYOUTS.items():
        tps = result["tokens_per_s"][name]
        lines.append(f"| {name} | {ranks} | {tps:,.0f} | {tps / one:.2f}x |")
    lines += ["", "| rank | step ms | " + " | ".join(PARTS) + " |", "|---:|---:|" + "---:|" * len(PARTS)]
    for row in result["breakdown"]:
        total = sum(row[p] for p in PARTS)
        lines.append(f"| {row['rank']} | {1e3 * total:.1f} | "
                     + " | ".join(f"{1e3 * row[p]:.1f} ({100 * row[p] / total:.0f}%)" for p in PARTS) + " |")
    return "\n".join(lines)


def plot(result) -> None:
    """Left: tokens/s per layout. Right: each rank's step of the 3D job, stacked by part."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw=dict(width_ratios=(1, 1.6)))
    names = list(LAYOUTS)
    left.barh(range(len(names)), [result["tokens_per_s"][n] for n in names], color=["#4e79a7", "#9c9c9c", "#76b7b2"])
    left.set_yticks(range(len(names)))
    left.set_yticklabels([n.replace(" (", "\n(") for n in names], fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("tokens/s (median step)")
    rows = result["breakdown"]
    bottom = np.zeros(len(rows))
    for part, color in zip(PARTS, ("#4e79a7", "#f28e2b", "#59a14f", "#edc948", "#e15759", "#d9d9d9")):
        ms = np.array([1e3 * r[part] for r in rows])
        right.bar([r["rank"] for r in rows], ms, bottom=bottom, color=color, label=part)
        bottom += ms
    right.set_xticks([r["rank"] for r in rows])
    right.set_xlabel("rank of the 3D job")
    right.set_ylabel("ms per step (mean)")
    right.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    fig.suptitle(f"The main job on {result['cpus']} cores: tokens/s, and where each rank's step goes")
    fig.tight_layout()
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="steps per job (the first 5 are warm-up)")
    p.add_argument("--rounds", type=int, default=2, help="turns of the three layouts")
    p.add_argument("--plot", action="store_true", help="table and figure from the saved JSON only")
    args = p.parse_args()
    if args.plot:
        result = json.loads(RESULTS.read_text())
    else:
        result = measure(args)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(result, indent=1))
    print(table(result))
    plot(result)


if __name__ == "__main__":
    main()
