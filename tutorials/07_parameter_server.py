"""Lesson 7: parameter servers, synchronous and asynchronous.

    mpiexec -n 4 python tutorials/07_parameter_server.py             # 1 server + 3 workers, over MPI
    python tutorials/07_parameter_server.py --local 4                # the same as threads
    mpiexec -n 4 python tutorials/07_parameter_server.py --plot DIR  # also draw who waits for whom

Before the ring all-reduce took over, data parallelism ran on parameter servers (DistBelief, Li et
al. 2014): some ranks only keep the parameters, the others (workers) only compute gradients. Each
step a worker PUSHES its gradient to the servers and PULLS the new parameters back, by plain
point-to-point messages. Rank 0..k-1 are servers; the flat parameter vector is cut over them
(numpy.array_split), each keeping its piece and that piece's optimizer state.

1. Synchronous: a server waits for all W gradients, averages them, updates once. Workers took
   equal row-slices of the batch, so the average is the full-batch gradient: we check that the
   weights equal one process's, to 1e-10.
2. Asynchronous: a server applies each gradient (times 1/W) as soon as it arrives and answers with
   its newest parameters. Nobody waits for a slow worker, but gradients are computed on STALE
   parameters: staleness = updates applied between the pull and the push. A bound s keeps every
   worker at most s steps ahead of the slowest. We slow worker 0 down and count.
3. Traffic: per step a server moves W/k gradient pieces in and W/k parameter pieces out; a ring
   all-reduce rank sends 2(N-1)/N of the gradient whatever N is. One server is the bottleneck.
"""
import argparse
import contextlib
import io
from collections import Counter
from pathlib import Path

import numpy as np

import minidist
from minidist.parallel.param_server import staleness_bound, train_parameter_server
from minidist.parallel.ps_timeline import gather_traces, plot_timeline
from minidist.train import train
from minidist.train_build import build_model, load_data
from minidist.train_config import TrainConfig

CFG = TrainConfig(steps=12, batch_size=6, dtype="float64", optimizer="adamw", n_layer=1, n_embd=32, n_head=2,
                  block_size=32, eval_iters=1, sample_tokens=0)
STRAGGLER = 0.03  # seconds added to every step of worker 0


def run(group, servers, staleness, straggler=0.0):
    """Train CFG with parameter servers; returns (model, rank 0's history, traces on rank 0)."""
    group.trace.clear()
    model = build_model(CFG)
    history = train_parameter_server(group, model, CFG, load_data(CFG)[0], servers=servers,
                                     staleness=staleness, straggler=straggler)
    return model, history, gather_traces(group, group.trace)


def lesson(group, plot_dir=None):
    lead = group.rank == 0
    workers = group.size - 1
    labels = ["server 0"] + [f"worker {w}" + (" (slow)" if w == 0 else "") for w in range(workers)]

    # 1. synchronous equals one process
    model, history, traces = run(group, servers=1, staleness=None)
    if lead:
        with contextlib.redirect_stdout(io.StringIO()):
            reference, _ = train(CFG, progress=False)
        ref = reference.state_dict()
        err = max(np.abs(model.state_dict()[k] - v).max() / np.abs(v).max() for k, v in ref.items())
        print(f"=== 1. synchronous, 1 server + {workers} workers ===")
        print(f"loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}; weights vs one process: "
              f"max relative error {err:.1e}")
        assert err <= 1e-10

    # 2. a straggler: synchronous waits for it, asynchronous does not (as far as the bound allows)
    for staleness in (None, 1, 8):
        model, history, traces = run(group, servers=1, staleness=staleness, straggler=STRAGGLER)
        if not lead:
            continue
        if staleness is None:
            sync_traces = traces
        mode = "synchronous" if staleness is None else f"asynchronous, staleness bound {staleness}"
        print(f"\n=== 2. {mode}, worker 0 sleeps {1e3 * STRAGGLER:.0f} ms per step ===")
        print(f"{len(history)} updates in {history[-1]['time']:.2f} s, loss {history[-1]['loss']:.4f}")
        for rank, (label, t) in enumerate(zip(labels, traces)):
            waited = sum(e.duration for e in t.events if e.kind == "wait")
            updates = "" if rank == 0 or staleness is None else \
                f", {sum(r['worker'] == rank for r in history)} updates"
            print(f"  {label:<16} waited {1e3 * waited:7.1f} ms{updates}")
        if staleness is not None:
            counts = Counter(r["staleness"] for r in history)
            print("  staleness of the updates: " + ", ".join(f"{s}: {counts[s]}x" for s in sorted(counts))
                  + f"  (bound (W-1)(2s+1) = {staleness_bound(workers, staleness)})")
            assert max(counts) <= staleness_bound(workers, staleness)
        if plot_dir is not None:
            path = Path(plot_dir) / f"ps_timeline_{'sync' if staleness is None else f'async_s{staleness}'}.png"
            plot_timeline(traces, path, labels, title=mode + ", worker 0 straggles")
            print(f"  timeline: {path}")

    # 3. traffic per step, measured from the traces of the synchronous run
    if lead:
        n_bytes = sum(p.data.nbytes for p in model.parameters())

        def moved(t, ops):  # every message (the first pull too: a little over), per step, in models
            return sum(e.nbytes for e in t.events if e.op in ops) / CFG.steps / n_bytes

        print(f"\n=== 3. traffic per step, in models ({n_bytes:,} bytes) ===")
        for label, t in zip(labels, sync_traces):
            print(f"  {label:<16} out {moved(t, ('send', 'isend')):5.2f}  in {moved(t, ('recv', 'irecv')):5.2f}")
        print(f"  ring all-reduce over {workers} ranks: out {2 * (workers - 1) / workers:.2f}  "
              f"in {2 * (workers - 1) / workers:.2f} on every rank")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local", type=int, default=0, help="run N ranks as threads instead of under mpiexec")
    p.add_argument("--plot", default=None, help="directory for the timeline pictures")
    args = p.parse_args()
    if args.plot:
        Path(args.plot).mkdir(parents=True, exist_ok=True)
    if args.local:
        minidist.run_local(lambda group: lesson(group, args.plot), args.local)
    else:
        lesson(minidist.init(), args.plot)


if __name__ == "__main__":
    main()
