"""Recursive halving reduce-scatter, and Rabenseifner's all-reduce built on it.

Recursive halving (n a power of two) is recursive doubling run backwards on shrinking data. The
buffer is cut into n chunks, chunk r being rank r's share. In round k (k = 1..log2 n) every rank
pairs with the rank whose number differs in bit log2(n) - k (first the rank n/2 away, last its
neighbour). Of the chunks still in play, the pair splits them in two: the lower rank keeps the lower
half, the higher one the upper half. Each sends the half it gives up and reduces the half it keeps
with what arrives. Every round halves what is in play, so after log2(n) rounds rank r holds chunk r
reduced over all ranks:

    n = 4, chunks A B C D          round 1: 0<->2, 1<->3         round 2: 0<->1, 2<->3
    rank 0 keeps A B, sends C D   rank 0 keeps A, sends B      ->  rank 0: A of all four
    rank 2 keeps C D, sends A B   rank 2 keeps C, sends D      ->  rank 2: C of all four

Each rank sends n/2 + n/4 + ... + 1 = n - 1 chunks, (n-1)/n of the buffer, like the ring, but in
log2(n) rounds instead of n - 1: fewer of the fixed costs (a Python round of posting and waiting, a
peer that must be scheduled) that dominate mid-sized messages.

Rabenseifner's all-reduce (:func:`all_reduce`) is this reduce-scatter followed by the recursive
doubling all-gather (``doubling.all_gather``: the same rounds in reverse, each swapping what a rank
holds for what its partner holds): 2(n-1)/n of the buffer per rank, as the ring, in about 2 log2(n)
rounds instead of 2(n-1). MPICH uses it for mid-sized all-reduces. One refinement, for the smaller
of those sizes on 4 or more ranks (:data:`MERGE_BELOW_BYTES`): the last halving round (swap one
chunk, reduce it) and the first doubling round (swap the reduced chunk back) merge into one, in
which the partners swap both chunks whole and both reduce them. The same bytes, one round fewer
(3 rounds at n = 4), for one chunk more reduced per rank.

When n is not a power of two, the extra ranks fold in first, as in ``doubling.py``: with p the
largest power of two below n and e = n - p, each even rank below 2e hands its buffer to the odd one
after it, the p remaining ranks run the algorithm over p chunks, and each odd rank hands the result
back.

Identical bits everywhere: a pair always computes ``lower_rank_data op higher_rank_data``. Each
chunk's partial results only ever move towards its final owner, which reduces it and copies it to
the others; in the merged round both partners compute the same expression with the same operands,
so they agree to the last bit.
"""
from __future__ import annotations

from minidist.comm import doubling
from minidist.comm.ops import Workspace, offsets, reduce_ufunc, same_memory
from minidist.comm.tags import TAG_HALVING as TAG

MERGE_BELOW_BYTES = 512 * 1024
""":func:`all_reduce` merges its middle rounds when p >= 4 and the two chunks they swap (2/p of the
buffer) come to less than this. Merging saves one round of 2 log2(p) but has both partners reduce
those two chunks: on 4 ranks sharing 2 cores the saved round won with up to 256 KiB of chunks (a
512 KiB buffer), tied at 1 MiB buffers and lost by 2-4% beyond. With p = 2 merging would double each rank's reduction (the whole buffer, not half of it)
to save one round of two: it lost from 128 KiB whenever the cores were busy, so it is never done
(recursive doubling, below the group's threshold, is that merged form). The choice depends on the
size and n only, so every rank makes the same one."""


def reduce_scatter(t, buf, counts, op, out, *, workspace=None) -> None:
    """Reduce ``buf`` elementwise over all ranks; rank r's chunk (``counts[r]`` elements, at
    ``sum(counts[:r])``) lands in ``out``. ``buf`` is used as scratch: its other chunks are clobbered.
    n must be a power of two (the group uses the ring otherwise).

    Sends: log2(n) exchanges, with partners rank ^ n/2, ^ n/4, ..., ^ 1: in each, the half of the
    chunks still in play that this rank gives up goes to the partner, whose copy of the other half
    comes back and is reduced into this rank's.
    """
    n, r = t.size, t.rank
    if n & (n - 1):
        raise ValueError(f"rank {r}: halving.reduce_scatter needs a power-of-two group, got {n} ranks")
    starts = offsets(counts) + [sum(counts)]
    if n == 1:
        if not same_memory(out, buf):
            out[...] = buf
        return
    halve_blocks(t, buf, starts, out, reduce_ufunc(op, buf), r, range(n), _scratch(workspace, buf, starts, r, n))


