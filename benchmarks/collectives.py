"""Benchmark the hand-written collectives against MPI's own, nccl-tests style.

    mpiexec -n 4 python benchmarks/collectives.py --json out/collectives.json --plot out/busbw.png
    mpiexec -n 2 python benchmarks/collectives.py --quick
    mpiexec -n 2 python benchmarks/collectives.py --device cuda     # GPU buffers: ring vs NCCL
    mpiexec -n 4 python benchmarks/collectives.py --collectives all_to_all --all-to-all-algorithms
    mpiexec -n 4 python benchmarks/collectives.py --algorithms --sizes 256K,512K,1M,2M,4M

``--device cuda`` puts every buffer on the GPU (CuPy) and compares backend "ring" (over MPI, staged
through pinned host memory unless MPI is CUDA-aware) with backend "nccl" (NCCL's own collectives);
"mpi" joins only when MPI is CUDA-aware. NCCL needs one GPU per rank. Each timed repeat ends by
synchronising the GPU, so kernels still queued are counted.

For each collective (all_reduce, reduce_scatter, all_gather, all_to_all) and each size (bytes of the
full, unsharded float32 buffer; for all_to_all, of each rank's input, cut into n equal chunks), the
two backends are timed ALTERNATELY within one run, each repeat starting with the next backend in
turn, so a noisy neighbour hurts both equally: backend
"ring" (minidist's algorithms over point-to-point, as ``auto`` picks them by size and world size:
for all_reduce recursive doubling, Rabenseifner's or the ring; for reduce_scatter and all_gather
recursive halving and doubling or the ring; for all_to_all, the scattered exchange for chunks under
1 MiB, else pairwise) and backend "mpi" (MPI's own MPI_Allreduce & co, MPI_Alltoall for all_to_all). A
repeat times ``iters`` back-to-back calls after a barrier; its time is the slowest rank's; the table
shows the median over repeats.

Bandwidths, as nccl-tests defines them: algbw = size / time; busbw = algbw * factor, with factor
2(n-1)/n for all-reduce and (n-1)/n for reduce-scatter, all-gather and all-to-all: the bytes each
rank must put on the wire, so busbw is comparable across world sizes and with the link's speed.

#wrong: before timing, each collective runs once on integer-valued inputs (exact in float32) in both
backends; #wrong counts elements, summed over ranks, where "ring" differs from "mpi".

``--all-to-all-algorithms`` adds two more ring groups to the all_to_all rows, one that always runs the
pairwise exchange and one that always runs the scattered one, timed alternately with the others:
the measurement behind ``alltoall.SCATTERED_BELOW_BYTES``. ``--algorithms`` likewise adds ring
groups that force recursive doubling, Rabenseifner's/halving, or the ring (``FORCED``): the
measurement behind the group's ``threshold_bytes`` and ``ring_from_bytes``.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
from mpi4py import MPI

import minidist
from minidist.comm.ops import bus_factor
from minidist.device import synchronize, to_numpy

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
STYLES = {"ring": ("o-", "ring (minidist)"), "mpi": ("s--", "mpi (MPI's own)"), "nccl": ("^--", "nccl (NCCL's own)"),
          "doubling": ("<:", "doubling forced"), "halving": (">:", "halving forced"), "ringonly": ("d:", "ring forced"),
          "pairwise": ("v:", "all_to_all pairwise (minidist)"), "scattered": ("x:", "all_to_all scattered (minidist)")}
ALL_TO_ALL_ALGORITHMS = {"pairwise": 0, "scattered": 1 << 62}
"""``--all-to-all-algorithms``: ring groups whose ``scattered_below_bytes`` forces one algorithm."""
FORCED = {"doubling": ((1 << 62, 1 << 62), ("all_reduce",)),
          "halving": ((0, 1 << 62), ("all_reduce", "reduce_scatter", "all_gather")),
          "ringonly": ((0, 0), ("all_reduce", "reduce_scatter", "all_gather"))}
"""``--algorithms``: ring groups whose (``threshold_bytes``, ``ring_from_bytes``) force one
algorithm, and the collectives where that group differs from the others. "halving" is
Rabenseifner's all-reduce, recursive halving reduce-scatter and recursive doubling all-gather
(power-of-two ranks; else the fold-in for all-reduce and the ring for the other two); "ringonly"
the ring everywhere."""


def parse_size(text: str) -> int:
    """'1K' -> 1024, '64M' -> 67108864, '4096' -> 4096."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def make_call(group, collective: str, count: int, seed: int | None, xp=np):
    """A zero-argument function running ``collective`` on ``group`` over a float32 buffer of ``count``
    elements in ``xp``'s memory (NumPy: host, CuPy: GPU), and a function returning its result.
    ``seed``: integer-valued data, else zeros."""
    n, r = group.size, group.rank
    full = (np.random.default_rng([seed, r]).integers(-8, 8, count) if seed is not None
            else np.zeros(count)).astype(np.float32)  # (count,)
    if collective == "all_reduce":
        buf = xp.asarray(full.copy())
        return (lambda: group.all_reduce(buf)), (lambda: buf)
    if collective == "reduce_scatter":
        scratch = xp.asarray(full.copy())
        out = xp.empty(np.array_split(full, n)[r].size, np.float32)  # (count/n,)
        return (lambda: group.reduce_scatter(scratch, out=out)), (lambda: out)
    if collective == "all_to_all":  # n equal chunks: count rounded down to a multiple of n
        x = xp.asarray(full[:count // n * n].copy())  # (count,)
        out = xp.empty(count // n * n, np.float32)  # (count,)
        return (lambda: group.all_to_all(x, out=out)), (lambda: out)
    shard = xp.asarray(np.ascontiguousarray(np.array_split(full, n)[r]))  # (count/n,)
    out = xp.empty(count, np.float32)  # (count,)
    return (lambda: group.all_gather(shard, count=count, out=out)), (lambda: out)


def count_wrong(groups, collective: str, count: int, xp) -> int:
    """Elements (summed over ranks and groups) where a hand-written group ("ring", and any forced
    all-to-all algorithm) and the reference backend (the last one: "mpi" on the host, "nccl" on the
    GPU) disagree."""
    results = {}
    for name, group in groups.items():
        call, result = make_call(group, collective, count, seed=count, xp=xp)
        call()
        results[name] = to_numpy(result())
    reference = list(groups)[-1]
    wrong = sum(int(np.count_nonzero(got != results[reference])) for name, got in results.items()
                if name != reference)
    return MPI.COMM_WORLD.allreduce(wrong)


def time_calls(call, iters: int, buf) -> float:
    """Seconds per call of the slowest rank, over ``iters`` calls started together (on the GPU: until
    the kernels they queued have finished)."""
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    synchronize(buf)
    return MPI.COMM_WORLD.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX)


def measure(groups, collective: str, nbytes: int, repeats: int, budget_bytes: int, xp=np) -> list[dict]:
    """One table row per backend for ``collective`` on ``nbytes``, timed alternately."""
    n = MPI.COMM_WORLD.size
    if collective != "all_to_all":  # the forced all-to-all algorithms have nothing else to show
        groups = {name: g for name, g in groups.items() if name not in ALL_TO_ALL_ALGORITHMS}
    groups = {name: g for name, g in groups.items() if name not in FORCED or collective in FORCED[name][1]}
    count = nbytes // 4
    wrong = count_wrong(groups, collective, count, xp)
    calls = {name: make_call(g, collective, count, seed=None, xp=xp) for name, g in groups.items()}
    iters = max(1, min(200, budget_bytes // nbytes))
    for call, _ in calls.values():
        call()  # warm up: workspaces, MPI connections
    times = {name: [] for name in groups}
    names = list(calls)
    for i in range(repeats):  # each repeat starts with the next group: no backend is always first or last
        for name in names[i % len(names):] + names[:i % len(names)]:
            call, result = calls[name]
            times[name].append(time_calls(call, iters, result()))
    rows = []
    for name in groups:
        seconds = statistics.median(times[name])
        algbw = nbytes / seconds / 1e9
        rows.append(dict(collective=collective, backend=name, device=xp.__name__, size=nbytes, count=count, type="float",
                         redop="none" if collective in ("all_gather", "all_to_all") else "sum", time_us=seconds * 1e6,
                         algbw=algbw, busbw=algbw * bus_factor(collective, n), wrong=wrong,
                         iters=iters, repeats=repeats))
    return rows


def format_row(row: dict) -> str:
    return (f"{row['collective']:>14} {row['backend']:>9} {row['size']:>10} {row['count']:>9} {row['type']:>6} "
            f"{row['redop']:>5} {row['time_us']:>11.1f} {row['algbw']:>7.3f} {row['busbw']:>7.3f} {row['wrong']:>6}")


HEADER = (f"{'collective':>14} {'backend':>9} {'size(B)':>10} {'count':>9} {'type':>6} {'redop':>5} "
          f"{'time(us)':>11} {'algbw':>7} {'busbw':>7} {'#wrong':>6}\n"
          f"{'':>14} {'':>9} {'':>10} {'':>9} {'':>6} {'':>5} {'':>11} {'(GB/s)':>7} {'(GB/s)':>7}")


def plot(runs: list[tuple[int, list[dict]]], path: str) -> None:
    """busbw against size: one row of panels per run (world size), one panel per collective measured,
    one line per backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shown = [c for c in COLLECTIVES if any(r["collective"] == c for _, rows in runs for r in rows)]
    fig, axes = plt.subplots(len(runs), len(shown), figsize=(5 * len(shown), 3.6 * len(runs)), squeeze=False)
    for (n, rows), row_axes in zip(runs, axes):
        for ax, collective in zip(row_axes, shown):
            for backend, (style, label) in STYLES.items():
                pts = [(r["size"], r["busbw"]) for r in rows
                       if r["collective"] == collective and r["backend"] == backend]
                if pts:
                    ax.plot(*zip(*pts), style, label=label)
            on = " (GPU buffers)" if rows and rows[0].get("device") == "cupy" else ""
            ax.set(xscale="log", title=f"{collective}, {n} ranks{on}", xlabel="size (bytes, float32)",
                   ylabel="busbw (GB/s)")
            ax.grid(True, which="both", alpha=0.3)
    for ax in axes[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def size_label(size: int) -> str:
    return f"{size // 2**20} MiB" if size >= 2**20 else f"{size // 2**10} KiB"


def markdown(runs: list[tuple[int, list[dict]]]) -> str:
    """The ring against the reference backend (MPI's own on the host, NCCL on the GPU), one Markdown
    table per (collective, world size): the tables of benchmarks/RESULTS.md. ``ring / ref`` is the
    busbw ratio: above 1 the hand-written ring is faster."""
    out = []
    for n, rows in runs:
        ref = "nccl" if any(r["backend"] == "nccl" for r in rows) else "mpi"
        for collective in COLLECTIVES:
            by = {(r["backend"], r["size"]): r for r in rows if r["collective"] == collective}
            sizes = sorted({size for _, size in by})
            if not sizes:
                continue
            out += [f"### {collective}, {n} ranks", "",
                    f"| size | ring time (us) | {ref} time (us) | ring busbw (GB/s) | {ref} busbw (GB/s) | "
                    f"ring / {ref} | #wrong |",
                    "|---:|---:|---:|---:|---:|---:|---:|"]
            for size in sizes:
                ring, other = by[("ring", size)], by[(ref, size)]
                out.append(f"| {size_label(size)} | {ring['time_us']:.1f} | {other['time_us']:.1f} | "
                           f"{ring['busbw']:.3f} | {other['busbw']:.3f} | {ring['busbw'] / other['busbw']:.2f} | "
                           f"{ring['wrong'] + other['wrong']} |")
            out.append("")
            forced = [name for name in FORCED if (name, sizes[0]) in by]
            if forced:
                out += [f"### {collective} algorithms, {n} ranks (time, us)", "",
                        "| size | " + " | ".join(f"{name} forced" for name in forced) + f" | auto | {ref} |",
                        "|---:|" + "---:|" * (len(forced) + 2)]
                for size in sizes:
                    times = [by[(name, size)]["time_us"] for name in (*forced, "ring", ref)]
                    out.append(f"| {size_label(size)} | " + " | ".join(f"{t:.1f}" for t in times) + " |")
                out.append("")
            if any((name, sizes[0]) in by for name in ALL_TO_ALL_ALGORITHMS):
                out += [f"### {collective} algorithms, {n} ranks", "",
                        f"| size | pairwise (us) | scattered (us) | auto (us) | {ref} (us) | scattered / pairwise |",
                        "|---:|---:|---:|---:|---:|---:|"]
                for size in sizes:
                    pw, sc = by[("pairwise", size)]["time_us"], by[("scattered", size)]["time_us"]
                    out.append(f"| {size_label(size)} | {pw:.1f} | {sc:.1f} | {by[('ring', size)]['time_us']:.1f} | "
                               f"{by[(ref, size)]['time_us']:.1f} | {sc / pw:.2f} |")
                out.append("")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min-bytes", default="1K", help="smallest buffer (default 1K)")
    p.add_argument("--max-bytes", default="64M", help="largest buffer (default 64M)")
    p.add_argument("--factor", type=int, default=4, help="size step multiplier (default 4)")
    p.add_argument("--sizes", help="comma-separated sizes, e.g. 256K,512K,1M (instead of min/max/factor)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per size; the median is kept")
    p.add_argument("--budget", default="64M", help="bytes moved per repeat: iters = budget / size, 1..200")
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("--segment-bytes", help="the ring's segment size (default: the library's)")
    p.add_argument("--threshold-bytes", help="all-reduce size from which recursive doubling gives way "
                                             "(default: the library's)")
    p.add_argument("--ring-from-bytes", help="size from which the ring replaces Rabenseifner's all-reduce "
                                             "and recursive halving/doubling (default: the library's)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the buffers live: host memory (ring vs MPI's own) or the GPU (ring vs NCCL)")
    p.add_argument("--all-to-all-algorithms", action="store_true",
                   help="also time all_to_all's pairwise and scattered exchanges, each forced")
    p.add_argument("--algorithms", action="store_true",
                   help="also time each hand-written algorithm forced (doubling, halving, ring) next to 'auto'")
    p.add_argument("--quick", action="store_true", help="smoke test: 1K..64K, 2 repeats, small budget")
    p.add_argument("--json", help="write the rows and the machine description to this JSON file")
    p.add_argument("--plot", help="write a PNG of busbw against size to this path")
    p.add_argument("--from", dest="sources", nargs="+", metavar="JSON",
                   help="measure nothing: plot these --json results (e.g. 2 and 4 ranks) into --plot")
    p.add_argument("--markdown", action="store_true", help="with --from: print the RESULTS.md tables")
    args = p.parse_args()
    if args.sources:
        runs = []
        for source in args.sources:
            with open(source) as f:
                result = json.load(f)
            runs.append((result["machine"]["ranks"], result["rows"]))
        if args.plot:
            plot(runs, args.plot)
        if args.markdown:
            print(markdown(runs))
        return
    if args.quick:
        args.max_bytes, args.repeats, args.budget = "64K", 2, "1M"

    def group(backend):
        return minidist.init(backend=backend, timeout=120.0, trace=False)
    xp = np
    if args.device == "cuda":
        import cupy as xp
        nccl = group("nccl")  # first: it picks this rank's GPU
        groups = {"ring": group("ring")}
        if groups["ring"].transport.cuda_aware:
            groups["mpi"] = group("mpi")
        groups["nccl"] = nccl  # last: the reference the ring is checked against
    else:
        groups = {"ring": group("ring"), "mpi": group("mpi")}
    if args.all_to_all_algorithms:  # before the reference, which stays last
        forced = {name: group("ring") for name in ALL_TO_ALL_ALGORITHMS}
        for name, g in forced.items():
            g.scattered_below_bytes = ALL_TO_ALL_ALGORITHMS[name]
        *others, reference = groups
        groups = {**{name: groups[name] for name in others}, **forced, reference: groups[reference]}
    if args.algorithms:  # before the reference, which stays last
        *others, reference = groups
        forced = {name: group("ring") for name in FORCED}
        for name, g in forced.items():
            g.threshold_bytes, g.ring_from_bytes = FORCED[name][0]
        groups = {**{name: groups[name] for name in others}, **forced, reference: groups[reference]}
    if args.segment_bytes:
        groups["ring"].segment_bytes = parse_size(args.segment_bytes)
    if args.threshold_bytes:
        groups["ring"].threshold_bytes = parse_size(args.threshold_bytes)
    if args.ring_from_bytes:
        groups["ring"].ring_from_bytes = parse_size(args.ring_from_bytes)
    n, rank = MPI.COMM_WORLD.size, MPI.COMM_WORLD.rank
    sizes, size = [], parse_size(args.min_bytes)
    while size <= parse_size(args.max_bytes):
        sizes.append(size)
        size *= args.factor
    if args.sizes:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    machine = dict(ranks=n, host=platform.node(), cpu=platform.processor() or platform.machine(),
                   python=platform.python_version(), numpy=np.__version__,
                   mpi=MPI.Get_library_version().splitlines()[0].strip(), device=args.device)
    if args.device == "cuda":
        machine["gpu"] = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)["name"].decode()
        machine["cuda_aware_mpi"] = groups["ring"].transport.cuda_aware
    machine["ring_segment_bytes"] = groups["ring"].segment_bytes
    machine["doubling_below_bytes"] = groups["ring"].threshold_bytes
    machine["ring_from_bytes"] = groups["ring"].ring_from_bytes
    if rank == 0:
        print(f"# {n} ranks, {machine['mpi']}, numpy {machine['numpy']}, python {machine['python']}, "
              f"ring segment {machine['ring_segment_bytes']} B, buffers on {machine.get('gpu', 'the host')}")
        print(HEADER, flush=True)
    rows = []
    for collective in args.collectives.split(","):
        for size in sizes:
            for row in measure(groups, collective, size, args.repeats, parse_size(args.budget), xp):
                rows.append(row)
                if rank == 0:
                    print(format_row(row), flush=True)
    if rank == 0:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(machine=machine, args=vars(args), rows=rows), f, indent=1)
        if args.plot:
            plot([(n, rows)], args.plot)
    if any(r["wrong"] for r in rows):
        raise SystemExit("some results differ between backends (#wrong > 0)")


if __name__ == "__main__":
    main()
