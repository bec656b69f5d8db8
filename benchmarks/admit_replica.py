"""The time to admit a new data-parallel replica into a running job, against the model's size.

    OMP_NUM_THREADS=1 /tmp/minidist-openmpi/bin/python benchmarks/admit_replica.py     (Open MPI 5: .ci/openmpi)
    ... --widths 64,128 --repeats 1

For each width (n_embd; 2 blocks, 4 heads, float32, AdamW, ZeRO-1) one job of 2 ranks,
``python -m minidist.run -n 2 -- -m minidist.train ... --fault-tolerant --spares 1 --grow-at 2``,
which at step 2's start spawns a third trainer and hands it the weights and AdamW's moments. The
trainer's own line is read for: the spawn (MPI_Comm_spawn and the merge, the new process's Python and
MPI start-up included); the hand-over's broadcasts alone (each old rank's ZeRO part; the bytes each new
rank received: masters, m and v, 12 bytes a parameter); and from the merge to training again (the new
rank's start-up: its checks, the data opened, the grown mesh, model and state formed, the broadcasts). The
launcher adds Open MPI's fault-tolerance flags (``--with-ft ulfm``) for ``--fault-tolerant``.

Results: benchmarks/results/admit_replica.json and a Markdown table on stdout (RESULTS.md).
"""
import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOINED = re.compile(r"1 replica joined \(rank 2, started in ([\d.]+) s\); going on with dp 3 on 3 ranks, the weights "
                    r"and optimizer state handed over \(([\d.]+) MiB to each new rank in ([\d.]+) s; joined in ([\d.]+) s\)")


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def one_job(width: int, folder: Path) -> dict:
    """One job that admits a replica at step 2: its parameters, spawn seconds, MiB and hand-over seconds."""
    train = ["-m", "minidist.train", "--n-layer", "2", "--n-head", "4", "--n-embd", str(width), "--block-size", "32",
             "--batch-size", "6", "--steps", "3", "--eval-every", "1000", "--eval-iters", "1", "--sample-tokens", "0",
             "--zero", "1", "--dp", "2", "--fault-tolerant", "--spares", "1", "--grow-at", "2", "--comm-timeout", "120",
             "--data-dir", str(folder / "data")]
    job = subprocess.run([sys.executable, "-m", "minidist.run", "-n", "2", "--timeout", "240", "--", *train],
                         capture_output=True, text=True, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    said = JOINED.search(job.stdout)
    if job.returncode != 0 or not said:
        raise SystemExit(f"width {width}: the job failed ({job.returncode})\n{job.stdout}\n{job.stderr}")
    parameters = int(re.search(r"([\d,]+) parameters on rank 0", job.stdout)[1].replace(",", ""))
    return {"parameters": parameters, "spawn_s": float(said[1]), "mib": float(said[2]), "hand_over_s": float(said[3]),
            "joined_s": float(said[4])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="64,128,256,512")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    load_before, rows = uptime(), []
    with tempfile.TemporaryDirectory() as tmp:
        runs = {w: [one_job(w, Path(tmp)) for _ in range(args.repeats)] for w in widths}
    for w, jobs in runs.items():
        rows.append({"n_embd": w, "parameters": jobs[0]["parameters"], "mib_to_each_new_rank": jobs[0]["mib"],
                     "spawn_s": [j["spawn_s"] for j in jobs], "hand_over_s": [j["hand_over_s"] for j in jobs],
                     "joined_s": [j["joined_s"] for j in jobs]})
    result = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "python": sys.executable, "load_before": load_before, "load_after": uptime(), "rows": rows}
    out = REPO / "benchmarks" / "results" / "admit_replica.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("| n_embd | parameters | MiB to the new rank | spawn + merge (s) | broadcasts (s) | MB/s | "
          "merged to training (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        hand = statistics.median(r["hand_over_s"])
        print(f"| {r['n_embd']} | {r['parameters']:,} | {r['mib_to_each_new_rank']:.2f} | "
              f"{statistics.median(r['spawn_s']):.2f} | {hand:.3f} | {r['mib_to_each_new_rank'] * 2**20 / 1e6 / hand:.0f} | "
              f"{statistics.median(r['joined_s']):.2f} |")
    print(f"\n{result['load_before']}\n{result['load_after']}")


if __name__ == "__main__":
    main()
