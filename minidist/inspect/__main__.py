"""``python -m minidist.inspect RUN_DIR``: see what a run did.

    mpiexec -n 4 python -m minidist.train --dp 2 --tp 2 --steps 3 --trace runs/a --out runs/a
    python -m minidist.inspect runs/a

writes runs/a/trace.json (all ranks, for https://ui.perfetto.dev) and runs/a/timeline.png (one
step per rank: compute per module, communication per mesh axis, idle), and prints the communication
table (op, group, calls, bytes, time, algbw, busbw, and the label each call site gave: why it sent
what it sent) with its bytes per purpose, the memory table (each rank's bytes after the
last step and its peak during it), the metrics of a sample of steps and, for a mixture of experts,
the load per rank and per expert.

A folder with metrics but no trace (``--out DIR`` without ``--trace DIR``) prints its metrics and
says how to record a trace. A population-based training run's folder (``--mode pbt``: a run per
member in ``member-k/``) lists its members, each with its loss and the command that shows it. A
search's folder (``--mode search``: trials.jsonl) prints its trials as a table and draws
RUN_DIR/trials.png: each trial's loss against each hyper-parameter, the best loss against the steps spent. A run a crash stopped is read too: the line each rank was writing when it died is skipped, and
every complete event drawn; what was skipped is said on stderr. A folder that is not a run (missing,
empty, a file that is not what it should be) exits with status 2 and one line naming the file.
"""
import argparse
import sys
from pathlib import Path

from minidist.files import create
from minidist.inspect.chrome import merge_chrome_trace
from minidist.inspect.load import RunError, load_run, member_summary, population
from minidist.inspect.tables import (comm_table, format_comm_table, format_expert_load, format_memory, format_metrics,
                                     format_purposes)
from minidist.inspect.timeline import draw_run_timeline, step_title, step_window
from minidist.inspect.trials import draw_trials, format_trials, read_trials

MAX_DRAWN_RANKS = 64  # ranks a timeline draws (one figure of 64 ranks is already 60 inches tall)
MAX_DRAWN_EVENTS = 20_000  # bars a timeline draws (about 10 s of matplotlib)
NO_TRACE = "no trace here: add --trace DIR to the training command"


