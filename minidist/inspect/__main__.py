"""``python -m minidist.inspect RUN_DIR``: see what a run did.

    mpiexec -n 4 python -m minidist.train --dp 2 --tp 2 --steps 3 --trace runs/a --out runs/a
    python -m minidist.inspect runs/a

writes runs/a/trace.json (all ranks, for https://ui.perfetto.dev) and runs/a/timeline.png (one
step per rank: compute per module, communication per mesh axis, idle), and prints the communication
table (op, group, calls, bytes, time, algbw, busbw, and the label each call site gave: why it sent
what it sent) with its bytes per purpose, the memory table (each rank's bytes after the
last step and its peak during it) and, for a mixture of experts, the load per rank and per expert.
"""
import argparse
from pathlib import Path

from minidist.inspect.chrome import merge_chrome_trace
from minidist.inspect.load import load_run
from minidist.inspect.tables import comm_table, format_comm_table, format_expert_load, format_memory, format_purposes
from minidist.inspect.timeline import draw_run_timeline, step_title, step_window


def main(argv=None) -> None:
    """Entry point: read RUN_DIR, write the merged trace and the timeline, print the tables."""
    p = argparse.ArgumentParser(prog="python -m minidist.inspect", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a directory written by python -m minidist.train --trace DIR --out DIR")
    p.add_argument("--step", type=int, default=-1, help="the training step to draw (negative: from the last)")
    p.add_argument("--png", help="where to draw the timeline (default RUN_DIR/timeline.png)")
    args = p.parse_args(argv)
    run = load_run(args.run_dir)
    print(f"{args.run_dir}: {len(run.traces)} ranks, {sum(len(t.events) for t in run.traces):,} events")
    if run.metrics:
        first, last = run.metrics[0], run.metrics[-1]
        print(f"steps {first['step']}..{last['step']}: loss {first['loss']:.4f} -> {last['loss']:.4f}")
    print(f"merged trace: {merge_chrome_trace(run)}  (open in https://ui.perfetto.dev)")
    window = step_window(run.traces, args.step)
    png = Path(args.png) if args.png else run.path / "timeline.png"
    what = step_title(args.step) if window else "the whole trace"
    draw_run_timeline(png, run.traces, window, title=f"{run.path.name}: {what}, {len(run.traces)} ranks")
    print(f"timeline of {what}: {png}")
    print("\ncommunication, whole run:")
    rows = comm_table(run.traces, run.group_members())
    print(format_comm_table(rows))
    print(f"by purpose, all ranks together: {format_purposes(rows)}")
    print("\nmemory:")
    print(format_memory(run.memory))
    if any("expert_load" in m for m in run.metrics):
        print("\nexperts:")
        print(format_expert_load(run.metrics))


if __name__ == "__main__":
    main()
