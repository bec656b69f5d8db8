"""Lesson 2: data parallelism. Gradient buckets, all-reduces hidden under backward, accumulation.

    mpiexec -n 2 python tutorials/02_data_parallel.py                  # 2 processes, over MPI (or -n 4)
    python tutorials/02_data_parallel.py --local 2                     # 2 threads in one process
    mpiexec -n 2 python tutorials/02_data_parallel.py --png dp.png     # and draw the bucket timeline

Every rank holds the whole GPT and trains on its own rows of the global batch; before the optimizer
step the ranks AVERAGE their gradients with an all-reduce, so every replica takes the same step as
one process on the full batch would (minidist/parallel/data/data_parallel.py, PyTorch's DDP written out).

  1. The buckets. Gradients live in a few flat buffers, filled in REVERSE parameter order (the order
     backward finishes them): one all-reduce per bucket, not one per parameter.
  2. The overlap. During one backward, a bucket is full as soon as its last gradient is final; its
     all-reduce is queued at once on the group's communication thread and runs while backward goes
     on with the earlier layers. Drawn from the trace, per rank: how much of the communication was
     hidden under backward, and how much ran after it (exposed: what the step waits for).
     The share is a measurement of milliseconds on a busy machine, so it varies from pass to pass:
     the lesson times 10 backward passes and prints the median with min and max, and the arithmetic
     behind it. t_backward is how long backward computes; t_comm how long the same all-reduces take
     ALONE (timed again after backward, nothing else running). Communication can only start once
     the first bucket is full (t_first), so at most min(t_comm, t_backward - t_first) of it can hide.
     Then why less, and why so variable: in CPython the communication thread needs the interpreter
     lock (GIL) that backward holds between NumPy calls, so a queued all-reduce may wait up to the
     switch interval (5 ms) before it starts (the '.' in the timeline), and while it runs it shares
     the cores with backward (of this rank and, on 2 cores, of the other ranks): overlapped, the
     all-reduces take longer than alone. An all-reduce also waits for the slowest rank, so a rank
     whose backward ran fast shows its all-reduces "running" (waiting) under its own backward,
     while the slow rank sees them after: the ranks' shares differ even in one pass.
     A bucket-size sweep shows the trade: small buckets start early (more can hide) but pay each
     message's fixed cost more often; one big bucket cannot start before backward ends (0% hidden).
  3. Accumulation. Two micro-batches per step: the first backward runs inside ``no_sync()`` and sends
     nothing; the second launches the all-reduces of the SUM of both.
  4. The proof: averaged gradients, then the weights after a few SGD-with-momentum steps, equal one
     process's on the full batch (float64), and all replicas are bitwise identical.

Picture: ``--png PATH`` draws this run's median backward pass per rank: a grey backward bar on top,
then per bucket a black tick where its all-reduce was queued, a pale orange wait and a red run, and a
dashed line where backward ends (red right of it is exposed). Each panel's title is the line the
lesson prints for that rank; the figure's title is what the step waits for after backward against
t_comm alone, with what the overlap saved (negative on a busy 2-core machine: the picture says so
too). Below, the bucket-size sweep in two panels: left, blue bars per rank, the % of the all-reduce
time under backward, each labelled (a 1 MiB bucket's 0% too); right, orange lines per rank, the ms
the step waits after backward, t_comm alone dotted.
"""
import argparse
import time

import numpy as np

import minidist
from minidist.data import ByteTokenizer, get_batch, grammar_text
from minidist.launch_check import check_launch
from minidist.model import GPT, GPTConfig
from minidist.optim import SGD
from minidist.parallel.data.data_parallel import DataParallel
from minidist.parallel.data.sampler import dp_rows, micro_batches
from minidist.parallel.state import WholeState
from minidist.parallel.step import forward_backward, train_step

