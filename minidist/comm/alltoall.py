"""All-to-all: every rank sends a different chunk to every rank (personalised exchange).

Rank r's buffer is cut into n chunks (``send_counts``); chunk j goes to rank j, and rank r's output
is the chunks it receives from ranks 0..n-1, laid end to end in rank order (``recv_counts``). Nothing
is reduced: each byte crosses one link once, so every rank sends (n-1)/n of its buffer whatever the
algorithm, and the algorithms differ only in how the n-1 messages are ordered in time.

- pairwise exchange (large messages): in step s = 1..n-1 rank r sends its chunk for r+s and receives
  the chunk from r-s, with one sendrecv (receive posted first), so two ranks swapping with each other
  never deadlock. At every step each rank has exactly one message in and one out: no rank is
  flooded, and the step's buffers are the only ones in flight.
- scattered (small messages): post the n-1 receives, then the n-1 sends (to r+1, r+2, ...: each rank
  starts with a different peer, so no rank gets everyone's first message at once), then wait for
  all. One round of latency instead of n-1 dependent ones, at the price of 2(n-1) messages in flight
  at once. MPICH's ``MPI_Alltoallv`` does the same ("scattered", throttled in blocks).

Rank r's own chunk is a local copy. Both algorithms send exactly one message each way between every
pair of ranks, on ``TAG_ALL_TO_ALL``, so they match whichever each rank picked: ranks may choose
differently (with uneven counts each picks by its own chunk size) and still agree.

Every message is posted even when empty: a transport checks each message's size against the receive
buffer, so a peer that sends a different count than this rank expects fails loudly on the receiving
rank (``ValueError`` naming the peer and both sizes) instead of leaving stale bytes in the output.
"""
from __future__ import annotations

import numpy as np

from minidist.comm.ops import offsets
from minidist.comm.tags import TAG_ALL_TO_ALL, TAG_ALL_TO_ALL_COUNTS
from minidist.comm.transport import wait_all

SCATTERED_BELOW_BYTES = 1024 * 1024
""":func:`pick` takes the scattered exchange when this rank's mean chunk is smaller than this, else
the pairwise one (``ProcessGroup(scattered_below_bytes=...)`` overrides it). Measured with
``benchmarks/collectives.py --all-to-all-algorithms`` over MPI on the 2-core VM (benchmarks/RESULTS.md,
"all_to_all"): with 2 ranks the two are one exchange and differ by noise. With 4 and 8 ranks and chunks
under 1 MiB, scattered took 0.36-0.87 of pairwise's time in all 14 comparisons: n-1 dependent steps,
each waiting for a peer to be scheduled, cost more than the messages. From 1 MiB chunks the two
split 16 comparisons evenly, scattered winning by at most 18%, pairwise by up to 1.8x (8 ranks,
4 MiB chunks: 14 large messages in flight per rank against 2). So pairwise from there; MPICH
switches at 32 KiB messages."""

ALGORITHMS = ("pairwise", "scattered")


def pick(nbytes: int, n: int, below: int = SCATTERED_BELOW_BYTES) -> str:
    """The algorithm for a rank sending ``nbytes`` in all to ``n`` ranks: "scattered" when its mean
    chunk (``nbytes / n``) is under ``below`` bytes, else "pairwise"."""
    return "scattered" if nbytes < below * n else "pairwise"


def all_to_all(t, send, send_counts, recv, recv_counts, *, algorithm: str = "pairwise", tag: int = TAG_ALL_TO_ALL):
    """Send ``send``'s chunk j (``send_counts[j]`` elements, at ``sum(send_counts[:j])``) to rank j and
    receive rank j's chunk for this rank into ``recv`` at ``sum(recv_counts[:j])`` (``recv_counts[j]``
    elements). ``send`` and ``recv`` are flat and must not overlap.

    Sends: one message to every other rank (its chunk, possibly empty) on ``tag``; receives one from
    each. ``algorithm``: "pairwise" (n-1 steps of one sendrecv) or "scattered" (all at once)."""
    n, r = t.size, t.rank
    s_at, r_at = offsets(send_counts), offsets(recv_counts)

    def outgoing(j):
        return send[s_at[j]:s_at[j] + send_counts[j]]

    def incoming(j):
        return recv[r_at[j]:r_at[j] + recv_counts[j]]

    if recv_counts[r] != send_counts[r]:
        raise ValueError(f"rank {r}: sends {send_counts[r]} elements to itself but expects {recv_counts[r]}")
    incoming(r)[...] = outgoing(r)
    if algorithm == "pairwise":
        for s in range(1, n):
            dst, src = (r + s) % n, (r - s) % n
            t.sendrecv(outgoing(dst), dst, incoming(src), src, tag)
    elif algorithm == "scattered":
        peers = [(r + s) % n for s in range(1, n)]  # r+1, r+2, ...: each rank starts somewhere else
        requests = [t.irecv(incoming(j), j, tag) for j in reversed(peers)]  # r-1, r-2, ...: first to arrive
        requests += [t.isend(outgoing(j), j, tag) for j in peers]
        wait_all(requests)
    else:
        raise ValueError(f"rank {r}: all_to_all algorithm must be 'pairwise' or 'scattered', got {algorithm!r}")


def exchange_counts(t, send_counts, recv_counts=None) -> tuple[list[int], list[str]]:
    """Tell every rank how much this rank sends it and learn how much each sends this rank.

    Returns the counts each rank sends this rank, and a sentence for each pair whose counts disagree:
    a peer sending this rank other than ``recv_counts`` (when given) says, or expecting from this rank
    other than ``send_counts`` says. Both ranks of such a pair see it.

    Sends: two int64 to every rank, ``send_counts[j]`` and what this rank expects from j
    (``recv_counts[j]``, or -1 when it does not know), a scattered all-to-all on
    ``TAG_ALL_TO_ALL_COUNTS``; host memory, whatever the data's device.

    ``ProcessGroup.all_to_all`` calls it when the counts are learned (``send_counts`` alone: how each
    rank learns what it will receive, and sizes its output only then), and when they are given on
    backends "mpi" and "nccl" with ``check_calls`` (the default), or in ``debug`` mode on every
    backend: MPI and NCCL do not notice a message shorter than its receive, so what each rank expects
    is compared with what its peers send first (both ranks of a pair that disagree raise
    CollectiveMismatchError; ``check_calls=False`` trusts the counts, as MPI and NCCL do). On backend
    "ring" the transport checks each message's size against its receive buffer, so no exchange is
    needed there."""
    n, r = t.size, t.rank
    mine = np.empty((n, 2), np.int64)  # (peer, [sent to it, expected from it])
    mine[:, 0] = send_counts
    mine[:, 1] = recv_counts if recv_counts is not None else -1
    theirs = np.empty_like(mine)  # (peer, [it sends me, it expects from me])
    all_to_all(t, mine.reshape(-1), [2] * n, theirs.reshape(-1), [2] * n, algorithm="scattered",
               tag=TAG_ALL_TO_ALL_COUNTS)
    problems = []
    for j, (sends_me, expects) in enumerate(theirs.tolist()):
        if recv_counts is not None and sends_me != recv_counts[j]:
            problems.append(f"rank {j} sends {sends_me} rows to rank {r}, which expects {recv_counts[j]}")
        if expects >= 0 and expects != send_counts[j] and j != r:
            problems.append(f"rank {r} sends {send_counts[j]} rows to rank {j}, which expects {expects}")
    return theirs[:, 0].tolist(), problems
