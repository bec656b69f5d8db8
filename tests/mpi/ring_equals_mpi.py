"""Rank script: every collective of backend "ring" gives exactly what MPI's own collectives give.

Run by tests/test_mpi.py as ``mpiexec -n N python tests/mpi/ring_equals_mpi.py``. Two groups over the
same processes: ``ring`` (hand-written algorithms over point-to-point) and ``mpi`` (MPI_Allreduce & co).
Inputs are small integers stored in each dtype, so every sum, product, max, min and average is exact
and the two backends must agree bit for bit, whatever order they add in. Any difference raises, the
exception hook aborts the job, and mpiexec exits non-zero. Rank 0 prints ``OK <checks>`` at the end.
"""
import numpy as np
from mpi4py import MPI

import minidist

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
OPS = ["sum", "prod", "max", "min", "avg"]

ring = minidist.init(backend="ring", timeout=30.0)
mpi = minidist.init(backend="mpi", timeout=30.0)
ring_only = minidist.init(backend="ring", timeout=30.0)
ring_only.ring_from_bytes = 0  # reduce_scatter and all_gather by the ring even where n is a power of two
rank, n = ring.rank, ring.size
checks = 0


def shapes():
    """Counts 0, 1, < n, = n, not divisible by n, one long enough to be segmented; and multi-dim."""
    for count in sorted({0, 1, n - 1, n, n + 1, 7, 1001, 100_003}):
        yield (count,)
    yield (n + 1, 3)
    yield (2, 3, 5)


def data(shape, dtype, op, seed):
    """Per-rank integer-valued input for which ``op`` is exact in ``dtype`` for up to 4 ranks."""
    rng = np.random.default_rng([seed, rank])
    if op == "prod":
        values = rng.choice([-2, -1, 1, 2], size=shape)  # |product| <= 16
    else:
        values = rng.integers(-50, 50, size=shape)  # |sum| <= 200: exact even in float16
    return values.astype(dtype)


def same(a, b, what):
    global checks
    checks += 1
    if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
        raise AssertionError(f"rank {rank}: {what}: ring gave {a!r}, mpi gave {b!r}")


def identical_on_all_ranks(x, what):
    """Gather every rank's bytes to rank 0 (plain mpi4py, not the code under test) and compare."""
    global checks
    checks += 1
    everyone = MPI.COMM_WORLD.gather(x.tobytes(), root=0)
    if rank == 0 and any(b != everyone[0] for b in everyone):
        raise AssertionError(f"{what}: ranks ended with different bytes")


def ops_for(dtype):
    """The ops whose answer is exact on these inputs. Not a float16 average: it divides before it
    sums (comm/ops.py), so its additions round in each algorithm's order (tests/test_collectives.py
    bounds it)."""
    return [op for op in OPS if op != "avg" or np.issubdtype(dtype, np.floating) and dtype != np.float16]


def check_all_reduce(g_ring, g_mpi, tag):
    for seed, (dtype, shape) in enumerate((d, s) for d in DTYPES for s in shapes()):
        for op in ops_for(dtype):
            x = data(shape, dtype, op, seed)
            want = g_mpi.all_reduce(x.copy(), op=op)
            for algorithm in ["auto", "ring", "doubling", "halving"]:
                got = x.copy()
                returned = g_ring.all_reduce(got, op=op, algorithm=algorithm)
                assert returned is got, "all_reduce works in place and returns its argument"
                same(got, want, f"{tag} all_reduce {np.dtype(dtype)} {shape} {op} {algorithm}")


def check_reduce_scatter_all_gather(g_ring, g_mpi, tag):
    for seed, (dtype, shape) in enumerate((d, s) for d in DTYPES for s in shapes()):
        for op in ops_for(dtype):
            x = data(shape, dtype, op, seed)
            want = g_mpi.reduce_scatter(x.copy(), op=op)
            what = f"{tag} reduce_scatter {np.dtype(dtype)} {shape} {op}"
            unchanged = x.copy()
            same(g_ring.reduce_scatter(unchanged, op=op), want, what)
            same(unchanged, x, what + ": the input is not modified")
            out = np.empty_like(want)
            assert g_ring.reduce_scatter(x.copy(), op=op, out=out) is out
            same(out, want, what + " (out=)")
        # all_gather of numpy.array_split shards: uneven when shape[0] % n != 0.
        full = data(shape, dtype, "sum", seed + 1000)
        shard = np.ascontiguousarray(np.array_split(full, g_ring.size)[g_ring.rank])
        want = g_mpi.all_gather(shard, count=shape[0])
        same(g_ring.all_gather(shard, count=shape[0]), want, f"{tag} all_gather {np.dtype(dtype)} {shape}")
        out = np.empty_like(want)
        assert g_ring.all_gather(shard, count=shape[0], out=out) is out
        same(out, want, f"{tag} all_gather(out=) {np.dtype(dtype)} {shape}")
        # without count, every rank's shard has the same length: here, all of `full`.
        same(g_ring.all_gather(full), g_mpi.all_gather(full), f"{tag} all_gather(count=None) {np.dtype(dtype)} {shape}")


