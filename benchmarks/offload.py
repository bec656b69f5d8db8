"""ZeRO-Offload and ZeRO-Infinity benchmark: what offloading ZeRO's shards saves in memory and costs in time.

    python benchmarks/offload.py                  (about 3 minutes on 2 idle cores)
    python benchmarks/offload.py --quick          (a tiny model, a smoke run; its files go to $TMPDIR)

One process per configuration (a subprocess, so its peak RSS is its own), one rank (dp = 1: ZeRO's
stage still applies with a group of one, and the offload code path is the same), built as
``python -m minidist.train`` builds it (``minidist.train.build.build_parallel``) and stepped with
``minidist.parallel.step.train_step``. Model: an 8-layer, 256-wide GPT (T = 64, batch 4, AdamW, grad
clip 1), in float32 and in bfloat16 mixed precision (emulated: 4-byte storage, float32 masters and
moments). Configurations, per dtype:

    ZeRO-1                         no offload
    ZeRO-1 + opt (host)            --offload optimizer                        (ZeRO-Offload)
    ZeRO-1 + opt (disk)            --offload optimizer --offload-dir DIR      (ZeRO-Infinity, optimizer)
    ZeRO-3                         no offload
    ZeRO-3 + opt,params (host)     --offload optimizer,params
    ZeRO-3 + opt,params (disk)     --offload optimizer,params --offload-dir DIR

Each configuration runs ``--rounds`` times (default 3), interleaved: every round runs every
configuration once, in the order above, so load on the machine hits all alike; medians over rounds.
Per configuration:
  step time     median over the steps after the first two (each step timed around train_step);
                ratio against the no-offload configuration of the same stage and dtype.
  peak RSS      ``VmHWM`` of the subprocess, run with MALLOC_MMAP_THRESHOLD_=131072 (as
                tests/test_offload.py: otherwise glibc keeps freed temporaries resident) and
                OMP_NUM_THREADS=1; also its RSS after imports, before the model is built.
  bytes         zero_memory.formula(zero): parameters + gradients + optimizer (the device), host, disk.
  moved         Offload.moved after the last step: down (gradient shards, device -> host), up
                (parameter shards, host -> device), read and write (disk). On this CPU machine the
                device and the host are both host memory: down / up are memcpys counted as what
                would cross PCIe.
  disk rate     for the disk configurations: (read + write) bytes per step / (step time on disk -
                step time in host memory). An effective rate of the offload path (msync writes,
                page faults on reads), not a device benchmark.
  RSS fall      RSS(host offload) - RSS(disk offload) against the bytes stored on disk: they should be
                close, less about one unit's state, resident while it is updated.
The disk itself is measured once in the same run, in the same temporary folder: a 256 MiB file
written with fsync (write: a new file, then rewritten in place, as the offload files are), dropped from the page cache with posix_fadvise(DONTNEED) and read back
(read, cold), and read again (read, warm: the page cache).

Writes benchmarks/results/offload.json and benchmarks/figures/offload.png (--quick: the same names
under $TMPDIR/minidist-offload-quick/), and prints a markdown section for benchmarks/RESULTS.md.
"""
import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MiB = 2**20

FULL = dict(n_layer=8, n_embd=256, n_head=4, block_size=64, batch_size=4, steps=7, disk_mib=256)
QUICK = dict(n_layer=2, n_embd=64, n_head=4, block_size=32, batch_size=2, steps=4, disk_mib=16)
SKIP = 2  # steps before the timed ones (first touches, page faults)

# name -> (ZeRO stage, --offload, on disk)
CONFIGS = {
    "ZeRO-1": (1, "none", False),
    "ZeRO-1 + opt (host)": (1, "optimizer", False),
    "ZeRO-1 + opt (disk)": (1, "optimizer", True),
    "ZeRO-3": (3, "none", False),
    "ZeRO-3 + opt,params (host)": (3, "optimizer,params", False),
    "ZeRO-3 + opt,params (disk)": (3, "optimizer,params", True),
}
DTYPES = ("float32", "bfloat16")


# ---- one configuration, in its own process -----------------------------------------------------------

