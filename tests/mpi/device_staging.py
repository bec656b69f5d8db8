"""Rank script: collectives on GPU arrays over MPI, staged through host memory or not.

Run as ``mpiexec -n N python tests/mpi/device_staging.py yes|no|detect [real]``: "yes"/"no" tell
minidist whether the MPI is CUDA-aware, "detect" asks the MPI library. Every collective of backend
"ring" on device arrays must give exactly the host result.

By default the fake-CuPy double stands in for the GPU (tests/test_device_collectives.py), and it
counts copies: staged ("no"), each message cost one device->host copy before the send or one
host->device copy after the receive; direct ("yes"), none, MPI read and wrote the device buffers.
With ``real`` (tests/test_gpu.py, on a GPU machine) the buffers are real CuPy arrays; there is no
copy counter then, the results are the proof. Rank 0 prints ``OK``.
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for `tests.`
from tests.doubles import fake_cupy  # noqa: E402

real = "real" in sys.argv[2:]
if real:
    import cupy as cp
else:
    cp = fake_cupy.install()
import minidist  # noqa: E402  (after the double, as a GPU script imports cupy first)

cuda_aware = {"yes": True, "no": False, "detect": None}[sys.argv[1]]
group = minidist.init(timeout=60.0, cuda_aware=cuda_aware)
rank, n = group.rank, group.size
if cuda_aware is not None:
    assert group.transport.cuda_aware is cuda_aware
rng = np.random.default_rng(rank)
checks = 0


def same(device_result, host_result, what):
    global checks
    checks += 1
    got = device_result.get()
    if got.tobytes() != host_result.tobytes():
        raise AssertionError(f"rank {rank}: {what}: device gave {got}, host gave {host_result}")


for dtype in (np.float16, np.float32, np.float64, np.int32, np.int64):
    for count in (0, 1, n + 1, 1001, 300_001):  # 300_001 x 8 bytes: several 1 MiB ring segments
        host = rng.integers(-50, 50, size=count).astype(dtype)
        for algorithm in ("ring", "doubling"):
            same(group.all_reduce(cp.asarray(host), algorithm=algorithm),
                 group.all_reduce(host.copy(), algorithm=algorithm), f"all_reduce {algorithm} {dtype} {count}")
        part = group.reduce_scatter(cp.asarray(host), "max")
        same(part, group.reduce_scatter(host, "max"), f"reduce_scatter {dtype} {count}")
        same(group.all_gather(part, count=count), group.all_gather(part.get(), count=count), "all_gather")
        same(group.broadcast(cp.asarray(host), 1), group.broadcast(host.copy(), 1), "broadcast")
        same(group.reduce(cp.asarray(host), 2, "min"), group.reduce(host.copy(), 2, "min"), "reduce")

right, left = (rank + 1) % n, (rank - 1) % n  # point to point, a pipeline's (mb, T, C) activation
got = group.sendrecv(cp.full((2, 3, 4), rank, cp.float32), right, cp.empty((2, 3, 4), cp.float32), left)
same(got, np.full((2, 3, 4), left, np.float32), "sendrecv of a 3-D array")

x = cp.asarray(np.full(10, rank, np.float64))
fake_cupy.TRANSFERS.clear()
group.all_reduce(x, algorithm="ring")  # 2(n-1) steps: one send and one receive each
copies = dict(fake_cupy.TRANSFERS)
staged = {"to_host": 2 * (n - 1), "to_device": 2 * (n - 1)}
if real:
    copies = "not counted (real GPU)"
elif group.transport.cuda_aware:
    assert not copies, f"rank {rank}: a CUDA-aware MPI needs no staging copies, saw {copies}"
else:
    assert copies == staged, f"rank {rank}: expected one staging copy per message {staged}, saw {copies}"
assert x.get().tolist() == [n * (n - 1) / 2] * 10
group.barrier()
if rank == 0:
    print(f"OK {checks} checks, cuda-aware MPI {group.transport.cuda_aware}, copies per all-reduce {copies}")
