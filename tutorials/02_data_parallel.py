"""Lesson 2: data parallelism. Gradient buckets, all-reduces hidden under backward, accumulation.

    mpiexec -n 2 python tutorials/02_data_parallel.py      # 2 processes, over MPI (or -n 4)
    python tutorials/02_data_parallel.py --local 2         # 2 threads in one process

Every rank holds the whole GPT and trains on its own rows of the global batch; before the optimizer
step the ranks AVERAGE their gradients with an all-reduce, so every replica takes the same step as
one process on the full batch would (minidist/parallel/data_parallel.py, PyTorch's DDP written out).

  1. The buckets. Gradients live in a few flat buffers, filled in REVERSE parameter order (the order
     backward finishes them): one all-reduce per bucket, not one per parameter.
  2. The overlap. During one backward, a bucket is full as soon as its last gradient is final; its
     all-reduce is queued at once on the group's communication thread and runs while backward goes
     on with the earlier layers. Drawn from the trace, per rank: how much of the communication was
     hidden under backward. In CPython the communication thread needs the interpreter lock (GIL)
     that backward holds between NumPy calls, so a queued all-reduce may wait up to the switch
     interval (5 ms) before it starts: the '.' in the timeline.
  3. Accumulation. Two micro-batches per step: the first backward runs inside ``no_sync()`` and sends
     nothing; the second launches the all-reduces of the SUM of both.
  4. The proof: averaged gradients, then the weights after a few SGD-with-momentum steps, equal one
     process's on the full batch (float64), and all replicas are bitwise identical.
"""
import argparse
import time

import numpy as np

import minidist
from minidist.data import ByteTokenizer, get_batch, grammar_text
from minidist.model import GPT, GPTConfig
from minidist.optim import SGD
from minidist.parallel.data_parallel import DataParallel
from minidist.parallel.sampler import dp_rows, micro_batches
from minidist.parallel.step import forward_backward, train_step

CONFIG = GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=64)
B = 8                       # rows of the global batch; dp rank r trains on dp_rows(B, r, n)
BUCKET_BYTES = 128 * 1024   # small on purpose: 7 buckets for this 0.9 MB (float64) model
STEPS, LR, MOMENTUM = 3, 0.1, 0.9
TOKENS = ByteTokenizer().encode(grammar_text(20_000, seed=1))
WIDTH = 60                  # characters of the text timeline


def global_batch(step):
    return get_batch(TOKENS, step, B, CONFIG.block_size, seed=2)  # (B, T+1)


def my_rows(group, step):
    return global_batch(step)[dp_rows(B, group.rank, group.size)]  # (B/n, T+1)


def short(name):
    return name.removeprefix("transformer.")


def show_buckets(group, dp):
    """Rank 0 prints each bucket: its bytes and the parameters whose gradients are views into it."""
    if group.rank != 0:
        return
    total = sum(b.nbytes for b in dp.buckets)
    print(f"=== 1. {len(dp.buckets)} buckets of >= {BUCKET_BYTES // 1024} KiB, {total / 1024:.0f} KiB of "
          f"gradients in all, filled from the last parameter to the first ===")
    for b in dp.buckets:
        print(f"  bucket {b.index}  {b.nbytes / 1024:6.1f} KiB  {', '.join(map(short, b.names))}")


def watch_buckets(dp):
    """Note, during backward, when each bucket becomes full (and by which parameter) and when its
    all-reduce is queued: a second grad-ready hook on every parameter, run after DataParallel's own.
    Returns (full, queued, handles): dicts bucket index -> (seconds, name) and -> seconds."""
    full, queued, handles = {}, {}, []
    for b in dp.buckets:
        for name, p in zip(b.names, b.params):
            def hook(p, name=name):
                now = time.perf_counter()
                for other in dp.buckets:
                    if other.pending == 0:
                        full.setdefault(other.index, (now, name))
                    if other.work is not None:
                        queued.setdefault(other.index, now)
            handles.append(p.register_grad_ready_hook(hook))
    return full, queued, handles


def overlap(a_start, a_end, b_start, b_end):
    """Seconds that the intervals [a_start, a_end] and [b_start, b_end] share."""
    return max(0.0, min(a_end, b_end) - max(a_start, b_start))


