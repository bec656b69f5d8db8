"""Recursive doubling: the latency-optimal all-reduce, for small messages, and all-gather.

With n a power of two, log2(n) rounds suffice. In round k every rank swaps its whole buffer with the
rank whose number differs in bit k, and both reduce. After round k each rank holds the reduction of a
block of 2^(k+1) ranks; after the last round, of all of them. Few messages (log2 n instead of the
ring's 2(n-1)), but each carries the whole buffer: the right trade when the buffer is small and each
message's fixed cost dominates.

When n is not a power of two, fold the extra ranks in (MPICH's scheme): with p the largest power of
two below n and e = n - p, ranks 0..2e-1 pair up; each even one hands its buffer to the odd one after
it and sits out. The p remaining ranks double, then each odd rank hands the result back.

Identical bits everywhere: a pair of ranks always computes ``lower_rank_data op higher_rank_data``,
the same expression with the same operands on both sides, so their results agree to the last bit even
where an op is not bitwise commutative (``maximum(-0.0, 0.0)``).

All-gather (:func:`all_gather`, n a power of two) doubles too, but what it swaps grows instead of
staying whole: rank r starts with its own chunk; in round k it swaps everything it holds (2^k
chunks, a block aligned to 2^k) with partner r ^ 2^k, and both then hold the aligned block of
2^(k+1). log2(n) rounds instead of the ring's n - 1, the same (n-1)/n of the buffer sent.
``halving.py`` uses it as the second half of Rabenseifner's all-reduce.
"""
from __future__ import annotations

from minidist.comm.ops import Workspace, offsets, reduce_ufunc, same_memory
from minidist.comm.tags import TAG_DOUBLING as TAG
from minidist.comm.tags import TAG_DOUBLING_GATHER


def all_reduce(t, buf, op, *, workspace=None) -> None:
    """Every rank's ``buf`` becomes the elementwise ``op`` over all ranks, in place.

    Sends: log2(p) whole-buffer exchanges with partners rank ^ 1, ^ 2, ^ 4, ... (in folded numbering),
    plus, for the 2(n - p) folded ranks, one buffer in before and one out after.
    """
    n, r = t.size, t.rank
    if n == 1:
        return
    ufunc = reduce_ufunc(op, buf)
    incoming = (workspace if workspace is not None else Workspace()).get("doubling", buf.dtype, buf.size, like=buf)
    folded = fold_in(t, buf, ufunc, incoming, TAG)
    if folded is None:
        return
    p = 1 << (n.bit_length() - 1)  # the largest power of two <= n
    extra = n - p
    mask = 1
    while mask < p:
        other = folded ^ mask
        partner = 2 * other + 1 if other < extra else other + extra
        t.sendrecv(buf, partner, incoming, partner, TAG)
        if partner < r:
            ufunc(incoming, buf, out=buf)
        else:
            ufunc(buf, incoming, out=buf)
        mask <<= 1
    fold_out(t, buf, TAG)


def fold_in(t, buf, ufunc, incoming, tag):
    """The first half of the fold (module docstring), for n not a power of two: with p the largest
    power of two <= n, an even rank r < 2(n - p) hands its buffer to r + 1 and waits for the final
    result from it (returns None: it is done); an odd one receives it into ``incoming`` and reduces
    it into ``buf`` (lower rank's data first). Returns this rank's number among the p that go on.

    Sends: an even rank below 2(n - p), its whole ``buf`` to rank + 1."""
    n, r = t.size, t.rank
    extra = n - (1 << (n.bit_length() - 1))
    if r >= 2 * extra:
        return r - extra
    if r % 2 == 0:
        t.send(buf, r + 1, tag)
        t.recv(buf, r + 1, tag)
        return None
    t.recv(incoming[:buf.size], r - 1, tag)
    ufunc(incoming[:buf.size], buf, out=buf)
    return r // 2


def fold_out(t, buf, tag) -> None:
    """The second half of the fold: each odd rank r < 2(n - p) hands the result back to r - 1.

    Sends: those ranks, their whole ``buf`` to rank - 1."""
    n, r = t.size, t.rank
    if r < 2 * (n - (1 << (n.bit_length() - 1))) and r % 2 == 1:
        t.send(buf, r - 1, tag)


def all_gather(t, shard, counts, out) -> None:
    """Every rank's ``shard`` (rank r's has ``counts[r]`` elements) concatenated in rank order into
    ``out`` on every rank; n must be a power of two (the group uses the ring otherwise). ``shard``
    may already be ``out``'s own chunk (in-place all-gather).

    Sends: log2(n) exchanges, with partners rank ^ 1, ^ 2, ^ 4, ...: in round k, the 2^k chunks this
    rank holds (the aligned block around its own) go to the partner, whose 2^k come back straight
    into their place in ``out``.
    """
    n, r = t.size, t.rank
    if n & (n - 1):
        raise ValueError(f"rank {r}: doubling.all_gather needs a power-of-two group, got {n} ranks")
    starts = offsets(counts) + [sum(counts)]
    mine = out[starts[r]:starts[r + 1]]
    if not same_memory(mine, shard):
        mine[...] = shard
    gather_blocks(t, out, starts, r, range(n))


def gather_blocks(t, buf, starts, me, ranks, mask=1) -> None:
    """The doubling rounds of :func:`all_gather` among ``p = len(ranks)`` (a power of two)
    participants numbered 0..p-1, ``me`` being this one and ``ranks[f]`` the transport rank of f.
    Block f, ``buf[starts[f]:starts[f+1]]``, is participant f's at the start and everyone's at the
    end. With ``mask`` > 1, each participant starts with the ``mask`` aligned blocks around its own."""
    while mask < len(ranks):
        lo = me & ~(mask - 1)  # I hold blocks lo..lo+mask-1; the partner the aligned ones next to them
        other = lo ^ mask
        send = buf[starts[lo]:starts[lo + mask]]
        recv = buf[starts[other]:starts[other + mask]]
        swap(t, send, recv, ranks[me ^ mask], TAG_DOUBLING_GATHER)
        mask <<= 1


def swap(t, send, recv, peer, tag) -> None:
    """Swap ``send`` for ``recv`` with ``peer`` (halving.py's rounds use it too); a direction with
    nothing to carry sends no message (both sides agree, since one's send is the other's receive).

    Sends: ``send`` to ``peer``, if it holds anything."""
    if send.size and recv.size:
        t.sendrecv(send, peer, recv, peer, tag)
    elif send.size:
        t.send(send, peer, tag)
    elif recv.size:
        t.recv(recv, peer, tag)