def halve_blocks(t, buf, starts, out, ufunc, me, ranks, scratch, *, last=1) -> int:
    """The halving rounds of :func:`reduce_scatter` among ``p = len(ranks)`` (a power of two)
    participants numbered 0..p-1, ``me`` being this one and ``ranks[f]`` the transport rank of f.
    Block f is ``buf[starts[f]:starts[f+1]]``; ``scratch`` holds at least the largest half received.

    With ``last=1`` it runs every round and this participant's block, reduced over all, lands in
    ``out``. With ``last=2`` it stops one round early (``out`` unused), leaving the two blocks
    ``lo, lo+1`` reduced over every participant but the partner ``me ^ 1``. Returns ``lo``, the
    first block still held."""
    lo, mask = 0, len(ranks) // 2  # blocks lo..lo+2*mask-1 are in play
    while mask >= last:
        if me & mask:  # keep the upper half, give up the lower one
            keep, give = lo + mask, lo
        else:
            keep, give = lo, lo + mask
        acc = buf[starts[keep]:starts[keep + mask]]
        send = buf[starts[give]:starts[give + mask]]
        incoming = scratch[:acc.size]
        partner = me ^ mask
        doubling.swap(t, send, incoming, ranks[partner], TAG)
        dst = out if mask == 1 else acc  # the last round writes the finished block straight to ``out``
        if partner < me:
            ufunc(incoming, acc, out=dst)
        else:
            ufunc(acc, incoming, out=dst)
        lo, mask = keep, mask // 2
    return lo


def all_reduce(t, buf, op, *, workspace=None) -> None:
    """Every rank's ``buf`` becomes the elementwise ``op`` over all ranks, in place: Rabenseifner's
    algorithm, a recursive-halving reduce-scatter then a recursive-doubling all-gather, over p
    chunks (p the largest power of two <= n; the other n - p ranks fold in and out).

    Sends (in folded numbering): log2(p) exchanges of shrinking halves (p/2, p/4, .., 1 chunks) with
    partners rank ^ p/2, .., ^ 2, ^ 1, then log2(p) of growing blocks (1, 2, .., p/2 chunks) with
    partners rank ^ 1, ^ 2, .., ^ p/2; 2(p-1)/p of ``buf`` in all. Merged (small buffers), the two
    middle exchanges with rank ^ 1 become one swap of 2 chunks. The 2(n - p) folded ranks add one
    whole buffer in before (even rank to the odd one after it) and one out after.
    """
    n = t.size
    if n == 1:
        return
    ufunc = reduce_ufunc(op, buf)
    workspace = workspace if workspace is not None else Workspace()
    p = 1 << (n.bit_length() - 1)  # the largest power of two <= n
    extra = n - p
    incoming = workspace.get("halving", buf.dtype, buf.size if extra else 0, like=buf)
    me = doubling.fold_in(t, buf, ufunc, incoming, TAG)  # this rank among the p that go on
    if me is None:
        return

    ranks = [2 * f + 1 if f < extra else f + extra for f in range(p)] if extra else range(p)  # folded -> rank
    base, longer = divmod(buf.size, p)
    starts = [f * base + min(f, longer) for f in range(p + 1)]  # chunk f: buf[starts[f]:starts[f+1]]
    scratch = _scratch(workspace, buf, starts, me, p)
    if p == 2 or 2 * buf.nbytes >= MERGE_BELOW_BYTES * p:  # the plain algorithm: reduce-scatter, then all-gather
        halve_blocks(t, buf, starts, buf[starts[me]:starts[me + 1]], ufunc, me, ranks, scratch)
        doubling.gather_blocks(t, buf, starts, me, ranks)
    else:  # the last halving round and the first doubling one, merged into one swap of the two chunks left
        lo = halve_blocks(t, buf, starts, None, ufunc, me, ranks, scratch, last=2)
        pair = buf[starts[lo]:starts[lo + 2]]
        partner = me ^ 1
        incoming = scratch[:pair.size]
        doubling.swap(t, pair, incoming, ranks[partner], TAG)
        if partner < me:
            ufunc(incoming, pair, out=pair)
        else:
            ufunc(pair, incoming, out=pair)
        doubling.gather_blocks(t, buf, starts, me, ranks, mask=2)
    doubling.fold_out(t, buf, TAG)


def _scratch(workspace, buf, starts, me, p):
    """Room for the largest piece received: the first halving round's, half of ``buf`` or one
    element more (array_split puts the longer chunks first); with p = 2, the whole buffer."""
    half = buf.size if p == 2 else starts[p // 2] if me < p // 2 else starts[p] - starts[p // 2]
    return (workspace if workspace is not None else Workspace()).get("halving", buf.dtype, half, like=buf)