def one_backward(group, model, dp):
    """One forward + backward + finish() on this rank's rows, traced. Returns a (buckets + 1, 4)
    array in ms from the start of backward: per bucket (full, queued, all-reduce start, end), and a
    last row (backward end, 0, 0, 0); and the last parameters that filled each bucket."""
    trace = group.trace
    full, queued, handles = watch_buckets(dp)
    trace.clear()
    dp.zero_grad()
    forward_backward(model, [my_rows(group, 0)], dp.no_sync, trace)
    dp.finish()
    for h in handles:
        h.remove()
    backward = next(e for e in trace.events if e.op == "backward")
    reduces = sorted((e for e in trace.events if e.op == "all_reduce"), key=lambda e: e.seq)  # one per bucket
    assert [e.nbytes for e in reduces] == [b.nbytes for b in dp.buckets], "one all-reduce per bucket, in order"
    t0 = backward.start
    rows = [[full[b.index][0] - t0, queued[b.index] - t0, e.start - t0, e.end - t0]
            for b, e in zip(dp.buckets, reduces)]
    rows.append([backward.end - t0, 0.0, 0.0, 0.0])
    return 1e3 * np.array(rows), [full[b.index][1] for b in dp.buckets]


def draw(times):
    """A text timeline of one rank: the backward span, and per bucket '^' where it was queued,
    '.' while it waited behind earlier all-reduces, '#' while its all-reduce ran."""
    buckets, backward_end = times[:-1], times[-1, 0]
    end = max(backward_end, buckets[:, 3].max())

    def col(ms):
        return min(WIDTH - 1, int(ms / end * WIDTH))

    lines = [f"    {'backward':<9} |{'=' * col(backward_end):<{WIDTH}}|  0 .. {backward_end:.2f} ms"]
    for i, (_, q, s, e) in enumerate(buckets):
        row = [" "] * WIDTH
        for c in range(col(q), col(s)):
            row[c] = "."
        for c in range(col(s), max(col(e), col(s) + 1)):
            row[c] = "#"
        row[col(q)] = "^"
        lines.append(f"    {f'bucket {i}':<9} |{''.join(row)}|  queued {q:6.2f}, ran {s:6.2f} .. {e:6.2f} ms")
    return "\n".join(lines)


def hidden_share(times):
    """The share of all-reduce time that ran while backward was still computing."""
    buckets, backward_end = times[:-1], times[-1, 0]
    busy = sum(e - s for _, _, s, e in buckets)
    return sum(overlap(s, e, 0.0, backward_end) for _, _, s, e in buckets) / busy


def show_overlap(group, model, dp):
    """Section 2: every rank traces one backward; rank 0 prints the fill order and all timelines."""
    times, filled_by = one_backward(group, model, dp)
    everyone = group.all_gather(times).reshape(group.size, *times.shape)  # (n, buckets + 1, 4)
    if group.rank != 0:
        return
    print("\n=== 2. one backward: buckets fill in index order, each all-reduce is queued the moment "
          "its bucket is full ===")
    for i, name in enumerate(filled_by):
        print(f"  bucket {i} full when the gradient of {short(name)} was final (rank 0: "
              f"{times[i, 0]:.2f} ms into backward)")
    for r, t in enumerate(everyone):
        print(f"  rank {r}: {100 * hidden_share(t):.0f}% of the all-reduce time ran while backward was "
              f"still computing")
        print(draw(t))
    print("  '^' queued, '.' waiting for the communication thread, '#' all-reduce running (waiting for the\n"
          "  other rank included). What runs after the '=' ends is the communication backward did not hide.")