def vm_rss(field: str = "VmRSS") -> int:
    """This process's resident set now (``VmRSS``), or its peak (``VmHWM``), in bytes, from
    /proc/self/status. The peak is this process image's own: ``ru_maxrss`` is not, as Linux carries
    the parent's peak into a child started by vfork + exec (Python's subprocess)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def worker(spec: dict) -> dict:
    """Build and train ``spec``'s configuration for spec["steps"] steps; what it measured."""
    from minidist.data import get_batch
    from minidist.inspect import zero_memory
    from minidist.parallel.mesh import DeviceMesh
    from minidist.parallel.step import train_step
    from minidist.train.build import build_parallel, world_of_one
    from minidist.train.config import TrainConfig, check_config

    rss_imports = vm_rss()
    cfg = TrainConfig(n_layer=spec["n_layer"], n_embd=spec["n_embd"], n_head=spec["n_head"],
                      block_size=spec["block_size"], batch_size=spec["batch_size"], dtype=spec["dtype"],
                      optimizer="adamw", lr=1e-3, zero=spec["zero"], offload=spec["offload"],
                      offload_dir=spec["offload_dir"], sample_tokens=0)
    check_config(cfg, 1)
    world = world_of_one()
    mesh = DeviceMesh(world, dp=1)
    model, state, engine = build_parallel(cfg, mesh)
    tokens = np.random.default_rng(0).integers(0, 256, size=100_000)
    seconds, losses = [], []
    for step in range(spec["steps"]):
        batch = get_batch(tokens, step, cfg.batch_size, cfg.block_size)  # (B, T+1)
        t0 = time.perf_counter()
        loss, _ = train_step(model, state, batch, cfg.lr, cfg.grad_clip, engine=engine, mesh=mesh)
        seconds.append(time.perf_counter() - t0)
        losses.append(loss)
    out = dict(seconds=seconds, losses=losses, rss_imports=rss_imports,
               peak_rss=vm_rss("VmHWM"),
               formula={k: float(v) for k, v in zero_memory.formula(state).items()},
               measured={k: int(v) for k, v in zero_memory.model_state_bytes(state).items()},
               moved=dict(state.offload.moved) if state.offload is not None else {},
               numel=int(sum(s.unit.numel for s in state.shards)),
               largest_unit_stored=max([sum(a.nbytes for a in s.stored) for s in state.shards] + [0]))
    state.close()  # offload: its files go
    return out


