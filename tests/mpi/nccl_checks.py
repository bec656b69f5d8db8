"""Rank script (a GPU machine): backend "nccl" gives exactly the results of backend "ring".

Run by tests/test_gpu.py as ``mpiexec -n N python tests/mpi/nccl_checks.py``, one rank per GPU. Inputs
are small integers in every dtype, so each reduction is exact and the two backends must agree bit for
bit whatever order they add in. Checks every collective (uneven counts included), a split group with
its own communicator, and point-to-point calls (two ranks exchanging at once). Rank 0 prints ``OK``.
"""
import cupy as cp
import numpy as np

import minidist

nccl = minidist.init(backend="nccl", timeout=60.0)  # first: it picks this rank's GPU
ring = minidist.init(backend="ring", timeout=60.0)
rank, n = nccl.rank, nccl.size
checks = 0


def same(a, b, what):
    global checks
    checks += 1
    a, b = cp.asnumpy(a), cp.asnumpy(b)
    if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
        raise AssertionError(f"rank {rank}: {what}: nccl gave {a}, ring gave {b}")


def data(count, dtype, op, seed):
    rng = np.random.default_rng([seed, rank])
    values = rng.choice([-2, -1, 1, 2], size=count) if op == "prod" else rng.integers(-50, 50, size=count)
    return cp.asarray(values.astype(dtype))


for dtype in (np.float16, np.float32, np.float64, np.int32, np.int64):
    for count in sorted({0, 1, n + 1, 1001, 100_003}):
        for op in ("sum", "prod", "max", "min", "avg"):
            x = data(count, dtype, op, count)
            same(nccl.all_reduce(x.copy(), op), ring.all_reduce(x.copy(), op), f"all_reduce {op} {dtype} {count}")
            part = nccl.reduce_scatter(x, op)
            same(part, ring.reduce_scatter(x, op), f"reduce_scatter {op} {dtype} {count}")
            same(nccl.all_gather(part, count=count), ring.all_gather(part, count=count), f"all_gather {dtype} {count}")
            same(nccl.reduce(x.copy(), n - 1, op), ring.reduce(x.copy(), n - 1, op), f"reduce {op} {dtype} {count}")
        same(nccl.broadcast(x.copy(), n - 1), ring.broadcast(x.copy(), n - 1), f"broadcast {dtype} {count}")
nccl.barrier()

halves = [g.split(rank % 2) for g in (nccl, ring)]  # a mesh axis: its own NCCL communicator
x = data(1000, np.float32, "sum", 7)
same(halves[0].all_reduce(x.copy()), halves[1].all_reduce(x.copy()), "all_reduce on a split group")

if n > 1:  # point to point: everyone sends right and receives from the left at once
    right, left = (rank + 1) % n, (rank - 1) % n
    got = nccl.sendrecv(cp.full(5, rank, cp.float32), right, cp.empty(5, cp.float32), left)
    same(got, cp.full(5, left, cp.float32), "sendrecv")
    inbox = cp.empty(3, cp.int64)
    requests = [nccl.irecv(inbox, left), nccl.isend(cp.arange(3) + rank, right)]
    for r in requests:
        r.wait()
    same(inbox, cp.arange(3) + left, "isend/irecv")
if rank == 0:
    print(f"OK {checks} checks on {n} GPUs")
