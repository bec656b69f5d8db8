"""What placement costs when a job spans machines: tp inside machines against tp across them.

    sudo python benchmarks/several_machines.py           (root: it makes two network namespaces)
    python benchmarks/several_machines.py --repeats 3 --steps 20

One job, dp 2 x tp 2 on 4 ranks, float32, placed three ways, measured side by side (the three
interleaved, ``--repeats`` times):

- ``one machine``: ``mpiexec -n 4``, every message through shared memory;
- ``tp inside``: two "machines", two network namespaces joined by a veth pair (tests/netns.py),
  2 ranks each (``host:2`` lines): each tp group inside a machine, the dp groups across, so only
  the gradients' all-reduce, once a step, crosses the pair;
- ``tp across``: the same two machines, ranks dealt round-robin (``-ppn 1``): ranks 0 and 2 on one,
  1 and 3 on the other, so every tp group spans both machines and its activation all-reduces (four
  per block and step, forward and backward, each waited for) cross the pair, while dp stays inside.

Messages between the namespaces go over TCP on the veth pair (``UCX_TLS=tcp,self``), the stand-in here
for a network between machines, capped at ``--rate`` (default 1 Gbit/s, tc's token bucket: a slow
Ethernet; the veth alone moves data at memory speed); the pair's own byte counters say how much crossed. Reported: the
median time per step (steps after the first two, from the trainer's ``tokens_per_s``), the bytes
that crossed per step, and the ratios to ``tp inside``. The trainer's own report line is checked:
"tp groups inside a machine, dp groups across 2 machines" and "tp groups across 2 machines, dp
groups inside a machine" with its warning.

Results: benchmarks/results/several_machines.json and a Markdown table on stdout (RESULTS.md).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.netns import TCP_ONLY, two_machines  # noqa: E402 -- the repository's test helpers

MODEL = ["--n-layer", "4", "--n-head", "4", "--n-embd", "128", "--block-size", "64", "--batch-size", "8",
         "--eval-every", "1000", "--eval-iters", "1", "--sample-tokens", "0", "--dp", "2", "--tp", "2"]
SAID = {"tp inside": "tp groups inside a machine, dp groups across 2 machines",
        "tp across": "tp groups across 2 machines, dp groups inside a machine"}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def one_run(placement: str, machines, folder: Path, steps: int) -> dict:
    """Train ``steps`` steps placed as ``placement``; its median ms/step and the bytes that crossed."""
    out = folder / f"{placement.replace(' ', '_')}-{len(list(folder.iterdir()))}"
    train = ["--", "-m", "minidist.train", *MODEL, "--steps", str(steps), "--out", str(out)]
    launcher = [sys.executable, "-m", "minidist.run", "-n", "4"]
    if placement == "one machine":
        cmd, env = launcher + train, dict(os.environ)
    else:
        slots = 2 if placement == "tp inside" else None
        hosts = machines.hostfile(folder / f"hosts-{placement.replace(' ', '_')}", slots)
        extra = machines.hydra_args() + ([] if slots else ["-ppn", "1"])
        cmd = machines.command(*launcher, "--hostfile", hosts, "--launcher-args", *extra, *train)
        env = {**os.environ, **TCP_ONLY}
    before = machines.received_bytes(machines.b) if machines else 0
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    if done.returncode:
        raise SystemExit(f"{placement}: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
    crossed = (machines.received_bytes(machines.b) - before) if placement != "one machine" else 0
    if placement in SAID:
        assert SAID[placement] in done.stdout, done.stdout
        assert ("warning: tensor-parallel groups cross machines" in done.stdout) == (placement == "tp across")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tokens = 8 * 64
    ms = [1000 * tokens / r["tokens_per_s"] for r in rows[2:]]
    return {"ms_per_step": statistics.median(ms), "bytes_per_step_received_by_machine_1": crossed / steps}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rate", default="1gbit", help="the link between the machines: tc's rate (none: the veth's own)")
    args = ap.parse_args()
    placements = ["one machine", "tp inside", "tp across"]
    load_before = uptime()
    runs = {p: [] for p in placements}
    with tempfile.TemporaryDirectory(prefix="several-machines-") as tmp, two_machines(Path(tmp)) as machines:
        if args.rate != "none":
            machines.limit_rate(args.rate)
        for _ in range(args.repeats):  # interleaved: a change of load touches all three alike
            for p in placements:
                runs[p].append(one_run(p, machines, Path(tmp), args.steps))
    result = {p: {"ms_per_step": statistics.median(r["ms_per_step"] for r in rs),
                  "bytes_per_step_received_by_machine_1": statistics.median(
                      r["bytes_per_step_received_by_machine_1"] for r in rs), "runs": rs} for p, rs in runs.items()}
    inside = result["tp inside"]["ms_per_step"]
    for p in placements:
        result[p]["ratio_to_tp_inside"] = result[p]["ms_per_step"] / inside
    meta = {"machine": f"{platform.node()}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}",
            "load_before": load_before, "load_after": uptime(), "steps": args.steps, "repeats": args.repeats,
            "model": " ".join(MODEL), "link": f"TCP over a veth pair between two network namespaces (UCX_TLS=tcp,self), rate {args.rate}"}
    path = REPO / "benchmarks" / "results" / "several_machines.json"
    path.write_text(json.dumps({"meta": meta, "placements": result}, indent=1) + "\n")
    print(f"{meta['machine']}; load before: {load_before}; after: {meta['load_after']}\n")
    print("| placement | ms per step (median) | ratio to tp inside | bytes received by machine 1 per step |")
    print("|---|---|---|---|")
    for p in placements:
        r = result[p]
        print(f"| {p} | {r['ms_per_step']:.1f} | {r['ratio_to_tp_inside']:.2f} | "
              f"{r['bytes_per_step_received_by_machine_1'] / 1024:,.0f} KiB |")


if __name__ == "__main__":
    main()
