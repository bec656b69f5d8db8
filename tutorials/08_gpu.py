"""Lesson 8: the same collectives on GPU memory, staged through the host or handed to NCCL.

    mpiexec -n 2 python tutorials/08_gpu.py                 # needs CuPy and an NVIDIA GPU (pip install -e ".[gpu]")
    mpiexec -n 2 python tutorials/08_gpu.py --png gpu.png   # also draw the times of part 2

A CuPy array goes into ``group.all_reduce`` exactly like a NumPy one. What happens underneath
depends on who can touch GPU memory:

- backend "ring" over a CUDA-aware MPI: MPI reads and writes the GPU buffers itself; minidist only
  synchronises the stream first, so the kernels that produce a buffer are done before it is sent.
- backend "ring" over an MPI that is not CUDA-aware (the pip ``mpich`` wheel): every message is
  staged. Before a send, the segment is copied GPU -> pinned (page-locked) host memory; after a
  receive, pinned host -> GPU. The reduction itself still runs on the GPU (``cupy.add``).
- backend "nccl": NCCL's own kernels move and reduce the bytes GPU to GPU; one GPU per rank.

The lesson prints which case this machine is in, times an all-reduce on host buffers, on staged GPU
buffers and (with one GPU per rank) through NCCL, and checks every result against NumPy. What to
expect: small messages cost the staged ring MORE than the host ring (two copies and a stream
synchronisation per ring step, on top of MPI's latency); large ones are bound by
bandwidth, where NCCL (GPU to GPU, no host copy) wins by far.

Where the lessons run: every lesson but this one runs on CPU ranks, processes under mpiexec or
threads in one process, NumPy buffers, no GPU. This one needs CuPy and an NVIDIA GPU on every rank:
its host-ring column is only the baseline of its GPU columns. Without CuPy or a GPU it says so once
(rank 0) and stops with exit status 0, drawing nothing. Its picture (a GPU run): one group of bars
per size, host ring, GPU ring and NCCL (where it ran) side by side on a log time axis, each labelled
with its ms, the title naming the GPU (on the tests' CuPy double: "fake GPU", and the picture says
its times mean nothing).
"""
import argparse
import time
from pathlib import Path

import numpy as np

import minidist
from minidist.device import gpu_count, to_numpy
from minidist.launch_check import check_launch

SIZES = [2**10, 2**16, 2**20, 2**24]  # float32 elements: 4 KiB .. 64 MiB


def timed_all_reduce(group, x, repeats=5):
    """Median seconds of ``repeats`` all-reduces of ``x`` (in place), every rank starting together;
    on the GPU the clock stops once the kernels are done."""
    times = []
    for _ in range(repeats):
        group.barrier()
        start = time.perf_counter()
        group.all_reduce(x)
        to_numpy(x[:1])  # waits for the GPU
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def gpu_name(cupy) -> str:
    """This rank's GPU as the CUDA runtime names it (the tests' CuPy double: "fake GPU (host memory)")."""
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def lesson(ring, nccl, cupy, png=None):
    rank, n = ring.rank, ring.size
    say = print if rank == 0 else (lambda *a, **k: None)
    aware = ring.transport.cuda_aware
    gpu, fake = gpu_name(cupy), getattr(cupy, "is_fake", False)
    say(f"=== 1. {n} ranks on {gpu} ({gpu_count()} GPU{'s' * (gpu_count() > 1)}); this MPI is "
        f"{'CUDA-aware: GPU buffers go to MPI as they are' if aware else 'not CUDA-aware: each message is staged through pinned host memory'}")
    if fake:
        say("  a stand-in for CuPy (the tests' double): its 'GPU' arrays live in host memory, so every path runs and "
            "is checked,\n  but the times below mean nothing")
    x = cupy.arange(10, dtype=cupy.float32) * (rank + 1)  # on the GPU
    ring.all_reduce(x)
    want = np.arange(10, dtype=np.float32) * sum(range(1, n + 1))
    assert type(x) is cupy.ndarray and (to_numpy(x) == want).all()
    say(f"  all_reduce of a cupy array: {to_numpy(x)[:5]} ... still a {type(x).__module__}.{type(x).__name__}")
    steps = 2 * (n - 1)
    if aware:
        say(f"  the ring made {steps} steps; in each, MPI read one GPU buffer and wrote another")
    else:
        say(f"  the ring made {steps} steps; in each: 1 GPU->host copy, 1 message, 1 host->GPU copy")

    say("\n=== 2. all-reduce time, median of 5 (float32)")
    say(f"  {'size':>8} {'host ring':>11} {'GPU ring':>11}" + (f" {'GPU nccl':>11}" if nccl is not None else
                                                              "   (NCCL: needs one GPU per rank)"))
    rows = []
    for count in SIZES:
        base = np.random.default_rng(rank).integers(-8, 8, count).astype(np.float32)  # exact sums
        host, device = base.copy(), cupy.asarray(base)
        row = [timed_all_reduce(ring, host), timed_all_reduce(ring, device)]
        if nccl is not None:
            on_nccl = cupy.asarray(base)
            row.append(timed_all_reduce(nccl, on_nccl))
        for result in [device] + ([on_nccl] if nccl is not None else []):
            assert (to_numpy(result) == host).all(), "a GPU all-reduce differs from the host's"
        cells = " ".join(f"{t * 1e3:9.2f}ms" for t in row)
        say(f"  {count * 4 // 1024:>6}KiB {cells}")
        rows.append((count * 4, row))
    if png and rank == 0:
        draw(png, rows, nccl is not None, aware, gpu, fake, n)
    say("\nTry:\n  1. SIZES = [2**8, 2**12]. Expect the GPU ring slower than the host ring for such small buffers "
        "(copies\n     and synchronisation per ring step dominate).\n  2. -n 4 on a machine with 4 GPUs. Expect "
        "the NCCL column, for 4 ranks.")
    say("\nEvery GPU result equals the host ring's, element for element. All checks passed.")


