"""Rank script: all_to_all, hand-written and backend "mpi", gives exactly what MPI's own gives.

Run by tests/test_mpi.py as ``mpiexec -n N python tests/mpi/all_to_all_equals_mpi.py``. The reference
is plain mpi4py on the raw bytes: ``MPI_Alltoall`` for equal chunks, ``MPI_Alltoallv`` for a counts
matrix that every rank draws from one shared seed (zeros, rows < n and long rows included). Against
it: backend "ring" with the counts given and learned, each hand-written algorithm forced, backend
"mpi" (``MPI_Alltoallv`` through ``native.py``), on the world and on split groups. Then the two ways
a rank expecting other counts than its peer sends is refused: backend "mpi" compares the counts first
(CollectiveMismatchError on every rank of a disagreeing pair), backend "ring"'s transport refuses the
message. Any difference raises, the exception hook aborts the job, and mpiexec exits non-zero. Rank 0
prints ``OK <checks>`` at the end.
"""
import numpy as np
from mpi4py import MPI

import minidist
from minidist.comm import CollectiveMismatchError, alltoall

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
TAILS = [(), (3,), (2, 0)]

ring = minidist.init(backend="ring", timeout=30.0)
mpi = minidist.init(backend="mpi", timeout=30.0)
rank, n = ring.rank, ring.size
checks = 0


def count_matrices(size, seed):
    """Rows from rank i to rank j: equal chunks of 0, 1 and 5 rows, then uneven matrices with zeros,
    one with a single busy pair, and one long enough for the pairwise algorithm."""
    rng = np.random.default_rng(seed)  # the same seed on every rank: the same matrices
    for k in (0, 1, 5):
        yield "equal", np.full((size, size), k)
    yield "uneven", rng.integers(0, 4, (size, size))
    yield "uneven", rng.integers(0, 2, (size, size)) * rng.integers(0, 50, (size, size))
    lonely = np.zeros((size, size), int)
    lonely[size - 1, 0] = 7
    yield "uneven", lonely
    yield "uneven", rng.integers(100_000, 140_000, (size, size))  # ~1 MB chunks of float64: pairwise


def rank_input(g, counts, tail, dtype, seed):
    rows = int(counts[g.rank].sum())
    values = np.random.default_rng([seed, g.rank]).integers(-1000, 1000, (rows,) + tail)
    return values.astype(dtype)


def reference(comm, x, send_rows, recv_rows):
    """MPI's own all-to-all of the bytes of ``x`` (Alltoall when every count is one number)."""
    row_bytes = x.itemsize * int(np.prod(x.shape[1:], dtype=int))
    out = np.empty((sum(recv_rows),) + x.shape[1:], x.dtype)
    if len(set(send_rows) | set(recv_rows)) == 1:
        comm.Alltoall([x, MPI.BYTE], [out, MPI.BYTE])
        return out
    send_bytes, recv_bytes = [c * row_bytes for c in send_rows], [c * row_bytes for c in recv_rows]
    comm.Alltoallv([x, (send_bytes, offsets(send_bytes)), MPI.BYTE],
                   [out, (recv_bytes, offsets(recv_bytes)), MPI.BYTE])
    return out


def offsets(counts):
    return [int(v) for v in np.concatenate([[0], np.cumsum(counts)[:-1]])]


def same(a, b, what):
    global checks
    checks += 1
    if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
        raise AssertionError(f"rank {rank}: {what}: got {a!r}, MPI_Alltoall(v) gave {b!r}")


def check_all_to_all(g_ring, g_mpi, comm, tag):
    seed = 0
    for dtype in DTYPES:
        for tail in TAILS:
            for mode, counts in count_matrices(g_ring.size, seed):
                seed += 1
                if mode == "uneven" and counts.max() > 1000 and (tail != () or dtype != np.float64):
                    continue  # the long rows once, in float64
                x = rank_input(g_ring, counts, tail, dtype, seed)
                send, recv = counts[g_ring.rank].tolist(), counts[:, g_ring.rank].tolist()
                want = reference(comm, x, send, recv)
                what = f"{tag} {np.dtype(dtype)} {tail} {mode} {counts.tolist()}"
                args = (None, None) if mode == "equal" else (send, recv)
                same(g_ring.all_to_all(x, *args), want, what + " ring")
                same(g_mpi.all_to_all(x, *args), want, what + " mpi")
                if mode == "uneven":
                    same(g_ring.all_to_all(x, send), want, what + " ring, counts learned")
                    same(g_mpi.all_to_all(x, send), want, what + " mpi, counts learned")
                out = np.empty_like(want)
                assert g_ring.all_to_all(x, send, recv, out=out, async_op=True).wait() is out
                same(out, want, what + " ring, out=, async")
                row = int(np.prod(tail, dtype=int))
                for algorithm in alltoall.ALGORITHMS:
                    forced = np.empty_like(want)
                    alltoall.all_to_all(g_ring.transport, x.reshape(-1), [c * row for c in send], forced.reshape(-1),
                                        [c * row for c in recv], algorithm=algorithm)
                    same(forced, want, f"{what} {algorithm}")


def check_disagreeing_counts():
    """Every rank expects one row more from its left neighbour than that neighbour sends."""
    global checks
    left = (rank - 1) % n
    recv = [2] * n
    recv[left] = 3
    x = np.arange(2.0 * n)
    try:
        mpi.all_to_all(x, [2] * n, recv)
        raise AssertionError("backend mpi took counts that disagree")
    except CollectiveMismatchError as e:
        assert f"rank {left} sends 2 rows to rank {rank}, which expects 3" in str(e), e
        checks += 1
    same(mpi.all_to_all(x, [2] * n, [2] * n), reference(MPI.COMM_WORLD, x, [2] * n, [2] * n), "mpi after a mismatch")
    mpi.barrier()
    try:  # last: an all_to_all that failed half way may leave messages behind
        ring.all_to_all(x, [2] * n, recv)
        raise AssertionError("backend ring received a short chunk without a word")
    except ValueError as e:
        assert f"received 16 bytes from rank {left} into a buffer of 24 bytes" in str(e), e
        checks += 1


check_all_to_all(ring, mpi, MPI.COMM_WORLD, "world")
color = rank % 2
sub_ring, sub_mpi = ring.split(color, key=-rank, name="parity"), mpi.split(color, key=-rank, name="parity")
check_all_to_all(sub_ring, sub_mpi, MPI.COMM_WORLD.Split(color, -rank), "parity")
if n > 1:
    check_disagreeing_counts()
total = MPI.COMM_WORLD.reduce(checks, root=0)
if rank == 0:
    print(f"OK {total} checks on {n} ranks", flush=True)
