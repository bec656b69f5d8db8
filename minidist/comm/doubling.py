"""Recursive doubling: the latency-optimal all-reduce, for small messages.

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
"""
from __future__ import annotations

from minidist.comm.ops import Workspace, reduce_ufunc
from minidist.comm.tags import TAG_DOUBLING as TAG


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
    p = 1 << (n.bit_length() - 1)  # the largest power of two <= n
    extra = n - p
    if r < 2 * extra:
        if r % 2 == 0:  # fold in: give my data to r+1, wait for the final result
            t.send(buf, r + 1, TAG)
            t.recv(buf, r + 1, TAG)
            return
        t.recv(incoming, r - 1, TAG)
        ufunc(incoming, buf, out=buf)
        folded = r // 2
    else:
        folded = r - extra
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
    if r < 2 * extra:
        t.send(buf, r - 1, TAG)
