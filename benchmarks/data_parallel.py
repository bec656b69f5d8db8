"""Benchmark data parallelism: weak scaling from 1 to 2 ranks, and how much of the gradient
all-reduce hides under backward, per bucket size.

    python benchmarks/data_parallel.py               # 40 s idle, ~2 min loaded; launches its own jobs
    python benchmarks/data_parallel.py --plot        # table + figure from the saved JSON

Weak scaling: every rank trains on a FIXED batch of 16 rows (the default model of ``python -m
minidist.train``: 2 layers, 64 wide, T = 64, float32, AdamW, clipping), so 2 ranks process twice the
tokens of 1 rank per step. efficiency = tokens/s(2 ranks) / (2 x tokens/s(1 rank)); 100% means the
all-reduces cost nothing. One step is ``minidist.parallel.step.train_step`` with a DataParallel (a 1-rank
job runs the same code over a group of one, whose all-reduces return at once).

The script launches ``mpiexec -n 1`` and ``mpiexec -n 2`` jobs of itself (``--worker``)
ALTERNATELY, ``--rounds`` times, so a noisy neighbour hurts both alike; OMP_NUM_THREADS=1 for each
rank. Inside a job the bucket sizes take turns step by step (one model per bucket size, built from
the same seed). A step's time is the slowest rank's; tokens/s is from the median step.

Hidden share, from each rank's trace: the time the bucket all-reduces on the dp group spent while
the backward span was still running, over their total time. An all-reduce span runs from the moment
the communication thread starts it to its end, so it includes waiting for the other rank.
Results: benchmarks/results/data_parallel.json and benchmarks/figures/data_parallel.png.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS, FIGURE = HERE / "results" / "data_parallel.json", HERE / "figures" / "data_parallel.png"
BUCKETS_KIB = (16, 64, 256, 1024)  # 1024 KiB (the default) holds this 471 KiB model in one bucket
ROWS_PER_RANK = 16
FIELDS = ("step", "cpu", "forward", "backward", "optimizer", "all_reduce", "hidden")  # seconds per rank


def overlap(a_start, a_end, b_start, b_end):
    """Seconds that the intervals [a_start, a_end] and [b_start, b_end] share."""
    return max(0.0, min(a_end, b_end) - max(a_start, b_start))


def bucket_reduces(events, dp):
    """The all-reduces of ``dp``'s buckets in one step's events: the first ones on its group, by seq."""
    on_group = sorted((e for e in events if e.op == "all_reduce" and e.group == dp.group.name), key=lambda e: e.seq)
    reduces = on_group[:len(dp.buckets)]
    assert [e.nbytes for e in reduces] == [b.nbytes for b in dp.buckets], "one all-reduce per bucket"
    return reduces


def worker(buckets_kib, steps: int, warmup: int, out: str):
    """One MPI job: ``steps`` timed steps per bucket size, bucket sizes taking turns. Rank 0 writes,
    per bucket size and step, every rank's FIELDS: wall and CPU (process_time: this process, both
    threads) seconds of the step, its forward/backward/optimizer spans, the seconds inside bucket
    all-reduces, and how much of that time fell inside the backward span."""
    import minidist
    from minidist.parallel.data.data_parallel import DataParallel
    from minidist.parallel.mesh import DeviceMesh
    from minidist.parallel.data.sampler import DistributedSampler
    from minidist.parallel.state import WholeState
    from minidist.parallel.step import train_step
    from minidist.train.build import build_model, build_optimizer, load_data
    from minidist.train.config import TrainConfig

    from minidist.allocator import keep_freed_memory
    keep_freed_memory()  # as python -m minidist.train does
    world = minidist.init(backend="ring")
    cfg = TrainConfig(batch_size=ROWS_PER_RANK * world.size, dp=world.size)
    mesh = DeviceMesh(world, dp=cfg.dp, tp=1)
    train_tokens, _ = load_data(cfg)
    sampler = DistributedSampler(train_tokens, cfg.batch_size, cfg.block_size, cfg.seed, mesh.dp_rank, cfg.dp)
    runs = {}
    for kib in buckets_kib:
        model = build_model(cfg)
        runs[kib] = (model, DataParallel(model, mesh.dp_group, bucket_bytes=kib * 1024), build_optimizer(model, cfg))
    measured = {kib: [] for kib in buckets_kib}  # per timed step: (ranks, len(FIELDS)) seconds
    for step in range(warmup + steps):
        for kib, (model, dp, optimizer) in runs.items():
            world.barrier()
            world.trace.clear()
            start, cpu_start = time.perf_counter(), time.process_time()
            train_step(model, WholeState(model, optimizer, dp), sampler.batch(step), cfg.lr, cfg.grad_clip, mesh=mesh,
                       trace=world.trace)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            spans = {e.op: e for e in world.trace.events if e.kind == "compute"}
            backward = spans["backward"]
            reduces = bucket_reduces(world.trace.events, dp)
            mine = [seconds, cpu, spans["forward"].duration, backward.duration, spans["optimizer"].duration,
                    sum(e.duration for e in reduces),
                    sum(overlap(e.start, e.end, backward.start, backward.end) for e in reduces)]
            everyone = world.all_gather(np.array(mine)).reshape(world.size, len(FIELDS))  # (ranks, fields)
            if step >= warmup:
                measured[kib].append(everyone.tolist())
    if world.rank == 0:
        n_buckets = {kib: len(dp.buckets) for kib, (_, dp, _) in runs.items()}
        Path(out).write_text(json.dumps(dict(ranks=world.size, tokens_per_step=cfg.batch_size * cfg.block_size,
                                             n_buckets=n_buckets, measured=measured)))


def ddp_worker(steps: int, warmup: int, out: str):
    """One PyTorch DDP job (gloo, one CPU thread per rank), the same model, rows, AdamW and clipping
    as :func:`worker`, from the same initial weights and on the same batches. Rank 0 writes the
    per-step wall seconds of every rank (each step starts after a barrier)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from minidist.allocator import keep_freed_memory
    from minidist.parallel.data.sampler import DistributedSampler
    from minidist.train.build import build_model, load_data
    from minidist.train.config import TrainConfig
    sys.path.insert(0, str(HERE))
    from torch_gpt import TorchGPT

    keep_freed_memory()  # the same process setting as the minidist ranks
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    cfg = TrainConfig(batch_size=ROWS_PER_RANK * size, dp=size)
    train_tokens, _ = load_data(cfg)
    sampler = DistributedSampler(train_tokens, cfg.batch_size, cfg.block_size, cfg.seed, rank, size)
    model = DDP(TorchGPT.from_minidist(build_model(cfg), torch.float32))
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
                                   {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=cfg.lr, betas=(0.9, 0.95))
    measured = []
    for step in range(warmup + steps):
        batch = torch.from_numpy(sampler.batch(step).astype("int64"))  # (rows, T + 1)
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        loss_avg = loss.detach().clone()
        dist.all_reduce(loss_avg)  # the reported loss, averaged as minidist's train_step averages it
        seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        everyone = [torch.zeros_like(seconds) for _ in range(size)]
        dist.all_gather(everyone, seconds)
        if step >= warmup:
            measured.append([float(t) for t in everyone])
    if rank == 0:
        Path(out).write_text(json.dumps(dict(ranks=size, tokens_per_step=cfg.batch_size * cfg.block_size,
                                             measured=measured)))
    dist.barrier()  # no rank leaves while another still talks to it
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads can abort the interpreter's exit ("terminate called"): leave at once