CONFIG = GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=64)
B = 8                       # rows of the global batch; dp rank r trains on dp_rows(B, r, n)
BUCKET_BYTES = 128 * 1024   # small on purpose: 7 buckets for this 0.9 MB (float64) model
STEPS, LR, MOMENTUM = 3, 0.1, 0.9
PASSES = 10                 # backward passes timed in section 2 (the median is printed, with min and max)
SWEEP = (32 * 1024, 128 * 1024, 512 * 1024, 1024 * 1024)  # bucket sizes compared in section 2 (1 MiB: one bucket)
SWEEP_PASSES = 6
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


def draw_text(times):
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


def pass_words(times):
    """One pass of one rank in the words the lesson prints and its picture's panel repeats."""
    exposed = max(0.0, times[:-1, 3].max() - times[-1, 0])
    return (f"{100 * hidden_share(times):.0f}% of its all-reduce time ran while backward was still computing, "
            f"{exposed:.2f} ms after it (exposed)")


def verdict(t_comm, exposed):
    """What the overlap saved, in the words the lesson prints and its picture's title repeats."""
    return (f"{exposed:.2f} ms after backward (exposed, median), against t_comm = {t_comm:.2f} ms without overlap: "
            f"saved {t_comm - exposed:+.2f} ms")


def summary(times):
    """One pass's numbers (ms, share): (hidden share, exposed ms = how long the last all-reduce ran
    after backward ended, t_backward, t_first = when the first bucket was full, all-reduce time)."""
    buckets, backward_end = times[:-1], times[-1, 0]
    return (hidden_share(times), max(0.0, buckets[:, 3].max() - backward_end), backward_end,
            buckets[:, 0].min(), float((buckets[:, 3] - buckets[:, 2]).sum()))


def comm_alone(group, dp, repeats=PASSES):
    """t_comm: the median time of the same all-reduces (every bucket, in order) with nothing else
    running, on copies of the buckets (the gradients stay as they are)."""
    copies = [b.buffer.copy() for b in dp.buckets]
    seconds = []
    for _ in range(repeats + 1):  # the first is a warm-up
        group.barrier()
        t = time.perf_counter()
        for c in copies:
            group.all_reduce(c, op="avg")
        seconds.append(time.perf_counter() - t)
    return 1e3 * float(np.median(seconds[1:]))


