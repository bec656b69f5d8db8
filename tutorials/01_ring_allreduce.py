"""Lesson 1: from one message to the ring all-reduce.

    mpiexec -n 4 python tutorials/01_ring_allreduce.py                  # 4 processes, over MPI
    python tutorials/01_ring_allreduce.py --local 4                     # 4 threads in one process
    python tutorials/01_ring_allreduce.py --local 4 --png ring.png      # and draw the ring's steps

Data-parallel training ends every step with an all-reduce: each rank holds its own gradients and
needs the sum over all ranks. This lesson builds that all-reduce by hand from the only thing a
network offers, a message from one rank to another, then checks it against numpy and against the
library's ring, ``group.all_reduce(x, algorithm="ring")``.

The ring: n ranks stand in a circle, each sends only to its right neighbour and receives only from
its left one. The buffer (N bytes) is cut into n chunks (``numpy.array_split``: the first ones may
hold one element more). Two phases of n-1 steps each:

  reduce-scatter  step s: rank r sends chunk r-s-1 to the right and adds the chunk r-s-2 it receives
                  into its own copy. After n-1 steps rank r holds chunk r summed over all ranks.
  all-gather      step s: rank r sends chunk r-s (complete) to the right and stores the complete
                  chunk r-s-1 it receives. After n-1 steps every rank holds every summed chunk.

Rank r sends every chunk but its own in the first phase and every chunk but chunk r+1 in the
second: 2N - c_r - c_(r+1) bytes, where c_i is chunk i's size. Summed over the ranks that is
2(n-1) N, so on average each rank sends 2(n-1)/n N, exactly that when the chunks are equal: a bit
less than twice the buffer, however many ranks there are. That is why NCCL, Horovod and this
library use the ring for large buffers. The lesson counts the bytes its ring sent, per rank,
asserts them equal to the formula, and checks the count against the group's trace (each
``sendrecv`` is recorded with the bytes it sent and received).

The library does not always run the ring: ``algorithm="auto"`` (the default) picks recursive
doubling below ``group.threshold_bytes`` (256 KiB): log2(n) messages, each of the whole buffer,
against the ring's 2(n-1) messages of one chunk each. For a small buffer the fixed cost of a
message (latency) dominates, so fewer, larger messages win. The lesson asks "auto" for its choice
(read back from the trace) at the lesson's size and at the threshold.

Part 3 shows what goes wrong when ranks do not play along, on 4 ranks as threads: one rank asks for 4
float64 while the others ask for 8 float32 (the same 32 bytes: the ring alone would happily add them
up), and one rank that stays away from an all-reduce (it leaves only once the others have given
up on it). Before every collective each rank swaps a 56-byte fingerprint of the call with its two
ring neighbours, so the first is caught before any data moves; the second ends in a time-out whose
census names the absent rank, not the neighbour waiting on it.

Picture: ``--png PATH`` draws this run's ring: per step (rows) and rank (columns) every chunk,
shaded by the share of the final sum it holds (read from the buffers rank 0 gathered), the finished
ones outlined, and which chunk went to which rank.
"""
import argparse
import threading

import numpy as np

import minidist
from minidist.comm import CollectiveMismatchError, CommTimeoutError
from minidist.launch_check import check_launch

COUNT = 10  # elements in each rank's buffer; with 4 ranks the chunks hold 3, 3, 2, 2


def show(group, title, x, n_chunks=1, notes=None):
    """Print every rank's ``x`` on rank 0, in rank order, cut into ``n_chunks`` chunks, each rank's
    line followed by its ``notes`` string, if any. Each rank sends its ``x`` to rank 0, which receives
    them one by one (a tiny "gather" built from point-to-point messages). Returns, on rank 0, every
    rank's ``x`` stacked (n, len(x)); elsewhere None."""
    if group.rank != 0:
        group.send(x, 0)
        return None
    print(f"\n{title}")
    rows = []
    for r in range(group.size):
        theirs = x.copy() if r == 0 else np.empty_like(x)
        if r != 0:
            group.recv(theirs, r)
        rows.append(theirs)
        chunks = " | ".join(" ".join(f"{v:3d}" for v in c) for c in np.array_split(theirs, n_chunks))
        print(f"  rank {r}: [ {chunks} ]{notes[r] if notes else ''}")
    return np.stack(rows)  # (n, len(x))


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