def build_parser() -> argparse.ArgumentParser:
    """The command line (its flags: what the fuzz tests generate arguments from)."""
    p = argparse.ArgumentParser(prog="python -m minidist.inspect", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a directory written by python -m minidist.train --trace DIR --out DIR")
    p.add_argument("--step", type=int, default=-1, help="the training step to draw (negative: from the last)")
    p.add_argument("--png", help="where to draw the timeline (default RUN_DIR/timeline.png)")
    return p


def _loss(value) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "null"


def draw(run, step: int, png: Path) -> str:
    """Draw step ``step`` of ``run``'s first :data:`MAX_DRAWN_RANKS` ranks to ``png`` (the whole
    trace when it has no optimizer spans); what was drawn, in words, or why nothing could be."""
    traces = [t for t in run.traces if t.events][:MAX_DRAWN_RANKS]
    if not traces:
        return "no timeline: the trace holds no complete event"
    try:
        window = step_window(traces, step)
    except ValueError as e:
        raise RunError(f"--step {step}: {e}") from e
    what = step_title(step) if window else "the whole trace"
    lo, hi = window or (min(e.start for t in traces for e in t.events), max(e.end for t in traces for e in t.events))
    if not hi > lo:
        return f"no timeline: the events of {what} take no time"
    starts = sorted(e.start for t in traces for e in t.events if e.end > lo and e.start < hi)
    if len(starts) > MAX_DRAWN_EVENTS:  # each is a bar to draw: the last ones, in bounded time
        lo, what = starts[-MAX_DRAWN_EVENTS], f"the last {MAX_DRAWN_EVENTS:,} events of {what}"
    shown = f", ranks {traces[0].rank}..{traces[-1].rank}" if len(traces) < len(run.traces) else ""
    with create(png) as f:  # never through a link or into a FIFO at --png
        draw_run_timeline(f, traces, (lo, hi), title=f"{run.path.name}: {what}, {len(traces)} ranks{shown}")
    return f"timeline of {what}{shown}: {png}"


def show_population(run_dir, members: list) -> None:
    """A population-based training run's folder: one line per member (ranks traced, its loss) and
    the command that shows that member's run; each member's run is a whole run of its own, so they
    are listed side by side, not drawn one after another."""
    print(f"{run_dir}: population-based training, {len(members)} members, each its own run (--mode pbt "
          f"writes member k's trace and metrics to member-k/); show one with the command beside it:")
    for folder in members:
        skipped = []
        ranks, metrics = member_summary(folder, skipped)
        for note in skipped:
            print(f"minidist.inspect: {folder.name}/{note}", file=sys.stderr)
        loss = (f"steps {metrics[0]['step']}..{metrics[-1]['step']}: loss {_loss(metrics[0].get('loss'))} -> "
                f"{_loss(metrics[-1].get('loss'))}" if metrics else "no metrics")
        print(f"  {folder.name}: {ranks} rank{'s' * (ranks != 1)} traced, {loss}    python -m minidist.inspect {folder}")
    if (Path(run_dir) / "pbt.jsonl").is_file():
        print(f"who copied whom at each ready point: {Path(run_dir) / 'pbt.jsonl'}")


def show_search(run_dir, png: Path) -> None:
    """A search's folder (``--mode search``): its trials as a table, and the picture of their losses
    against each hyper-parameter and of the best loss against the steps spent."""
    skipped = []
    rows = read_trials(Path(run_dir) / "trials.jsonl", skipped)
    for note in skipped:
        print(f"minidist.inspect: {note}", file=sys.stderr)
    print(f"{run_dir}: a hyper-parameter search, {len(rows)} trials (each its own run in trial-k/: show one with "
          f"python -m minidist.inspect {Path(run_dir) / 'trial-0'})")
    print(format_trials(rows))
    with create(png) as f:  # never through a link or into a FIFO at --png
        draw_trials(rows, f, f"{Path(run_dir).name}: {len(rows)} trials")
    print(f"the trials' losses and the best loss against the steps spent: {png}")


def inspect(args) -> None:
    """Read ``args.run_dir``, say what was skipped, write the merged trace and the timeline, print the
    tables; for a folder without a trace, its metrics tables and how to record one; for a population's
    folder, its members (:func:`show_population`); for a search's, its trials (:func:`show_search`)."""
    if (Path(args.run_dir) / "trials.jsonl").is_file():
        show_search(args.run_dir, Path(args.png) if args.png else Path(args.run_dir) / "trials.png")
        return
    try:
        run = load_run(args.run_dir)
    except FileNotFoundError:
        members = population(args.run_dir) if Path(args.run_dir).is_dir() else []
        if not members:
            raise
        show_population(args.run_dir, members)
        return
    for note in run.skipped:
        print(f"minidist.inspect: {note}", file=sys.stderr)
    print(f"{args.run_dir}: {len(run.traces)} ranks, {sum(len(t.events) for t in run.traces):,} events" if run.traces
          else f"{args.run_dir}: metrics, no trace")
    if run.metrics:
        first, last = run.metrics[0], run.metrics[-1]
        print(f"steps {first['step']}..{last['step']}: loss {_loss(first.get('loss'))} -> {_loss(last.get('loss'))}")
    if run.traces:
        print(f"merged trace: {merge_chrome_trace(run)}  (open in https://ui.perfetto.dev)")
        print(draw(run, args.step, Path(args.png) if args.png else run.path / "timeline.png"))
        print("\ncommunication, every event read:")
        rows = comm_table(run.traces, run.group_members())
        print(format_comm_table(rows))
        print(f"by purpose, all ranks together: {format_purposes(rows)}")
    if run.traces or run.memory:
        print("\nmemory:")
        print(format_memory(run.memory))
    print("\nmetrics:")
    print(format_metrics(run.metrics))
    if any("expert_load" in m for m in run.metrics):
        print("\nexperts:")
        print(format_expert_load(run.metrics))
    if not run.traces:
        print(f"\n{NO_TRACE}")


def main(argv=None) -> int:
    """Entry point: 0 when the run was read (some lines perhaps skipped), 2 when it cannot be."""
    args = build_parser().parse_args(argv)
    try:
        inspect(args)
    except (RunError, OSError) as e:
        print(f"minidist.inspect: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
