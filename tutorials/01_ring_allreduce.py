"""Lesson 1: from one message to the ring all-reduce.

    mpiexec -n 4 python tutorials/01_ring_allreduce.py      # 4 processes, over MPI
    python tutorials/01_ring_allreduce.py --local 4         # 4 threads in one process

Data-parallel training ends every step with an all-reduce: each rank holds its own gradients and
needs the sum over all ranks. This lesson builds that all-reduce by hand from the only thing a
network offers, a message from one rank to another, then checks it against numpy and against the
library's ``group.all_reduce``.

The ring: n ranks stand in a circle, each sends only to its right neighbour and receives only from
its left one. The buffer is cut into n chunks (``numpy.array_split``: the first ones may hold one
element more). Two phases of n-1 steps each:

  reduce-scatter  step s: rank r sends chunk r-s-1 to the right and adds the chunk r-s-2 it receives
                  into its own copy. After n-1 steps rank r holds chunk r summed over all ranks.
  all-gather      step s: rank r sends chunk r-s (complete) to the right and stores the complete
                  chunk r-s-1 it receives. After n-1 steps every rank holds every summed chunk.

Each rank sends 2(n-1) chunks, i.e. 2(n-1)/n of the buffer, however many ranks there are: that is
why NCCL, Horovod and this library use the ring for large buffers.

Part 3 shows what goes wrong when ranks do not play along, on 4 ranks as threads: one rank asks for 4
float64 while the others ask for 8 float32 (the same 32 bytes: the ring alone would happily add them
up), and one rank that sleeps through an all-reduce. Before every collective each rank swaps a
56-byte fingerprint of the call with its two ring neighbours, so the first is caught before any data
moves; the second ends in a time-out whose census names the sleeper, not the neighbour waiting on it.
"""
import argparse
import time

import numpy as np

import minidist
from minidist.comm import CollectiveMismatchError, CommTimeoutError

COUNT = 10  # elements in each rank's buffer; with 4 ranks the chunks hold 3, 3, 2, 2


def show(group, title, x, n_chunks=1):
    """Print every rank's ``x`` on rank 0, in rank order, cut into ``n_chunks`` chunks. Each rank
    sends its ``x`` to rank 0, which receives them one by one (a tiny "gather" built from
    point-to-point messages)."""
    if group.rank != 0:
        group.send(x, 0)
        return
    print(f"\n{title}")
    for r in range(group.size):
        theirs = x.copy() if r == 0 else np.empty_like(x)
        if r != 0:
            group.recv(theirs, r)
        chunks = " | ".join(" ".join(f"{v:3d}" for v in c) for c in np.array_split(theirs, n_chunks))
        print(f"  rank {r}: [ {chunks} ]")


def point_to_point(group):
    """A send/recv pair, then every rank passes its number to its right neighbour at once."""
    if group.rank == 0:
        print(f"=== 1. point to point, {group.size} ranks ===")
    message = np.zeros(3, np.int64)
    if group.rank == 0:
        message[:] = [7, 8, 9]
        group.send(message, 1)  # blocks until the buffer may be reused
    elif group.rank == 1:
        group.recv(message, 0)  # blocks until the data has arrived
    show(group, "rank 0 sent [7 8 9] to rank 1; each rank's buffer:", message)

    right, left = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    mine, got = np.array([group.rank]), np.empty(1, np.int64)
    # Everyone sends and receives at the same time: sendrecv posts the receive first, so no rank
    # waits for a neighbour that is itself waiting to send.
    group.sendrecv(mine, right, got, left)
    show(group, "sendrecv around the ring: each rank received its left neighbour's number", got)


