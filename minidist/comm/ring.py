"""The ring: bandwidth-optimal reduce-scatter, all-gather and all-reduce over any transport.

The n ranks stand in a circle; each only ever sends to its right neighbour (rank + 1) and receives
from its left one (rank - 1). The buffer is cut into n chunks (``counts``, the ``numpy.array_split``
rule). In n - 1 steps every chunk travels once around the circle:

- reduce-scatter: at step s, rank r sends chunk r-s-1 and receives chunk r-s-2, which it reduces into
  its own copy. After the last step rank r holds chunk r reduced over all ranks.
- all-gather: at step s, rank r sends chunk r-s (the one it got last step) and receives chunk r-s-1.
- all-reduce = reduce-scatter, then all-gather of the reduced chunks.

Each rank sends 2(n-1)/n of the buffer in all-reduce, whatever n: the ring's claim to fame.

Within a step each chunk moves in segments (``segment_bytes``). In reduce-scatter the receive of
segment k+1 is already posted, into the other half of a two-slot workspace, while segment k is
reduced: double buffering, so the network and the reduction overlap. Every receive is posted before
the matching send. Each chunk is reduced by exactly one rank and then copied to the others, so every
rank ends with bitwise identical results.
"""
from __future__ import annotations

from minidist.comm.ops import Workspace, offsets, reduce_ufunc, same_memory, split_counts
from minidist.comm.tags import TAG_ALL_GATHER, TAG_REDUCE_SCATTER
from minidist.comm.transport import wait_all

SEGMENT_BYTES = 1024 * 1024  # measured: 1 MiB beat 256 KiB at 4 MiB-64 MiB on 2 and 4 ranks


def reduce_scatter(t, buf, counts, op, out, *, segment_bytes=SEGMENT_BYTES, workspace=None) -> None:
    """Reduce ``buf`` elementwise over all ranks; rank r's chunk (``counts[r]`` elements, at
    ``sum(counts[:r])``) lands in ``out``. ``buf`` is used as scratch: its other chunks are clobbered.

    Sends: in each of n-1 steps, one chunk to rank+1, segment by segment; receives one from rank-1.
    """
    n, r = t.size, t.rank
    starts = offsets(counts)

    def chunk(c):
        c %= n
        return buf[starts[c]:starts[c] + counts[c]]

    if n == 1:
        if not same_memory(out, buf):
            out[...] = buf
        return
    seg = max(1, segment_bytes // buf.itemsize)
    scratch = (workspace if workspace is not None else Workspace()).get("ring", buf.dtype, 2 * seg, like=buf)
    slots = (scratch[:seg], scratch[seg:])  # double buffer: receive into one while reducing the other
    for s in range(n - 1):
        acc = chunk(r - s - 2)
        _reduce_step(t, chunk(r - s - 1), acc, out if s == n - 2 else acc, reduce_ufunc(op, buf), slots, seg)


def _reduce_step(t, send, acc, dst, ufunc, slots, seg) -> None:
    """One reduce-scatter step: stream ``send`` to the right neighbour while receiving, from the left
    one, ``acc.size`` elements segment by segment into alternating ``slots``; ``dst = acc op received``."""
    right, left = (t.rank + 1) % t.size, (t.rank - 1) % t.size
    n_send, n_recv = -(-send.size // seg), -(-acc.size // seg)

    def post_recv(k):
        return t.irecv(slots[k % 2][:min(seg, acc.size - k * seg)], left, TAG_REDUCE_SCATTER)

    pending = post_recv(0) if n_recv else None
    sends = []
    for k in range(max(n_send, n_recv)):
        if k < n_send:
            sends.append(t.isend(send[k * seg:(k + 1) * seg], right, TAG_REDUCE_SCATTER))
        if k < n_recv:
            following = post_recv(k + 1) if k + 1 < n_recv else None  # lands in the other slot
            pending.wait()
            lo, hi = k * seg, min((k + 1) * seg, acc.size)
            ufunc(acc[lo:hi], slots[k % 2][:hi - lo], out=dst[lo:hi])
            pending = following
    wait_all(sends)


def all_gather(t, shard, counts, out, *, segment_bytes=SEGMENT_BYTES) -> None:
    """Every rank's ``shard`` (rank r's has ``counts[r]`` elements) concatenated in rank order into
    ``out`` on every rank. ``shard`` may already be ``out``'s own chunk (in-place all-gather).

    Sends: in each of n-1 steps, one chunk to rank+1 (the one received last step); receives one from
    rank-1, straight into its place in ``out``.
    """
    n, r = t.size, t.rank
    starts = offsets(counts)

    def chunk(c):
        c %= n
        return out[starts[c]:starts[c] + counts[c]]

    if not same_memory(chunk(r), shard):
        chunk(r)[...] = shard
    seg = max(1, segment_bytes // out.itemsize)
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send, recv = chunk(r - s), chunk(r - s - 1)
        requests = [t.irecv(recv[i:i + seg], left, TAG_ALL_GATHER) for i in range(0, recv.size, seg)]
        requests += [t.isend(send[i:i + seg], right, TAG_ALL_GATHER) for i in range(0, send.size, seg)]
        wait_all(requests)


def all_reduce(t, buf, op, *, segment_bytes=SEGMENT_BYTES, workspace=None) -> None:
    """Every rank's ``buf`` becomes the elementwise ``op`` over all ranks, in place: a ring
    reduce-scatter into this rank's own chunk of ``buf``, then a ring all-gather of the chunks.
    Sends 2(n-1)/n of ``buf`` per rank."""
    counts = split_counts(buf.size, t.size)
    start = offsets(counts)[t.rank]
    mine = buf[start:start + counts[t.rank]]
    reduce_scatter(t, buf, counts, op, mine, segment_bytes=segment_bytes, workspace=workspace)
    all_gather(t, mine, counts, buf, segment_bytes=segment_bytes)