def ring_all_reduce(group, x, final=None):
    """Sum ``x`` over all ranks, in place, with the ring; prints every rank's buffer after each step
    (with the chunk each rank sent, and, given the ``final`` sum, which chunks are complete).

    Returns ``sent``: one row per step, (chunk index sent, to rank, bytes); and on rank 0 the
    buffers of every rank before and after each step, (2(n-1) + 1, n, len(x)) (else None)."""
    n, r = group.size, group.rank
    right, left = (r + 1) % n, (r - 1) % n
    chunks = np.array_split(x, n)  # views into x: writing a chunk writes x
    sent, buffers = [], [show(group, "before: rank r holds (r+1) * [1..COUNT], cut into chunks", x, n)]

    def step(title, send_index, recv_index, reduce):
        send, recv = chunks[send_index], chunks[recv_index]
        received = np.empty_like(recv)
        group.sendrecv(send, right, received, left)
        if reduce:
            recv += received  # my copy of this chunk now includes one more rank
        else:
            recv[...] = received  # a complete chunk: copy, don't add
        sent.append((send_index, right, send.nbytes))
        notes = notes_for(group, send_index, right, x, final)
        buffers.append(show(group, title, x, n, notes))

    def name(k):  # chunk r-k, counted around the ring (mod n)
        return f"r-{k}" if k % n else "r"

    for s in range(n - 1):
        step(f"reduce-scatter step {s + 1}/{n - 1}: sent chunk {name(s + 1)}, added chunk {name(s + 2)}",
             (r - s - 1) % n, (r - s - 2) % n, reduce=True)
    for s in range(n - 1):
        step(f"all-gather step {s + 1}/{n - 1}: sent chunk {name(s)}, stored chunk {name(s + 1)}",
             (r - s) % n, (r - s - 1) % n, reduce=False)
    return np.array(sent), (np.stack(buffers) if r == 0 else None)


def notes_for(group, chunk, to, x, final):
    """Rank 0 collects, for each rank's line of ``show``, what that rank just sent and which of its
    chunks already hold the final sum (``complete``); other ranks return None."""
    n = group.size
    done = [i for i, (c, f) in enumerate(zip(np.array_split(x, n), np.array_split(final, n)))
            if np.array_equal(c, f)] if final is not None else []
    mine = np.array([chunk, to, *[i in done for i in range(n)]], np.int64)  # (2 + n,)
    everyone = group.all_gather(mine).reshape(n, 2 + n)  # (n, 2 + n): a tiny all-gather of the notes
    if group.rank != 0:
        return None
    return [f"   sent chunk {c} -> rank {t}; complete: "
            + (",".join(str(i) for i in range(n) if flags[i]) or "-") for c, t, *flags in everyone]


def per_rank_formula(count, n, itemsize):
    """Bytes rank r sends in a ring all-reduce of ``count`` elements: 2N - c_r - c_(r+1)."""
    c = [len(part) for part in np.array_split(np.zeros(count), n)]
    return [(2 * count - c[r] - c[(r + 1) % n]) * itemsize for r in range(n)]


def count_bytes(group, sent, itemsize, ring_events):
    """Section 2b: the bytes each rank's ring sent, gathered on every rank, against the formula;
    checked against the trace: the ring's sendrecv events carry what it sent AND received."""
    n = group.size
    mine = int(sent[:, 2].sum())
    traced = sum(e.nbytes for e in ring_events)
    everyone = group.all_gather(np.array([mine, traced])).reshape(n, 2)  # (n, 2)
    formula = per_rank_formula(COUNT, n, itemsize)
    received = everyone[(group.rank - 1) % n, 0]  # what my left neighbour sent, I received
    wrong = mine != formula[group.rank] or traced != mine + received
    if group.rank == 0:
        N = COUNT * itemsize
        print(f"\n=== 2b. bytes each rank sent in its ring ({2 * (n - 1)} sendrecv calls; N = {N} B) ===")
        print("  rank   measured   formula 2N - c_r - c_(r+1)   the trace's sendrecv bytes (sent + received)")
        for r in range(n):
            print(f"  {r:>4} {everyone[r, 0]:>8} B {formula[r]:>14} B {everyone[r, 1]:>22} B "
                  f"= {everyone[r, 0]} + {everyone[(r - 1) % n, 0]}")
        mean = everyone[:, 0].sum() / n
        print(f"  mean {mean:.1f} B = 2(n-1)/n x N = 2 x {n - 1}/{n} x {N} = {2 * (n - 1) * N / n:.1f} B "
              f"({2 * (n - 1) / n:.3g} x the buffer; with equal chunks every rank sends exactly that)")
        if everyone[:, 0].sum() != 2 * (n - 1) * N:
            wrong = True
    return wrong