def launch(n: int, args, framework: str = "minidist") -> dict:
    """Run a ``--worker`` job (minidist, under mpiexec) or a ``--ddp-worker`` job (PyTorch, n
    processes meeting over TCP on this machine) on ``n`` ranks and return its JSON, with the load
    average before and after. A job still running after ``args.timeout`` s is killed, whole."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "job.json"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        load_before = os.getloadavg()[0]
        if framework == "minidist":
            cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(n), sys.executable, __file__, "--worker",
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out),
                   "--buckets-kib", *map(str, args.buckets_kib)]
            procs = [subprocess.Popen(cmd, env=env, start_new_session=True)]
        else:
            cmd = [sys.executable, __file__, "--ddp-worker", "--steps", str(args.steps * len(args.buckets_kib)),
                   "--warmup", str(args.warmup), "--out", str(out)]
            port = str(free_port())
            procs = [subprocess.Popen(cmd, start_new_session=True, env=dict(
                env, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), WORLD_SIZE=str(n))) for r in range(n)]
        deadline = time.monotonic() + args.timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for proc in procs:
                os.killpg(proc.pid, signal.SIGKILL)
            raise
        if any(proc.returncode for proc in procs):
            raise RuntimeError(f"{' '.join(cmd)} exited with {[proc.returncode for proc in procs]}")
        job = json.loads(out.read_text())
    job["load_average"] = [load_before, os.getloadavg()[0]]
    job["framework"] = framework
    return job


def free_port() -> int:
    """A TCP port nobody listens on now (PyTorch's rendezvous for the DDP job)."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def summarise(jobs: list[dict], buckets_kib) -> list[dict]:
    """Per bucket size and rank count, pooled over the jobs: the median step (the slowest rank's) and
    its tokens/s; per rank the median compute spans (forward + backward + optimizer) and the share of
    a core the process got (CPU seconds / wall seconds); at 2 ranks, per rank, the median bucket
    all-reduce time under backward (hidden) and after it (exposed), their sum, and the hidden share
    of that sum. Then efficiency = tokens/s(2) / (2 tokens/s(1))."""
    field = {name: i for i, name in enumerate(FIELDS)}
    rows = []
    for kib in buckets_kib:
        row = dict(bucket_kib=kib)
        for n in (1, 2):
            mine = [job for job in jobs if job["ranks"] == n and job.get("framework", "minidist") == "minidist"]
            steps = np.array([step for job in mine for step in job["measured"][str(kib)]])  # (steps, n, fields)
            row["buckets"] = mine[0]["n_buckets"][str(kib)]
            step_s = float(np.median(steps[:, :, field["step"]].max(axis=1)))
            row[f"step_ms_{n}"] = 1e3 * step_s
            row[f"tokens_per_s_{n}"] = mine[0]["tokens_per_step"] / step_s
            compute = steps[:, :, [field["forward"], field["backward"], field["optimizer"]]].sum(axis=2)
            row[f"compute_ms_{n}"] = 1e3 * float(np.median(compute))
            row[f"core_share_{n}"] = float(np.median(steps[:, :, field["cpu"]] / steps[:, :, field["step"]]))
            if n == 2:
                hidden_s = steps[:, :, field["hidden"]]
                row["hidden_ms_2"] = 1e3 * float(np.median(hidden_s))
                row["exposed_ms_2"] = 1e3 * float(np.median(steps[:, :, field["all_reduce"]] - hidden_s))
                row["allreduce_ms_2"] = row["hidden_ms_2"] + row["exposed_ms_2"]
                row["hidden_share"] = row["hidden_ms_2"] / row["allreduce_ms_2"]
        row["efficiency"] = row["tokens_per_s_2"] / (2 * row["tokens_per_s_1"])
        rows.append(row)
    return rows


def summarise_ddp(jobs: list[dict]) -> dict | None:
    """PyTorch DDP's median step (the slowest rank's) and tokens/s at 1 and 2 ranks, pooled over its
    jobs, and its efficiency; None when no DDP job ran."""
    row = {}
    for n in (1, 2):
        steps = [max(ranks) for job in jobs if job.get("framework") == "ddp" and job["ranks"] == n
                 for ranks in job["measured"]]
        if not steps:
            return None
        tokens = next(job["tokens_per_step"] for job in jobs if job.get("framework") == "ddp" and job["ranks"] == n)
        row[f"step_ms_{n}"] = 1e3 * float(np.median(steps))
        row[f"tokens_per_s_{n}"] = tokens / float(np.median(steps))
    row["efficiency"] = row["tokens_per_s_2"] / (2 * row["tokens_per_s_1"])
    return row


def versus_ddp(result) -> str:
    """minidist (its default 1 MiB bucket) against PyTorch DDP, both at 1 and 2 ranks."""
    ours = next(r for r in result["rows"] if r["bucket_kib"] == 1024)
    ddp = result["ddp"]
    lines = ["| framework | ms/step 1 rank / 2 ranks | tok/s 1 rank / 2 ranks | efficiency |", "|---|---:|---:|---:|"]
    for name, r in (("minidist (1 MiB bucket)", ours), ("PyTorch DDP (gloo, 25 MiB bucket)", ddp)):
        lines.append(f"| {name} | {r['step_ms_1']:.1f} / {r['step_ms_2']:.1f} | "
                     f"{r['tokens_per_s_1']:,.0f} / {r['tokens_per_s_2']:,.0f} | {100 * r['efficiency']:.0f}% |")
    lines.append(f"\nminidist / DDP tokens/s on 2 ranks: {ours['tokens_per_s_2'] / ddp['tokens_per_s_2']:.2f}x "
                 f"(1 rank: {ours['tokens_per_s_1'] / ddp['tokens_per_s_1']:.2f}x)")
    return "\n".join(lines)


def table(result) -> str:
    lines = ["| bucket | buckets | ms/step 1 rank / 2 ranks | tok/s 1 rank / 2 ranks | efficiency | compute ms "
             "per rank 1 / 2 | core per rank 1 / 2 | all-reduce ms per rank | hidden under backward | exposed ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['bucket_kib']} KiB | {r['buckets']} | {r['step_ms_1']:.1f} / {r['step_ms_2']:.1f} | "
                     f"{r['tokens_per_s_1']:,.0f} / {r['tokens_per_s_2']:,.0f} | {100 * r['efficiency']:.0f}% | "
                     f"{r['compute_ms_1']:.1f} / {r['compute_ms_2']:.1f} | "
                     f"{r['core_share_1']:.2f} / {r['core_share_2']:.2f} | "
                     f"{r['allreduce_ms_2']:.2f} | {100 * r['hidden_share']:.0f}% | {r['exposed_ms_2']:.2f} |")
    return "\n".join(lines)


def plot(result) -> None:
    """Efficiency and hidden share per bucket size, side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['bucket_kib']} KiB\n({r['buckets']} bucket{'s' * (r['buckets'] > 1)})" for r in rows]
    ddp = result.get("ddp")
    fig, axes = plt.subplots(1, 3 if ddp else 2, figsize=(15 if ddp else 10, 4))
    left, right = axes[:2]
    left.bar(labels, [100 * r["efficiency"] for r in rows])
    left.axhline(85, color="k", linestyle="--", linewidth=1, label="target 85%")
    left.set_ylabel("weak-scaling efficiency, 2 ranks (%)")
    left.set_ylim(0, 110)
    left.legend(loc="lower right")
    hidden = [r["hidden_ms_2"] for r in rows]
    right.bar(labels, hidden, color="tab:green", label="under backward (hidden)")
    right.bar(labels, [r["exposed_ms_2"] for r in rows], bottom=hidden, color="tab:red", label="after backward (exposed)")
    for x, r in enumerate(rows):
        right.annotate(f"{100 * r['hidden_share']:.0f}% hidden", (x, r["allreduce_ms_2"]), ha="center", va="bottom")
    right.set_ylabel("bucket all-reduce ms per step, per rank")
    right.set_ylim(0, 1.35 * max(r["allreduce_ms_2"] for r in rows))
    right.legend(loc="upper right")
    if ddp:
        ours = next(r for r in rows if r["bucket_kib"] == 1024)
        xs = np.arange(2)
        for dx, (name, r, color) in zip((-0.2, 0.2), (("minidist (1 MiB bucket)", ours, "tab:blue"),
                                                      ("PyTorch DDP (gloo)", ddp, "tab:gray"))):
            tps = [r["tokens_per_s_1"], r["tokens_per_s_2"]]
            axes[2].bar(xs + dx, tps, width=0.4, color=color, label=name)
            for x, t in zip(xs + dx, tps):
                axes[2].annotate(f"{t / 1e3:.0f}k", (x, t), ha="center", va="bottom", fontsize=8)
        axes[2].set_xticks(xs)
        axes[2].set_xticklabels(["1 rank", "2 ranks"])
        axes[2].set_ylabel("tokens/s (median step)")
        axes[2].set_ylim(0, 1.25 * max(ours["tokens_per_s_2"], ddp["tokens_per_s_2"]))
        axes[2].legend(loc="upper left", fontsize=8)
    load = result["load_average"]
    fig.suptitle(f"Data parallelism, 1 -> 2 ranks, {ROWS_PER_RANK} x 64 tokens per rank "
                 f"(load average {min(load):.1f}-{max(load):.1f} on {os.cpu_count()} cores)")
    fig.tight_layout()
    fig.savefig(FIGURE, dpi=120)


def main():
    p = argparse.ArgumentParser(description="Data parallelism: weak scaling 1 -> 2 ranks and overlap.")
    p.add_argument("--rounds", type=int, default=5, help="alternations of a 1-rank and a 2-rank job")
    p.add_argument("--steps", type=int, default=12, help="timed steps per bucket size per job")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--buckets-kib", type=int, nargs="+", default=list(BUCKETS_KIB))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a job is killed")
    p.add_argument("--plot", action="store_true", help="table and figure from the saved JSON only")
    p.add_argument("--no-ddp", action="store_true", help="skip the PyTorch DDP jobs")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.buckets_kib, args.steps, args.warmup, args.out)
        return
    if args.ddp_worker:
        ddp_worker(args.steps, args.warmup, args.out)
        return
    if args.plot:
        result = json.loads(RESULTS.read_text())
        result["rows"] = summarise(result["jobs"], result["buckets_kib"])
        result["ddp"] = summarise_ddp(result["jobs"])
    else:
        uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        jobs = []
        has_torch = importlib.util.find_spec("torch") is not None  # benchmark-only: DDP is the yardstick
        frameworks = ("minidist", "ddp") if has_torch and not args.no_ddp else ("minidist",)
        order = [(f, n) for f in frameworks for n in (1, 2)]
        for i in range(args.rounds):
            for framework, n in (order if i % 2 == 0 else order[::-1]):  # reverse the order every round
                jobs.append(launch(n, args, framework))
                print(f"round {i + 1}/{args.rounds}: {framework} {n} rank(s) done, load average "
                      f"{jobs[-1]['load_average'][1]:.2f}", flush=True)
        result = dict(rows=summarise(jobs, args.buckets_kib), ddp=summarise_ddp(jobs), jobs=jobs,
                      buckets_kib=args.buckets_kib,
                      rows_per_rank=ROWS_PER_RANK,
                      uptime=[uptime_before, subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()],
                      load_average=[a for job in jobs for a in job["load_average"]],
                      machine=platform.machine(), cpus=os.cpu_count(), numpy=np.__version__,
                      python=platform.python_version())
        RESULTS.write_text(json.dumps(result, indent=1))
    print(table(result))
    if result.get("ddp"):
        print(versus_ddp(result))
    plot(result)


if __name__ == "__main__":
    main()