def draw(path, rows, with_nccl, aware, gpu, fake, n):
    """The all-reduce times of part 2: one group of bars per size (host ring, GPU ring, NCCL where
    it ran), each labelled with its ms; the title names the GPU and the columns this run had."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = ["host ring (NumPy)", "GPU ring (" + ("CUDA-aware MPI" if aware else "staged via pinned host") + ")"]
    names += ["NCCL"] if with_nccl else []
    fig, ax = plt.subplots(figsize=(10, 4.8))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        times = [1e3 * r[1][k] for r in rows]
        bars = ax.bar([i + (k - (len(names) - 1) / 2) * width for i in range(len(rows))], times, width, label=name)
        ax.bar_label(bars, [f"{t:.3g}" for t in times], fontsize=8)
    ax.set_xticks(range(len(rows)), [f"{nbytes // 1024:,} KiB" for nbytes, _ in rows])
    ax.set_yscale("log")
    ax.margins(y=0.15)
    ax.set_xlabel("all-reduce size (float32)")
    ax.set_ylabel("median time of 5 (ms, log scale)")
    columns = "host buffers and GPU buffers over the ring" + (", and NCCL" if with_nccl else
                                                               f"\n(no NCCL: it needs one GPU per rank, here "
                                                               f"{gpu_count()} for {n} ranks)")
    fig.suptitle(f"One all-reduce on {n} ranks, GPU: {gpu}. {columns[0].upper()}{columns[1:]}", fontsize=11)
    if fake:
        ax.set_title("FAKE GPU: the tests' CuPy double, in host memory. Every path ran and was checked; "
                     "the times mean nothing", fontsize=9, color="firebrick")
    ax.legend(loc="upper left", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"  times drawn in {path}")


def other_lessons() -> str:
    """The numbers of every other lesson in this folder, as ranges: ``00-07, 09-18``."""
    numbers = sorted(int(p.name[:2]) for p in Path(__file__).parent.glob("[0-9][0-9]_*.py") if p.name[:2] != "08")
    runs, start = [], numbers[0]
    for a, b in zip(numbers, numbers[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start:02d}" + (f"-{a:02d}" if a > start else ""))
            start = b
    return ", ".join(runs)


def launched_rank() -> int:
    """This process's rank in its mpiexec job (0 alone), without building minidist's world."""
    try:
        from mpi4py import MPI
    except ImportError:
        return 0
    return MPI.COMM_WORLD.Get_rank()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--png", help="draw the all-reduce times of part 2 into this PNG (needs a GPU run)")
    args = ap.parse_args()
    check_launch(ap, args)
    if gpu_count() == 0:
        if launched_rank() == 0:  # one message for the whole job, not one per rank
            print("Lesson 8 needs CuPy and an NVIDIA GPU (pip install -e \".[gpu]\" on a machine with a CUDA "
                  "driver); this machine has none, so it stops here"
                  + (f" and draws nothing into {args.png}" if args.png else "") + f". Every other lesson ("
                  f"{other_lessons()}) runs on CPU ranks, as processes under mpiexec or threads in one process: "
                  "no GPU needed.")
        return
    import cupy
    ring = minidist.init(backend="ring")
    nccl = None
    if gpu_count() >= ring.size:  # NCCL: one GPU per rank
        nccl = minidist.init(backend="nccl")  # picks this rank's GPU
    else:
        cupy.cuda.Device(ring.rank % gpu_count()).use()
    lesson(ring, nccl, cupy, args.png)


if __name__ == "__main__":
    main()
