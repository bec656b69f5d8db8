"""What crossing machines costs tensor parallelism and data parallelism, side by side.

    sudo python benchmarks/several_machines.py           (root: it makes two network namespaces)
    python benchmarks/several_machines.py --repeats 3 --steps 20 --rate 1gbit

Jobs of 2 ranks, float32, a 4-block GPT of width 128: tensor parallelism (``--tp 2``) and data
parallelism (``--dp 2``), at 512 and at 2,048 tokens a step, each run on one machine and across two,
measured side by side (the eight interleaved, ``--repeats`` times):

- ``one machine``: ``mpiexec -n 2`` in the first namespace, every message through shared memory;
- ``two machines``: two network namespaces joined by a veth pair (tests/netns.py), one rank in each
  (``host:1`` lines), so the group's every message crosses the pair.

Messages between the namespaces go over TCP on the veth pair (``UCX_TLS=tcp,self``), the stand-in here
for a network between machines, capped at ``--rate`` (default 1 Gbit/s, tc's token bucket: a slow
Ethernet; the veth alone moves data at memory speed). Two ranks on this machine's 2 cores, so no rank
waits for a core: what a rank waits for is the link. Tensor parallelism all-reduces activations in
every block, forward and backward, and waits for each; data parallelism all-reduces the gradients
once a step, in buckets started while backward still runs. So what tp sends grows with the tokens
of a step, and what dp sends with the parameters. Reported: the median time per step
(steps after the first two, from the trainer's ``tokens_per_s``), the bytes that crossed per step
(the pair's own counters), and for each layout the ratio of two machines to one. The trainer's own
report is checked: "tp groups across 2 machines" with its warning, "dp groups across 2 machines".

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

MODEL = ["--n-layer", "4", "--n-head", "4", "--n-embd", "128", "--eval-every", "1000", "--eval-iters", "1",
         "--sample-tokens", "0"]
BATCHES = {"B 8 x T 64": (8, 64), "B 16 x T 128": (16, 128)}  # tokens per step: 512, 2,048
LAYOUTS = {"tp 2": ["--tp", "2"], "dp 2": ["--dp", "2"]}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def one_run(batch: str, layout: str, across: bool, machines, folder: Path, steps: int) -> dict:
    """Train ``steps`` steps of ``layout`` on ``batch`` on one machine or across two: median ms/step,
    bytes crossed."""
    out = folder / f"run-{len(list(folder.iterdir()))}"
    b, t = BATCHES[batch]
    train = ["--", "-m", "minidist.train", *MODEL, "--batch-size", str(b), "--block-size", str(t), *LAYOUTS[layout],
             "--steps", str(steps), "--out", str(out)]
    launcher = [sys.executable, "-m", "minidist.run", "-n", "2"]
    if across:
        hosts = machines.hostfile(folder / "hosts", slots=1)
        cmd = machines.command(*launcher, "--hostfile", hosts, "--launcher-args", *machines.hydra_args(), *train)
    else:  # in the first namespace too, with the same settings: only where the ranks run differs
        cmd = machines.command(*launcher, *train)
    before = machines.received_bytes(machines.b)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env={**os.environ, **TCP_ONLY})
    if done.returncode:
        raise SystemExit(f"{layout} across={across}: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
    crossed = machines.received_bytes(machines.b) - before
    axis = layout.split()[0]
    assert (f"{axis} groups across 2 machines" in done.stdout) == across, done.stdout
    assert ("warning: tensor-parallel groups cross machines" in done.stdout) == (across and axis == "tp"), done.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"ms_per_step": statistics.median(1000 * b * t / r["tokens_per_s"] for r in rows[2:]),
            "bytes_per_step": crossed / steps}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rate", default="1gbit", help="the link between the machines: tc's rate (none: the veth's own)")
    args = ap.parse_args()
    load_before = uptime()
    runs = {(batch, layout, across): [] for batch in BATCHES for layout in LAYOUTS for across in (False, True)}
    with tempfile.TemporaryDirectory(prefix="several-machines-") as tmp, two_machines(Path(tmp)) as machines:
        if args.rate != "none":
            machines.limit_rate(args.rate)
        for _ in range(args.repeats):  # interleaved: a change of load touches all four alike
            for key in runs:
                runs[key].append(one_run(*key, machines, Path(tmp), args.steps))
    result = {}
    for batch in BATCHES:
        for layout in LAYOUTS:
            one, two = ({"ms_per_step": statistics.median(r["ms_per_step"] for r in runs[(batch, layout, a)]),
                         "bytes_per_step": statistics.median(r["bytes_per_step"] for r in runs[(batch, layout, a)]),
                         "runs": runs[(batch, layout, a)]} for a in (False, True))
            result[f"{layout}, {batch}"] = {"one machine": one, "two machines": two,
                                            "ratio": two["ms_per_step"] / one["ms_per_step"]}
    meta = {"machine": f"{platform.node()}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}",
            "load_before": load_before, "load_after": uptime(), "steps": args.steps, "repeats": args.repeats,
            "model": " ".join(MODEL), "link": f"TCP over a veth pair between two network namespaces "
                                              f"(UCX_TLS=tcp,self), rate {args.rate}"}
    path = REPO / "benchmarks" / "results" / "several_machines.json"
    path.write_text(json.dumps({"meta": meta, "layouts": result}, indent=1) + "\n")
    print(f"{meta['machine']}; link: {meta['link']}\nload before: {load_before}\nload after: {meta['load_after']}\n")
    print("| layout, batch | one machine, ms/step | two machines, ms/step | ratio | bytes across per step |")
    print("|---|---|---|---|---|")
    for layout, r in result.items():
        print(f"| {layout} | {r['one machine']['ms_per_step']:.1f} | {r['two machines']['ms_per_step']:.1f} | "
              f"**{r['ratio']:.2f}x** | {r['two machines']['bytes_per_step'] / 1024:,.0f} KiB |")


if __name__ == "__main__":
    main()