def passes(group, model, dp, n_passes):
    """``n_passes`` traced backward passes (after one untimed warm-up). Returns every rank's numbers,
    (n, n_passes, 5) as :func:`summary`, the index of the median pass (by the ranks' mean hidden
    share: the same pass on every rank) and its times on every rank (n, buckets + 1, 4), and the
    parameters that filled each bucket."""
    one_backward(group, model, dp)
    runs = [one_backward(group, model, dp) for _ in range(n_passes)]
    numbers = np.array([summary(t) for t, _ in runs])  # (n_passes, 5)
    everyone = group.all_gather(numbers).reshape(group.size, n_passes, 5)
    shares = everyone[:, :, 0].mean(axis=0)  # (n_passes,)
    median = int(np.argsort(shares)[n_passes // 2])
    times = runs[median][0]
    timelines = group.all_gather(times).reshape(group.size, *times.shape)  # (n, buckets + 1, 4)
    return everyone, median, timelines, runs[median][1]


def show_overlap(group, model, dp):
    """Section 2: every rank traces PASSES backward passes; rank 0 prints the fill order, the
    median, min and max of the hidden share per rank, the median pass's timelines, the arithmetic
    t_comm against t_backward, and a bucket-size sweep. Returns what the picture needs (rank 0)."""
    everyone, median, timelines, filled_by = passes(group, model, dp, PASSES)
    t_comm = comm_alone(group, dp)
    sweep = [sweep_row(group, size) for size in SWEEP]
    if group.rank != 0:
        return None
    n, nbytes = group.size, sum(b.nbytes for b in dp.buckets)
    print("\n=== 2. backward: buckets fill in index order, each all-reduce is queued the moment "
          "its bucket is full ===")
    for i, name in enumerate(filled_by):
        print(f"  bucket {i} full when the gradient of {short(name)} was final (rank 0, median pass: "
              f"{timelines[0, i, 0]:.2f} ms into backward)")
    print(f"  {PASSES} backward passes per rank: share of the all-reduce time that ran while backward was still "
          f"computing,\n  and exposed ms (all-reduce still running after backward ended: what the step waits for)")
    for r in range(n):
        share, exposed = 100 * everyone[r, :, 0], everyone[r, :, 1]
        print(f"  rank {r}: median {np.median(share):3.0f}% of the all-reduce time ran while backward was still "
              f"computing (min {share.min():.0f}%, max {share.max():.0f}%); exposed median "
              f"{np.median(exposed):.2f} ms (min {exposed.min():.2f}, max {exposed.max():.2f})")
    print(f"  the median pass ({median + 1} of {PASSES}), per rank:")
    for r in range(n):
        print(f"  rank {r}: {pass_words(timelines[r])}")
        print(draw_text(timelines[r]))
    print("  '^' queued, '.' waiting for the communication thread, '#' all-reduce running (waiting for the\n"
          "  other rank included). What runs after the '=' ends is the communication backward did not hide.")

    t_backward, t_first = np.median(everyone[:, :, 2]), np.median(everyone[:, :, 3])
    t_overlapped, exposed = np.median(everyone[:, :, 4]), np.median(everyone[:, :, 1])
    can_hide = min(t_comm, t_backward - t_first)
    print(f"\n  The arithmetic (medians over ranks and passes): t_backward = {t_backward:.2f} ms; the first bucket "
          f"is full at\n  t_first = {t_first:.2f} ms; the {len(dp.buckets)} all-reduces ALONE take t_comm = "
          f"{t_comm:.2f} ms ({nbytes / 1024:.0f} KiB, {n} ranks, nothing else running).\n"
          f"  At most min(t_comm, t_backward - t_first) = {can_hide:.2f} ms = {100 * can_hide / t_comm:.0f}% of "
          f"t_comm can hide under backward.\n"
          f"  Overlapped they took {t_overlapped:.2f} ms ({t_overlapped / t_comm:.1f} x t_comm): here communication "
          f"is CPU work\n  (copies, additions, the transport's polling) sharing the cores and the GIL with backward, "
          f"and it waits\n  for the slower rank. So the share moves with whatever else the machine does. What counts "
          f"is what the\n  step waits for,\n  {verdict(t_comm, exposed)}.\n"
          f"  On GPUs with NCCL the all-reduces run beside the compute kernels: there a hidden share is time saved.")
    print("\n  Bucket-size sweep (a fresh DataParallel each; medians of "
          f"{SWEEP_PASSES} passes; hidden % and exposed ms per rank):")
    print("  bucket KiB  buckets  t_comm alone" + "".join(f"  | rank {r}: hidden  exposed" for r in range(n)))
    for size, count, alone, numbers in sweep:
        print(f"  {size // 1024:>10} {count:>8} {alone:>10.2f} ms"
              + "".join(f"  | {100 * np.median(numbers[r, :, 0]):>13.0f}% {np.median(numbers[r, :, 1]):>6.2f} ms"
                        for r in range(n)))
    print("  Small buckets start sooner but pay each message's fixed cost more often; one bucket holding "
          "everything\n  is queued only when backward has ended: nothing hides, the whole t_comm is exposed.")
    return timelines, [b.index for b in dp.buckets], sweep, median, verdict(t_comm, exposed)


def sweep_row(group, bucket_bytes):
    """One row of the sweep: (bucket bytes, buckets, t_comm alone in ms, every rank's pass numbers
    (n, SWEEP_PASSES, 5)), on a fresh model and DataParallel with ``bucket_bytes``."""
    model = GPT(CONFIG, seed=0, dtype="float64")
    dp = DataParallel(model, group, bucket_bytes=bucket_bytes)
    numbers = passes(group, model, dp, SWEEP_PASSES)[0]
    return bucket_bytes, len(dp.buckets), comm_alone(group, dp), numbers


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
        train_step(model, WholeState(model, optimizer), global_batch(step), LR, grad_clip=0)
    return model.state_dict()


def train_and_check(group, model, dp):
    """Section 4's second half: STEPS data-parallel SGD steps, then weights vs one process and
    every replica vs rank 0's, bit for bit."""
    optimizer = SGD(model.named_parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        train_step(model, WholeState(model, optimizer, dp), my_rows(group, step), LR, grad_clip=0)  # dp: its buckets
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
    """The whole lesson on one rank; returns, on rank 0, what :func:`draw` needs (else None)."""
    model = GPT(CONFIG, seed=0, dtype="float64")
    dp = DataParallel(model, group, bucket_bytes=BUCKET_BYTES)  # broadcasts rank 0's weights
    show_buckets(group, dp)
    drawing = show_overlap(group, model, dp)
    overlapped = {name: p.grad.copy() for name, p in model.named_parameters()}
    accumulated = show_accumulation(group, model, dp)
    if group.rank == 0:
        print(f"\n=== 4. against one process on all {B} rows ===")
    reference = one_process_gradients()
    check(group, "averaged gradients (section 2)", worst_error(overlapped, reference))
    check(group, "accumulated gradients (section 3)", worst_error(accumulated, reference))
    train_and_check(group, model, dp)
    return drawing


def exercises(sweep):
    """The closing exercises, with what the learner should see (bucket counts from this run's sweep)."""
    counts = {size: count for size, count, _, _ in sweep}
    small, whole = SWEEP[0], SWEEP[-1]
    print("\nTry:")
    print(f"  1. BUCKET_BYTES = {small // 1024} * 1024. Expect '=== 1. {counts[small]} buckets of >= {small // 1024} KiB',"
          f" 'backward of micro-batch 1:\n     {counts[small]} all-reduces started', and a hidden share near the "
          f"sweep's first row: many small all-reduces, the first\n     one queued early.")
    print(f"  2. BUCKET_BYTES = {whole // 1024} * 1024. Expect '=== 1. {counts[whole]} buckets', the one '^' at the "
          f"end of the backward line, about 0%\n     hidden and an exposed time of about t_comm: the sweep's "
          f"last row. Then -n 4: each rank backpropagates\n     B/4 = 2 rows (t_backward shrinks) while "
          f"the all-reduces span 4 ranks (t_comm grows): less can hide.")


def draw(path, timelines, buckets, sweep, median, saved):
    """This run's median backward pass per rank (backward; per bucket queued, waiting, running) and
    the bucket-size sweep (hidden share and exposed ms per size); the titles say what section 2
    printed: each rank's median pass, and ``saved``, what the overlap saved (:func:`verdict`)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(timelines)
    fig = plt.figure(figsize=(11, 2.0 * n + 3.2))
    grid = fig.add_gridspec(n + 1, 2, height_ratios=[1.6] * n + [1.6])
    axes = [fig.add_subplot(grid[r, :]) for r in range(n)]
    end = max(float(t[:-1, 3].max()) for t in timelines) * 1.02
    colors = {"backward": "#9e9e9e", "waiting": "#fdd49e", "running": "#d7301f"}
    for r, (ax, t) in enumerate(zip(axes, timelines)):
        rows, backward_end = t[:-1], float(t[-1, 0])
        labels = ["backward"] + [f"bucket {i}" for i in buckets]
        ax.broken_barh([(0, backward_end)], (len(rows) - 0.4, 0.8), color=colors["backward"])
        for i, (_, queued, start, stop) in enumerate(rows):
            y = len(rows) - 1 - i
            ax.broken_barh([(queued, start - queued)], (y - 0.35, 0.7), color=colors["waiting"])
            ax.broken_barh([(start, stop - start)], (y - 0.35, 0.7), color=colors["running"])
            ax.plot([queued], [y], marker="|", color="black", markersize=9)
        ax.axvline(backward_end, color="black", linestyle="--", linewidth=0.8)
        ax.set_yticks(range(len(rows), -1, -1), labels, fontsize=8)
        ax.set_xlim(0, end)
        ax.set_title(f"rank {r}, the median pass ({median + 1} of {PASSES}): {pass_words(t)}", fontsize=9, loc="left")
        ax.set_xlabel("ms from the start of backward", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    handles = [Patch(color=colors["backward"], label="backward computing"),
               Patch(color=colors["waiting"], label="queued, waiting for the\ncommunication thread"),
               Patch(color=colors["running"], label="all-reduce running\n(incl. waiting for the other ranks)"),
               plt.Line2D([], [], color="black", marker="|", linestyle="", markersize=9, label="bucket full: queued"),
               plt.Line2D([], [], color="black", linestyle="--", linewidth=0.8, label="backward ends")]
    axes[0].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)

    sizes = [f"{size // 1024} KiB\n({count} bucket{'s' if count > 1 else ''})" for size, count, _, _ in sweep]
    x = np.arange(len(sweep))
    width = 0.8 / n
    hidden, waits = fig.add_subplot(grid[n, 0]), fig.add_subplot(grid[n, 1])
    for r in range(n):
        shares = [100 * np.median(numbers[r, :, 0]) for *_, numbers in sweep]
        bars = hidden.bar(x + (r - (n - 1) / 2) * width, shares, width, label=f"rank {r}",
                          color=plt.get_cmap("Blues")(0.45 + 0.4 * r / max(1, n - 1)), edgecolor="black", linewidth=0.5)
        hidden.bar_label(bars, [f"{v:.0f}%" for v in shares], fontsize=8)  # a 0% bar still says 0%
    hidden.set_xticks(x, sizes, fontsize=8)
    hidden.set_xlabel("bucket size", fontsize=9)
    hidden.set_ylabel("% of the all-reduce time\nrun under backward", fontsize=9)
    hidden.set_ylim(0, 115)
    hidden.set_yticks([0, 25, 50, 75, 100])
    hidden.tick_params(axis="y", labelsize=8)
    hidden.set_title("sweep: how much of the all-reduce hides (median)", fontsize=9, loc="left")
    hidden.legend(fontsize=8, frameon=False, loc="upper right", ncol=n)
    for r in range(n):
        waits.plot(x, [np.median(numbers[r, :, 1]) for *_, numbers in sweep], marker="o",
                   color=plt.get_cmap("Oranges")(0.5 + 0.4 * r / max(1, n - 1)), label=f"rank {r}: exposed after backward")
    waits.plot(x, [alone for _, _, alone, _ in sweep], marker="s", linestyle=":", color="black",
               label="t_comm: the all-reduces alone")
    waits.set_xticks(x, sizes, fontsize=8)
    waits.set_xlabel("bucket size", fontsize=9)
    waits.set_ylabel("ms", fontsize=9)
    waits.set_ylim(bottom=0)
    waits.tick_params(axis="y", labelsize=8)
    waits.set_title("sweep: what the step waits for after backward (median)", fontsize=9, loc="left")
    waits.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"Data parallelism on {n} ranks: the step waits {saved}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"\nthe bucket timeline and the sweep drawn in {path}")


def main():
    p = argparse.ArgumentParser(description="Lesson 2: data parallelism, buckets and overlap.")
    p.add_argument("--local", type=int, metavar="N", help="run N ranks as threads in this process")
    p.add_argument("--png", metavar="PATH", help="draw the bucket timeline of this run into PATH")
    args = p.parse_args()
    check_launch(p, args, ranks=(2, 4), alone=2)  # B = 8 rows: each rank's share cut into 2 micro-batches
    if args.local:
        drawing = minidist.run_local(lesson, args.local)[0]
    else:
        group = minidist.init(backend="ring")
        drawing = lesson(group)
        if group.rank != 0:
            return
    if args.png:
        draw(args.png, *drawing)
    exercises(drawing[2])
    print("\nAll checks passed: averaged and accumulated gradients and the weights = one process's; "
          "the replicas agree bitwise.")


if __name__ == "__main__":
    main()