def check_rooted(g_ring, g_mpi, tag):
    for dtype in DTYPES:
        for shape in [(0,), (n + 1,), (1001,), (3, 4)]:
            for root in range(g_ring.size):
                x = data(shape, dtype, "sum", root)
                same(g_ring.broadcast(x.copy(), src=root), g_mpi.broadcast(x.copy(), src=root),
                     f"{tag} broadcast {np.dtype(dtype)} {shape} from {root}")
                for op in ops_for(dtype):
                    x = data(shape, dtype, op, root)
                    got, want = g_ring.reduce(x.copy(), dst=root, op=op), g_mpi.reduce(x.copy(), dst=root, op=op)
                    if g_ring.rank == root:
                        same(got, want, f"{tag} reduce {np.dtype(dtype)} {shape} {op} to {root}")
    g_ring.barrier()


def check_bitwise_identical_floats():
    """Non-integer floats: the sum depends on the order of additions, yet every rank must end with
    the same bits (each element is reduced once, on one rank, then copied)."""
    for dtype in [np.float16, np.float32, np.float64]:
        for count in [n + 1, 1001, 100_003]:
            for algorithm in ["ring", "doubling", "halving"]:
                x = np.random.default_rng([count, rank]).standard_normal(count).astype(dtype)
                ring.all_reduce(x, op="avg", algorithm=algorithm)
                identical_on_all_ranks(x, f"all_reduce {np.dtype(dtype)} {count} {algorithm}")


def check_point_to_point():
    right, left = (rank + 1) % n, (rank - 1) % n
    for dtype in DTYPES:
        got = np.empty(5, dtype)
        ring.sendrecv(np.full(5, rank, dtype), right, got, left)
        same(got, np.full(5, left, dtype), f"sendrecv {np.dtype(dtype)}")
        if rank == 0:
            ring.send(np.arange(7, dtype=dtype), n - 1)
        elif rank == n - 1:
            got = np.empty(7, dtype)
            ring.recv(got, 0)
            same(got, np.arange(7, dtype=dtype), f"send/recv {np.dtype(dtype)}")
    # A message shorter than the receive buffer is an error, not a half-filled buffer.
    if rank == 0:
        ring.send(np.zeros(3), 1)
    elif rank == 1:
        try:
            ring.recv(np.zeros(4), 0)
            raise AssertionError("receiving 3 elements into a buffer of 4 did not raise")
        except ValueError as e:
            assert "received 24 bytes from rank 0 into a buffer of 32 bytes" in str(e), e


def check_subgroups():
    """split by parity, each group ordered by descending rank; then one group without rank 0, which
    passes a negative color and gets no group."""
    color = rank % 2
    sub_ring, sub_mpi = ring.split(color, key=-rank, name="parity"), mpi.split(color, key=-rank, name="parity")
    members = sorted((r for r in range(n) if r % 2 == color), reverse=True)
    assert (sub_ring.size, sub_ring.rank) == (len(members), members.index(rank))
    check_all_reduce(sub_ring, sub_mpi, "parity")
    check_reduce_scatter_all_gather(sub_ring, sub_mpi, "parity")
    check_rooted(sub_ring, sub_mpi, "parity")

    color = -1 if rank == 0 else 0
    sub_ring, sub_mpi = ring.split(color, name="not0"), mpi.split(color, name="not0")
    if rank == 0:
        assert sub_ring is None and sub_mpi is None, "a negative color gets no group"
        return
    assert (sub_ring.size, sub_ring.rank) == (n - 1, rank - 1)
    check_all_reduce(sub_ring, sub_mpi, "not0")


check_all_reduce(ring, mpi, "world")
check_reduce_scatter_all_gather(ring, mpi, "world")
check_reduce_scatter_all_gather(ring_only, mpi, "world, the ring only")
check_rooted(ring, mpi, "world")
check_bitwise_identical_floats()
check_point_to_point()
check_subgroups()
total = MPI.COMM_WORLD.reduce(checks, root=0)
if rank == 0:
    print(f"OK {total} checks on {n} ranks", flush=True)