def ring_all_reduce(group, x):
    """Sum ``x`` over all ranks, in place, with the ring; prints every rank's buffer after each step."""
    n, r = group.size, group.rank
    right, left = (r + 1) % n, (r - 1) % n
    chunks = np.array_split(x, n)  # views into x: writing a chunk writes x
    for s in range(n - 1):
        send, recv = chunks[(r - s - 1) % n], chunks[(r - s - 2) % n]
        received = np.empty_like(recv)
        group.sendrecv(send, right, received, left)
        recv += received  # reduce: my copy of this chunk now includes one more rank
        show(group, f"reduce-scatter step {s + 1}/{n - 1}: sent chunk r-{s + 1}, added chunk r-{s + 2}", x, n)
    for s in range(n - 1):
        send, recv = chunks[(r - s) % n], chunks[(r - s - 1) % n]
        received = np.empty_like(recv)
        group.sendrecv(send, right, received, left)
        recv[...] = received  # a complete chunk: copy, don't add
        sent = f"r-{s}" if s else "r"
        show(group, f"all-gather step {s + 1}/{n - 1}: sent chunk {sent}, stored chunk r-{s + 1}", x, n)
    return x


def lesson(group):
    """The whole lesson on one rank; returns this rank's all-reduced buffer."""
    point_to_point(group)
    if group.rank == 0:
        sizes = [len(c) for c in np.array_split(np.zeros(COUNT), group.size)]
        print(f"\n=== 2. ring all-reduce of {COUNT} elements (chunks of {sizes}) ===")

    def start(rank):  # rank r starts with (r + 1) * [1, 2, ..., COUNT]
        return (rank + 1) * np.arange(1, COUNT + 1, dtype=np.int64)  # (COUNT,)

    x = start(group.rank)
    show(group, f"before: rank r holds (r+1) * [1..{COUNT}], cut into {group.size} chunks", x, group.size)
    ring_all_reduce(group, x)

    expected = sum(start(r) for r in range(group.size))  # numpy, in one process
    library = group.all_reduce(start(group.rank))        # the library's (this small: recursive doubling)
    wrong = not (np.array_equal(x, expected) and np.array_equal(x, library))
    if wrong:
        print(f"rank {group.rank}: hand-written {x}, numpy {expected}, library {library}", flush=True)
    n_wrong = group.all_reduce(np.array([int(wrong)]))[0]  # how many ranks got it wrong
    if n_wrong:
        raise AssertionError(f"{n_wrong} rank(s) got a wrong all-reduce")
    if group.rank == 0:
        print(f"\nall ranks agree with numpy and with group.all_reduce: {x.tolist()}")
    return x


def main():
    p = argparse.ArgumentParser(description="Lesson 1: point-to-point, then the ring all-reduce by hand.")
    p.add_argument("--local", type=int, metavar="N", help="run N ranks as threads in this process")
    args = p.parse_args()
    if args.local is not None and args.local < 2:
        p.error("the lesson needs at least 2 ranks")
    if args.local:
        minidist.run_local(lesson, args.local)
    else:
        group = minidist.init(backend="ring")
        lesson(group)
        if group.rank != 0:
            return
    when_ranks_disagree()


def when_ranks_disagree():
    """Part 3, on 4 in-process ranks: a mismatched call, then a rank that never arrives."""
    print("\n=== 3. when ranks disagree (4 ranks as threads) ===")

    def odd_dtype(group):  # rank 2 asks for 4 float64, the others for 8 float32: 32 bytes each
        x = np.ones(4, np.float64) if group.rank == 2 else np.ones(8, np.float32)
        group.all_reduce(x)

    try:
        minidist.run_local(odd_dtype, 4)
    except CollectiveMismatchError as e:
        print(f"caught before any data moved:\n  {e}")

    def sleeper(group):  # rank 3 sleeps through the all-reduce that the others wait in
        if group.rank == 3:
            time.sleep(1.5)
            return None
        try:
            group.all_reduce(np.ones(4))
        except CommTimeoutError as e:
            return str(e)

    messages = [m for m in minidist.run_local(sleeper, 4, timeout=0.5) if m]
    # a rank that waited on another waiting rank: its own peer is not to blame, the census says who is
    shown = next((m for m in messages if "for rank 3," not in m), messages[0])
    print(f"every waiting rank's time-out names the rank that never came:\n  {shown}")


if __name__ == "__main__":
    main()