def run_config(spec: dict) -> dict:
    """``worker(spec)`` in a fresh Python process (its own peak RSS)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['name']} ({spec['dtype']}) failed:\n{proc.stderr}")
    return json.loads(proc.stdout.splitlines()[-1])


# ---- the disk itself ----------------------------------------------------------------------------------

def disk_bandwidth(folder: Path, mib: int) -> dict:
    """Bytes/s: write ``mib`` MiB with fsync (a new file, then the same file again in place), read it back cold (dropped from the page cache with
    posix_fadvise DONTNEED) and warm (again, from the page cache)."""
    path = folder / "bandwidth.bin"
    chunk = np.random.default_rng(1).integers(0, 256, size=8 * MiB, dtype=np.uint8).tobytes()
    n_chunks = max(1, mib // 8)
    nbytes = n_chunks * len(chunk)

    def write_all(flags) -> float:
        fd = os.open(path, flags, 0o600)
        try:
            t0 = time.perf_counter()
            for _ in range(n_chunks):
                os.write(fd, chunk)
            os.fsync(fd)
            return time.perf_counter() - t0
        finally:
            os.close(fd)

    write = write_all(os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # a new file: its blocks are allocated too
    rewrite = write_all(os.O_WRONLY)  # the same blocks again, as the offload files are each step
    buf = bytearray(len(chunk))

    def read_all(drop: bool) -> float:
        fd = os.open(path, os.O_RDONLY)
        try:
            if drop:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            got = 0
            while True:
                n = os.readv(fd, [buf])
                if n == 0:
                    break
                got += n
            seconds = time.perf_counter() - t0
        finally:
            os.close(fd)
        assert got == nbytes, (got, nbytes)
        return seconds

    cold = read_all(drop=True)
    warm = read_all(drop=False)
    path.unlink()
    return dict(bytes=nbytes, write_fsync=nbytes / write, rewrite_fsync=nbytes / rewrite, read_cold=nbytes / cold,
                read_warm=nbytes / warm)


# ---- the run --------------------------------------------------------------------------------------------

def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def summarise(raw: dict, sizes: dict) -> list[dict]:
    """One row per (dtype, configuration): medians over the rounds, ratios, disk rate, RSS fall."""
    rows = []
    for dtype in DTYPES:
        for name, (stage, offload, disk) in CONFIGS.items():
            runs = raw[(dtype, name)]
            step_s = [float(np.median(r["seconds"][SKIP:])) for r in runs]
            rows.append(dict(dtype=dtype, config=name, zero=stage, offload=offload, disk=disk,
                             step_ms=1e3 * float(np.median(step_s)), step_ms_rounds=[1e3 * s for s in step_s],
                             peak_rss=int(np.median([r["peak_rss"] for r in runs])),
                             peak_rss_rounds=[r["peak_rss"] for r in runs],
                             rss_imports=int(np.median([r["rss_imports"] for r in runs])),
                             formula=runs[0]["formula"], measured_after_step=runs[0]["measured"],
                             device=sum(runs[0]["formula"][k] for k in ("parameters", "gradients", "optimizer")),
                             host=runs[0]["formula"].get("host", 0.0), disk_bytes=runs[0]["formula"].get("disk", 0.0),
                             moved={k: runs[0]["moved"].get(k, 0) for k in ("down", "up", "read", "write")},
                             numel=runs[0]["numel"], largest_unit_stored=runs[0]["largest_unit_stored"],
                             final_loss=runs[0]["losses"][-1]))
    by = {(r["dtype"], r["config"]): r for r in rows}
    for r in rows:
        base = by[(r["dtype"], f"ZeRO-{r['zero']}")]
        r["ratio_to_no_offload"] = r["step_ms"] / base["step_ms"]
        r["same_losses_as_no_offload"] = raw[(r["dtype"], r["config"])][0]["losses"] == \
            raw[(r["dtype"], base["config"])][0]["losses"]
        if r["disk"]:
            host = by[(r["dtype"], r["config"].replace("(disk)", "(host)"))]
            extra_s = (r["step_ms"] - host["step_ms"]) / 1e3
            moved = r["moved"]["read"] + r["moved"]["write"]
            r["extra_ms_vs_host"] = 1e3 * extra_s
            r["disk_rate"] = moved / extra_s if extra_s > 0 else None
            r["rss_fall"] = host["peak_rss"] - r["peak_rss"]
    return rows


def mib(n) -> str:
    return f"{n / MiB:,.1f}"


def markdown(meta: dict, rows: list[dict], disk: dict) -> str:
    s = meta["sizes"]
    p = ["## ZeRO-Offload and ZeRO-Infinity", "",
         f"`{meta['command']}` ({meta['wall_s']:.0f} s wall) → `{meta['json']}`, figure "
         f"`{meta['png']}`. Machine: {meta['cpu']}, {meta['cores']} cores (`os.cpu_count()`), "
         f"load average (1 min) {meta['load_start'][0]:.2f} at the start and {meta['load_end'][0]:.2f} at the end "
         f"(5 min: {meta['load_start'][1]:.2f} / {meta['load_end'][1]:.2f}); Python {meta['python']}, "
         f"NumPy {meta['numpy']}; OMP_NUM_THREADS=1, MALLOC_MMAP_THRESHOLD_=131072. Offload files and the disk "
         f"test in `{meta['tmp_parent']}` ({meta['fs']}).", "",
         f"GPT: {s['n_layer']} layers, {s['n_embd']} wide ({rows[0]['numel']:,} parameters), T = {s['block_size']}, "
         f"batch {s['batch_size']}, AdamW, one rank (dp = 1), built and stepped as `python -m minidist.train` does; "
         f"float32, and bfloat16 mixed precision (emulated: 4-byte storage, float32 masters and moments). One "
         f"subprocess per configuration, {meta['rounds']} interleaved round(s) (every configuration once per round), "
         f"{s['steps']} steps each; step time = median over steps {SKIP + 1}-{s['steps']} of a run, then median over "
         f"rounds; peak RSS = `VmHWM` (not `ru_maxrss`, which a subprocess inherits from its parent's peak), median over rounds. Device / host / disk are `ZeroOptimizer.formula()`'s "
         f"bytes (device = P + G + O); moved = `Offload.moved` in one step (on this CPU, down / up are memcpys "
         f"standing for PCIe copies).", "",
         "### Memory and bytes moved per step (MiB)", "",
         "| dtype | configuration | device | host | disk | peak RSS | down | up | disk read | disk write |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["moved"]
        p.append(f"| {r['dtype']} | {r['config']} | {mib(r['device'])} | {mib(r['host'])} | {mib(r['disk_bytes'])} | "
                 f"{mib(r['peak_rss'])} | {mib(m['down'])} | {mib(m['up'])} | {mib(m['read'])} | {mib(m['write'])} |")
    p += ["", "### Step time", "",
          "| dtype | configuration | ms / step | / no offload (same stage) | extra vs host (ms) | "
          "(read + write) / extra time (MB/s) |", "|---|---|---|---|---|---|"]
    for r in rows:
        extra = f"{r['extra_ms_vs_host']:+.0f}" if r["disk"] else "-"
        rate = ("-" if not r["disk"] else "n/a (not slower)" if r["disk_rate"] is None
                else f"{r['disk_rate'] / 1e6:,.0f}")
        p.append(f"| {r['dtype']} | {r['config']} | {r['step_ms']:.0f} | {r['ratio_to_no_offload']:.2f} | {extra} | "
                 f"{rate} |")
    p += ["", f"The disk itself, same folder, {disk['bytes'] // MiB} MiB file: write + fsync "
          f"{disk['write_fsync'] / 1e6:,.0f} MB/s (a new file), {disk['rewrite_fsync'] / 1e6:,.0f} MB/s (rewritten in "
          f"place, as the offload files are every step), read after `posix_fadvise(DONTNEED)` (cold) "
          f"{disk['read_cold'] / 1e6:,.0f} MB/s, read again (warm, page cache) {disk['read_warm'] / 1e6:,.0f} MB/s.", "",
          "### RSS fall against the bytes moved to disk", "",
          "| dtype | configuration | peak RSS, host offload | peak RSS, disk offload | fall | on disk (formula) | "
          "on disk - fall | largest unit's stored state | fall / on disk |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["disk"]:
            host = next(h for h in rows if h["dtype"] == r["dtype"] and h["config"] == r["config"].replace("(disk)", "(host)"))
            p.append(f"| {r['dtype']} | {r['config']} | {mib(host['peak_rss'])} | {mib(r['peak_rss'])} | "
                     f"{mib(r['rss_fall'])} | {mib(r['disk_bytes'])} | {mib(r['disk_bytes'] - r['rss_fall'])} | "
                     f"{mib(r['largest_unit_stored'])} | {r['rss_fall'] / r['disk_bytes']:.2f} |")
    p += ["", reading(meta, rows, disk)]
    return "\n".join(p)


def reading(meta: dict, rows: list[dict], disk: dict) -> str:
    """Plain sentences about the numbers, written from them."""
    by = {(r["dtype"], r["config"]): r for r in rows}
    f1, f1h, f1d = (by[("float32", c)] for c in ("ZeRO-1", "ZeRO-1 + opt (host)", "ZeRO-1 + opt (disk)"))
    f3, f3h, f3d = (by[("float32", c)] for c in ("ZeRO-3", "ZeRO-3 + opt,params (host)", "ZeRO-3 + opt,params (disk)"))
    hosts = [r for r in rows if r["offload"] != "none" and not r["disk"]]
    disks = [r for r in rows if r["disk"]]
    rss_host = [(r["peak_rss"] - by[(r["dtype"], f"ZeRO-{r['zero']}")]["peak_rss"]) / MiB for r in hosts]
    falls = [r["rss_fall"] / r["disk_bytes"] for r in disks]
    gaps = [abs(r["disk_bytes"] - r["rss_fall"]) / MiB for r in disks]
    unit = min(r["largest_unit_stored"] for r in disks)
    ratios_host = [r["ratio_to_no_offload"] for r in hosts]
    ratios_disk = [r["ratio_to_no_offload"] for r in disks]
    rates = [r["disk_rate"] / 1e6 for r in disks if r["disk_rate"] is not None]
    span = lambda v, f: f"{min(v):{f}} to {max(v):{f}}" if len(v) > 1 and min(v) != max(v) else f"{v[0]:{f}}"  # noqa: E731
    same = all(r["same_losses_as_no_offload"] for r in rows)
    loads = [meta["load_start"][0], meta["load_end"][0]] + [x[0] for x in meta["load_after_each_round"]]
    s = [f"The formula's device bytes fall as the papers say (float32 ZeRO-1 {mib(f1['device'])} → "
         f"{mib(f1h['device'])} MiB with the optimizer offloaded; ZeRO-3 {mib(f3['device'])} → {mib(f3h['device'])} "
         f"MiB with its parameters too, only the gradients left), but on this CPU-only machine the device IS host "
         f"memory: host offload moves bytes without shrinking the process (peak RSS {span(rss_host, '+.1f')} MiB "
         f"against no offload: the same state in another place, plus the host's gradient buffer, and in float32 "
         f"the master copy of the parameter shard).",
         f"Files are what this machine can see: peak RSS falls by {span(falls, '.2f')}x the bytes on disk, " +
         (f"to within {max(gaps):.1f} MiB, less than one unit's stored state ({mib(unit)} MiB): the process's peak "
          f"comes outside the update (presumably in forward / backward, with the activations alive), when little "
          f"or none of the store is resident." if max(gaps) < 0.5 * unit / MiB else
          "far from it: at these sizes the process's peak is set elsewhere (the imports), not by the model states."
          if min(falls) < 0.5 else
          f"the rest ({span(gaps, '.1f')} MiB) being about one unit's state ({mib(unit)} MiB), resident while "
          f"it is read ahead and updated."),
         f"Step time with host offload is {span(ratios_host, '.2f')}x no offload (the same update, plus the down / "
         f"up memcpys" + ("; ratios below 1 are the load's noise" if min(ratios_host) < 1 else "") +
         f"), with the disk {span(ratios_disk, '.2f')}x: each step msyncs the whole store "
         f"({mib(f1d['moved']['write'])} MiB for float32 ZeRO-1, {mib(f3d['moved']['write'])} MiB for ZeRO-3 with "
         f"parameters) and faults it back in.",
         (f"The (read + write) / extra time column ({span(rates, ',.0f')} MB/s) is an effective rate of that path, "
          if rates else "The (read + write) / extra time column is an effective rate of that path, ") +
         f"not the disk's: with {meta['mem_gib']:.0f} GiB of RAM the kernel's page cache keeps the files just "
         f"written, so the reads are page faults on cached pages (the disk test: {disk['read_warm'] / 1e6:,.0f} MB/s "
         f"warm, {disk['read_cold'] / 1e6:,.0f} MB/s cold, which on a VM may still be the host's cache; write + "
         f"fsync {disk['write_fsync'] / 1e6:,.0f} MB/s to a new file, {disk['rewrite_fsync'] / 1e6:,.0f} MB/s in "
         f"place); on a machine whose RAM cannot hold the files they would "
         f"come from the disk.",
         f"The load average ran {min(loads):.1f}-{max(loads):.1f} on {meta['cores']} cores during the run" +
         (", so the times carry that noise; the bytes are exact. " if max(loads) > 1.25
          else ": the benchmark's own process, the machine otherwise idle. ") +
         ("Every offloaded run's losses equal its no-offload run's exactly." if same
          else "NOTE: some offloaded run's losses differ from its no-offload run's (see the JSON).")]
    return " ".join(s)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(CONFIGS)
    labels = [n.replace(" + ", "\n+ ").replace(" (", "\n(") for n in names]
    x = np.arange(len(names))
    by = {(r["dtype"], r["config"]): r for r in rows}
    colors = {"float32": "tab:blue", "bfloat16": "tab:orange"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 5.4), gridspec_kw={"width_ratios": [1, 1]})
    w = 0.2
    for i, dtype in enumerate(DTYPES):
        rss = [by[(dtype, n)]["peak_rss"] / MiB for n in names]
        dev = [by[(dtype, n)]["device"] / MiB for n in names]
        left.bar(x + (i - 1.5) * w, rss, w, color=colors[dtype], label=f"peak RSS, {dtype}")
        left.bar(x + (i + 0.5) * w, dev, w, color=colors[dtype], alpha=0.45, hatch="//", edgecolor="white",
                 label=f"device bytes (formula), {dtype}")
    left.set_xticks(x, labels, fontsize=8)
    left.set_ylabel("MiB")
    left.set_ylim(0, 1.3 * max(r["peak_rss"] for r in rows) / MiB)
    left.set_title("Peak RSS of the process and device model-state bytes")
    left.legend(loc="upper center", ncol=2, fontsize=8.5, frameon=False)
    w = 0.35
    for i, dtype in enumerate(DTYPES):
        ratio = [by[(dtype, n)]["ratio_to_no_offload"] for n in names]
        bars = right.bar(x + (i - 0.5) * w, ratio, w, color=colors[dtype], label=dtype)
        right.bar_label(bars, fmt="%.2f", fontsize=7.5, padding=1)
    right.axhline(1.0, color="grey", lw=0.8, ls="--")
    right.set_xticks(x, labels, fontsize=8)
    right.set_ylabel("step time / no offload (same stage)")
    right.set_ylim(0, 1.25 * max(r["ratio_to_no_offload"] for r in rows))
    right.set_title("Step time relative to no offload")
    right.legend(loc="upper left", fontsize=8.5, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def filesystem(folder: Path) -> str:
    """The mount holding ``folder`` and its type (/proc/mounts, longest prefix)."""
    best = ("?", "?")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mount, kind = line.split()[:3]
            if str(folder.resolve()).startswith(mount) and len(mount) >= len(best[0]):
                best = (mount, f"{kind} on {dev}")
    except OSError:
        pass
    return f"{best[1]}, mounted at {best[0]}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default %(default)s)")
    ap.add_argument("--quick", action="store_true", help="tiny model, short runs: a smoke test")
    ap.add_argument("--tmp", default=None, help="folder for the offload files and the disk test (default: the "
                    "system's temporary folder)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    sizes = QUICK if args.quick else FULL
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="minidist-offload-", dir=args.tmp))
    raw = {(d, n): [] for d in DTYPES for n in CONFIGS}
    loads = []
    try:
        disk = disk_bandwidth(tmp, sizes["disk_mib"])
        print(f"disk: write+fsync {disk['write_fsync'] / 1e6:,.0f} MB/s new, {disk['rewrite_fsync'] / 1e6:,.0f} "
              f"MB/s in place, read cold {disk['read_cold'] / 1e6:,.0f} "
              f"MB/s, warm {disk['read_warm'] / 1e6:,.0f} MB/s", flush=True)
        for rnd in range(args.rounds):
            for dtype in DTYPES:
                for name, (stage, offload, on_disk) in CONFIGS.items():
                    spec = dict(sizes, name=name, dtype=dtype, zero=stage, offload=offload,
                                offload_dir=str(tmp / f"r{rnd}-{dtype}-z{stage}") if on_disk else None)
                    result = run_config(spec)
                    raw[(dtype, name)].append(result)
                    print(f"round {rnd + 1}/{args.rounds} {dtype:>8} {name:<27} "
                          f"{1e3 * np.median(result['seconds'][SKIP:]):7.0f} ms/step  "
                          f"peak RSS {result['peak_rss'] / MiB:7.1f} MiB", flush=True)
            loads.append(os.getloadavg())
        leftover = [str(p.relative_to(tmp)) for p in tmp.rglob("*.bin")]
        assert not leftover, f"offload files left behind: {leftover}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    load_end = os.getloadavg()
    rows = summarise(raw, sizes)
    meta = dict(command="python benchmarks/offload.py" + "".join(f" {a}" for a in sys.argv[1:]),
                wall_s=time.perf_counter() - t_start, cpu=cpu_model(), cores=os.cpu_count(),
                load_start=list(load_start), load_end=list(load_end), load_after_each_round=[list(x) for x in loads],
                python=platform.python_version(), numpy=np.__version__, rounds=args.rounds, sizes=sizes,
                skip_steps=SKIP, tmp_parent=str(tmp.parent), fs=filesystem(tmp.parent), quick=args.quick,
                mem_gib=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    # --quick leaves the repository's results alone: its files go to the temporary folder's parent
    out = Path(tempfile.gettempdir()) / "minidist-offload-quick" if args.quick else HERE
    shown = (lambda p: str(p)) if args.quick else (lambda p: str(p.relative_to(ROOT)))  # noqa: E731
    meta.update(json=shown(out / "results" / "offload.json"), png=shown(out / "figures" / "offload.png"))
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "results" / "offload.json").write_text(json.dumps(dict(meta=meta, disk=disk, rows=rows), indent=1))
    plot(rows, out / "figures" / "offload.png")
    print(f"\nwrote {out / 'results' / 'offload.json'} and {out / 'figures' / 'offload.png'}\n")
    print(markdown(meta, rows, disk))


if __name__ == "__main__":
    main()