def show_accumulation(group, model, dp, n_micro=2):
    """Section 3: one step of ``n_micro`` micro-batches; counts the all-reduces each backward
    started (from the trace) and returns this rank's accumulated, averaged gradients."""
    trace = group.trace
    trace.clear()
    dp.zero_grad()
    forward_backward(model, micro_batches(my_rows(group, 0), n_micro), dp.no_sync, trace)
    dp.finish()
    starts = [e.start for e in trace.events if e.op == "backward"] + [float("inf")]
    reduces = [e for e in trace.events if e.op == "all_reduce"]
    per_backward = [sum(starts[i] <= e.start < starts[i + 1] for e in reduces) for i in range(n_micro)]
    if group.rank == 0:
        print(f"\n=== 3. accumulation: {n_micro} micro-batches of {B // group.size // n_micro} rows per rank, "
              f"all but the last backward inside no_sync() ===")
        for i, count in enumerate(per_backward):
            print(f"  backward of micro-batch {i}: {count} all-reduces started")
    if per_backward != [0] * (n_micro - 1) + [len(dp.buckets)]:
        raise AssertionError(f"rank {group.rank}: all-reduces per backward {per_backward}, expected "
                             f"none until the last, then {len(dp.buckets)}")
    return {name: p.grad.copy() for name, p in model.named_parameters()}


def worst_error(values, reference):
    """Largest relative error over the parameters: max |value - ref| / max |ref|, per parameter."""
    return max(np.abs(values[name] - ref).max() / np.abs(ref).max() for name, ref in reference.items())


def check(group, title, worst, tolerance=1e-10):
    """Every rank learns whether any rank's ``worst`` error exceeds ``tolerance``, and all raise
    together (no rank is left waiting in a collective for one that has failed)."""
    worst_anywhere = group.all_reduce(np.array([worst]), op="max")[0]
    if worst_anywhere > tolerance:
        raise AssertionError(f"{title}: differs from one process by {worst_anywhere:.2e} (> {tolerance:.0e})")
    if group.rank == 0:
        print(f"  {title} = one process's on the full batch (worst relative error {worst_anywhere:.1e})")


def one_process_gradients():
    model = GPT(CONFIG, seed=0, dtype="float64")
    forward_backward(model, [global_batch(0)])
    return {name: p.grad.copy() for name, p in model.named_parameters()}


def one_process_weights():
    model = GPT(CONFIG, seed=0, dtype="float64")
    optimizer = SGD(model.named_parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        train_step(model, optimizer, global_batch(step), LR, grad_clip=0)
    return model.state_dict()


def train_and_check(group, model, dp):
    """Section 4's second half: STEPS data-parallel SGD steps, then weights vs one process and
    every replica vs rank 0's, bit for bit."""
    optimizer = SGD(model.named_parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        train_step(model, optimizer, my_rows(group, step), LR, grad_clip=0, dp=dp)
    state = model.state_dict()
    check(group, f"weights after {STEPS} SGD-momentum steps", worst_error(state, one_process_weights()))
    mine = np.concatenate([v.ravel() for v in state.values()])  # (P,)
    rank0 = group.broadcast(mine.copy(), src=0)
    n_different = group.all_reduce(np.array([int(not np.array_equal(mine, rank0))]))[0]
    if n_different:
        raise AssertionError(f"{n_different} replica(s) differ from rank 0's weights")
    if group.rank == 0:
        print(f"  all {group.size} replicas hold bitwise identical weights")


def lesson(group):
    model = GPT(CONFIG, seed=0, dtype="float64")
    dp = DataParallel(model, group, bucket_bytes=BUCKET_BYTES)  # broadcasts rank 0's weights
    show_buckets(group, dp)
    show_overlap(group, model, dp)
    overlapped = {name: p.grad.copy() for name, p in model.named_parameters()}
    accumulated = show_accumulation(group, model, dp)
    if group.rank == 0:
        print(f"\n=== 4. against one process on all {B} rows ===")
    reference = one_process_gradients()
    check(group, "averaged gradients (section 2)", worst_error(overlapped, reference))
    check(group, "accumulated gradients (section 3)", worst_error(accumulated, reference))
    train_and_check(group, model, dp)


def main():
    p = argparse.ArgumentParser(description="Lesson 2: data parallelism, buckets and overlap.")
    p.add_argument("--local", type=int, metavar="N", help="run N ranks as threads in this process")
    args = p.parse_args()
    if args.local is not None and args.local < 2:
        p.error("the lesson needs at least 2 ranks")
    if args.local:
        minidist.run_local(lesson, args.local)
    else:
        lesson(minidist.init(backend="ring"))


if __name__ == "__main__":
    main()