def library(group, start, hand_written):
    """Section 2c: the library's ring on the same buffers, and what "auto" picks (read from the
    trace) for this buffer and for one of ``group.threshold_bytes``. Returns (wrong, picked)."""
    ring = group.all_reduce(start(group.rank), algorithm="ring")
    with group.trace.capture() as events:
        group.all_reduce(start(group.rank))  # algorithm="auto"
        group.all_reduce(np.zeros(group.threshold_bytes // 8))  # the threshold's size, auto too
    picked = [e.algorithm for e in events if e.op == "all_reduce"]
    return not np.array_equal(ring, hand_written), picked


ALGORITHMS = {"ring": ": the ring, as above",
              "halving": " (Rabenseifner's: on a power-of-two group, a reduce-scatter by recursive halving and\n"
                         "  an all-gather by doubling: the ring's 2(n-1)/n bytes in 2 log2(n) rounds,\n"
                         "  one fewer on 4+ ranks while half the buffer's chunks are small: the middle two merge)"}


def show_library(group, picked):
    n = group.size
    print("\n=== 2c. the library: group.all_reduce(x, algorithm=\"ring\") = the hand-written ring ===")
    print(f"  The lesson names the ring: \"auto\" (the default) picked {picked[0]!r} for these {COUNT * 8} B "
          f"(read from the trace),\n  as it does below group.threshold_bytes = {group.threshold_bytes:,} B: "
          f"log2(n) rounds, each sending the whole buffer, instead of\n  the ring's 2(n-1) = {2 * (n - 1)} "
          f"messages of one chunk; for a small buffer each message's fixed cost (latency) is what counts.\n"
          f"  At {group.threshold_bytes:,} B \"auto\" picked {picked[1]!r}{ALGORITHMS.get(picked[1], '')}.")


def lesson(group):
    """The whole lesson on one rank; returns (on rank 0) what ``draw`` needs, elsewhere None."""
    point_to_point(group)
    n = group.size
    if group.rank == 0:
        sizes = [len(c) for c in np.array_split(np.zeros(COUNT), n)]
        print(f"\n=== 2. ring all-reduce of {COUNT} elements (chunks of {sizes}) ===")

    def start(rank):  # rank r starts with (r + 1) * [1, 2, ..., COUNT]
        return (rank + 1) * np.arange(1, COUNT + 1, dtype=np.int64)  # (COUNT,)

    expected = sum(start(r) for r in range(n))  # numpy, in one process
    x = start(group.rank)
    with group.trace.capture() as events:
        sent, buffers = ring_all_reduce(group, x, final=expected)
    ring_events = [e for e in events if e.kind == "p2p" and e.op == "sendrecv"]

    wrong = not np.array_equal(x, expected)
    wrong |= count_bytes(group, sent, x.itemsize, ring_events)
    library_wrong, picked = library(group, start, x)
    wrong |= library_wrong
    n_wrong = group.all_reduce(np.array([int(wrong)]))[0]  # how many ranks got something wrong
    if n_wrong:
        raise AssertionError(f"{n_wrong} rank(s) got a wrong all-reduce or byte count")
    everyone_sent = group.all_gather(sent).reshape(n, len(sent), 3)  # (n, steps, 3)
    if group.rank != 0:
        return None
    show_library(group, picked)
    print(f"\nall ranks agree with numpy and with group.all_reduce(algorithm=\"ring\"): {x.tolist()}; "
          f"bytes sent = 2N - c_r - c_(r+1) on every rank")
    return buffers, everyone_sent, expected


def exercises(n):
    """The lesson's closing exercises, with what the learner should see (same formula as above)."""
    def line(count, ranks):
        sizes = [len(c) for c in np.array_split(np.zeros(count), ranks)]
        per_rank = per_rank_formula(count, ranks, 8)
        return (f"chunks {sizes}; bytes sent per rank {per_rank}, mean {sum(per_rank) / ranks:.1f} "
                f"= 2 x {ranks - 1}/{ranks} x {count * 8} B")
    print("\nTry:")
    print(f"  1. --local 3 (or mpiexec -n 3): uneven chunks. Expect in 2b: {line(COUNT, 3)}.")
    print(f"  2. COUNT = 2 (fewer elements than ranks) with {n} ranks: empty chunks, sent as 0-byte messages. "
          f"Expect\n     {line(2, n)}; the empty chunks are\n     'complete' from the start.")


def draw(path, buffers, sent, expected):
    """The ring as this run did it: a row per step, a column per rank, each chunk shaded by the share
    of the final sum it holds, complete chunks outlined, and an arrow label for the chunk sent."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    steps, n, count = buffers.shape  # (2(n-1) + 1, n, COUNT)
    final_chunks = np.array_split(expected, n)
    fig, axes = plt.subplots(steps, n, figsize=(2.3 * n + 2.2, 0.75 * steps + 1.0), squeeze=False)
    cmap = plt.get_cmap("Blues")
    for s in range(steps):
        for r in range(n):
            ax = axes[s, r]
            ax.set_xlim(0, n)
            ax.set_ylim(0, 1)
            ax.axis("off")
            for c, (mine, final) in enumerate(zip(np.array_split(buffers[s, r], n), final_chunks)):
                share = float(mine[0] / final[0]) if len(mine) else 1.0
                done = np.array_equal(mine, final)
                ax.add_patch(Rectangle((c + 0.05, 0.35), 0.9, 0.55, facecolor=cmap(share),
                                       edgecolor="darkgreen" if done else "grey", linewidth=2.5 if done else 0.6))
                ax.text(c + 0.5, 0.62, str(c), ha="center", va="center", fontsize=8,
                        color="white" if share > 0.6 else "black")
            if s > 0:
                chunk, to, nbytes = sent[r, s - 1]
                ax.text(n / 2, 0.12, f"sent chunk {chunk} -> rank {to} ({nbytes} B)", ha="center", va="center", fontsize=7)
            if s == 0:
                ax.set_title(f"rank {r}", fontsize=9)
        phase = "before" if s == 0 else (f"reduce-scatter {s}" if s < n else f"all-gather {s - n + 1}")
        axes[s, 0].text(-0.15, 0.5, phase, transform=axes[s, 0].transAxes, ha="right", va="center", fontsize=8)
    handles = [Patch(facecolor=cmap(0.9), edgecolor="darkgreen", linewidth=2.5, label="complete: the final sum"),
               Patch(facecolor=cmap(0.4), edgecolor="grey", label="partial: some ranks' share")]
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 0.85), fontsize=8, frameon=False)
    bar = fig.add_axes([1.02, 0.12, 0.015, 0.45])
    fig.colorbar(plt.cm.ScalarMappable(norm=plt.Normalize(0, 1), cmap=cmap.resampled(256)), cax=bar)
    bar.set_ylabel("share of the final sum the chunk holds", fontsize=8)
    bar.tick_params(labelsize=7)
    fig.suptitle(f"Ring all-reduce of {count} elements on {n} ranks: each step, each rank sends one chunk right",
                 fontsize=10)
    fig.subplots_adjust(left=0.14, right=0.98, top=0.9, bottom=0.02, hspace=0.15, wspace=0.05)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"\nthe ring's steps drawn in {path}")


def main():
    p = argparse.ArgumentParser(description="Lesson 1: point-to-point, then the ring all-reduce by hand.")
    p.add_argument("--local", type=int, metavar="N", help="run N ranks as threads in this process")
    p.add_argument("--png", metavar="PATH", help="draw the ring's steps, as this run did them, into PATH")
    args = p.parse_args()
    check_launch(p, args, ranks=range(2, 9), alone=4)  # alone: 4 ranks as threads (a ring of one shows nothing)
    if args.local:
        drawing = minidist.run_local(lesson, args.local)[0]
        n = args.local
    else:
        group = minidist.init(backend="ring")
        drawing, n = lesson(group), group.size
        if group.rank != 0:
            return
    if args.png:
        draw(args.png, *drawing)
    when_ranks_disagree()
    exercises(n)
    print("\nAll checks passed: the hand-written ring = numpy = the library's ring, "
          "and each rank sent the bytes the formula says.")


def when_ranks_disagree():
    """Part 3, on 4 in-process ranks: a mismatched call, then a rank that never arrives."""
    print("\n=== 3. when ranks disagree (4 ranks as threads) ===")

    def odd_dtype(group):  # rank 2 asks for 4 float64, the others for 8 float32: 32 bytes each
        x = np.ones(4, np.float64) if group.rank == 2 else np.ones(8, np.float32)
        try:
            group.all_reduce(x)
        except CollectiveMismatchError as e:  # ranks 1, 2 and 3: each differs from a neighbour
            return str(e)
        except CommTimeoutError:  # rank 0 agrees with both its neighbours: it stops at its wait on them
            return None

    told = minidist.run_local(odd_dtype, 4, timeout=5.0)
    assert told[0] is None and all(told[1:]), told
    print(f"caught before any data moved (rank 1's error; ranks 2 and 3 raise theirs):\n  {told[1]}")

    together, gave_up = threading.Barrier(3), threading.Semaphore(0)

    def absent(group):  # rank 3 stays away from the all-reduce that the others wait in
        if group.rank == 3:  # alive but elsewhere, until every waiting rank has timed out and taken its census
            for _ in range(3):
                gave_up.acquire(timeout=60)  # a safety net only: they give up after the 1 s time-out
            return None
        try:
            together.wait()  # the waiting ranks enter together, so their census windows meet
            group.all_reduce(np.ones(4))
        except CommTimeoutError as e:
            return str(e)
        finally:
            gave_up.release()

    messages = [m for m in minidist.run_local(absent, 4, timeout=1.0) if m]
    # a rank that waited on another waiting rank: its own peer is not to blame, the census says who is
    shown = next((m for m in messages if "for rank 3," not in m), messages[0])
    print(f"every waiting rank's time-out names the rank that never came:\n  {shown}")


if __name__ == "__main__":
    main()
