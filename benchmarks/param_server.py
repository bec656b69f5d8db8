"""Parameter servers against ring all-reduce: traffic per rank, and sync vs async with a straggler.

    mpiexec -n 4 python benchmarks/param_server.py      # about a minute on 2 busy cores

1. Traffic (bytes in and out per rank per step, counted under the transport, in-process): parameter
   servers with k = 1, 2 servers and W = 3 workers, against a ring all-reduce of the same gradient on
   W ranks, for the default model.
2. Convergence (under MPI, 1 server + 3 workers, default model, default corpus): synchronous,
   asynchronous with staleness bound 1 and 8, each without and with a straggler (worker 0 sleeps
   STRAGGLER s per step). Loss against step and against wall time; staleness distributions.

Writes benchmarks/results/param_server.json and benchmarks/figures/param_server_{traffic,convergence}.png;
``python benchmarks/param_server.py --replot`` redraws the figures from the JSON without running.
"""
import argparse
import contextlib
import io
import json
from pathlib import Path

import numpy as np

import minidist
from minidist.comm import ProcessGroup, Transport
from minidist.parallel.ps.param_server import train_parameter_server
from minidist.train.build import build_model, load_data
from minidist.train.config import TrainConfig
from minidist.train.outputs import estimate_val_loss

HERE = Path(__file__).resolve().parent
CFG = TrainConfig(steps=150, batch_size=12, warmup=10, eval_iters=4)  # the default 2-layer, 64-wide GPT
STRAGGLER = 0.1
MODES = [("sync", None), ("async s=1", 1), ("async s=8", 8)]


class CountingTransport(Transport):
    """Wraps a transport and counts the bytes it sends and receives: what crosses this rank's link."""

    def __init__(self, inner, counts=None):
        self.inner, self.rank, self.size, self.timeout, self.name = inner, inner.rank, inner.size, inner.timeout, inner.name
        self.counts = counts if counts is not None else {"sent": 0, "received": 0}  # shared with sub-groups

    def isend(self, buf, peer, tag=0):
        self.counts["sent"] += buf.nbytes
        return self.inner.isend(buf, peer, tag)

    def irecv(self, buf, peer, tag=0):
        self.counts["received"] += buf.nbytes
        return self.inner.irecv(buf, peer, tag)

    def split(self, color, key):
        sub = self.inner.split(color, key)
        return None if sub is None else CountingTransport(sub, self.counts)


def traffic(servers, workers):
    """Bytes (out, in) per step on each rank: parameter servers (k servers, W workers), or ring
    all-reduce over W ranks when ``servers`` is 0. Runs of 2 and 4 steps are counted and
    subtracted, so the first pull and the final gather drop out: the steady state per step."""
    def run(steps):
        cfg = TrainConfig(**{**vars(CFG), "steps": steps, "batch_size": 6 * workers})
        tokens = load_data(cfg)[0]

        def rank(group):
            counted = ProcessGroup(CountingTransport(group.transport))
            model = build_model(cfg)
            if servers:
                train_parameter_server(counted, model, cfg, tokens, servers=servers)
            else:
                grad = np.concatenate([p.data.reshape(-1) for p in model.parameters()])
                for _ in range(steps):
                    counted.all_reduce(grad, algorithm="ring")
            return np.array([counted.transport.counts["sent"], counted.transport.counts["received"]])

        return minidist.run_local(rank, servers + workers)

    return [tuple(((b - a) / 2).tolist()) for a, b in zip(run(2), run(4))]


def convergence(world, staleness, straggler, tokens, val_tokens):
    model = build_model(CFG)
    history = train_parameter_server(world, model, CFG, tokens, servers=1, staleness=staleness, straggler=straggler)
    if world.rank == 0:
        return {"history": history, "val_loss": estimate_val_loss(model, val_tokens, CFG)}
    return None


def plot(results, path_traffic, path_convergence):
    """Draw the two figures from ``results`` (what main() saves as JSON): legends outside the axes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.transforms import blended_transform_factory

    model_bytes = results["model_bytes"]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    x, names, outs, ins, groups = 0.0, [], [], [], []
    positions = []
    for row in results["traffic"]:
        first = x
        for r, (out, inn) in enumerate(row["ranks"]):
            role = ("server" if r < row["servers"] else "worker") if row["servers"] else "ring rank"
            names.append(f"{role}\n{r}")
            outs.append(out / model_bytes)
            ins.append(inn / model_bytes)
            positions.append(x)
            x += 1
        groups.append(((first + x - 1) / 2, row["layout"]))
        x += 0.8  # a gap between layouts
    positions = np.array(positions)
    ax.bar(positions - 0.2, outs, 0.4, label="out (sent)", color="tab:blue")
    ax.bar(positions + 0.2, ins, 0.4, label="in (received)", color="tab:orange")
    ax.set_xticks(positions, names, fontsize=8)
    below = blended_transform_factory(ax.transData, ax.transAxes)
    for centre, layout in groups:
        ax.text(centre, -0.2, layout, transform=below, ha="center", va="top", fontsize=9, fontweight="bold")
    ax.set_ylabel("models per step")
    ax.set_title(f"Bytes through each rank's link per step (1 model = {model_bytes:,} B)", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False, fontsize=9)
    fig.subplots_adjust(left=0.07, right=0.85, top=0.9, bottom=0.26)
    fig.savefig(path_traffic, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(15, 5))
    W = 3
    colours = {"sync": "tab:blue", "async s=1": "tab:green", "async s=8": "tab:red"}
    handles = []
    stale = [run for run in results["runs"] if run["mode"] != "sync" and run["straggler"]]
    for run in results["runs"]:
        h = run["history"]
        x_step = np.array([r.get("update", W * (r["step"] + 1)) for r in h]) / W  # sync: one record per step
        window = 3 * W if "update" in h[0] else 3  # 3 steps: W updates a step asynchronously, 1 synchronously
        loss = np.convolve([r["loss"] for r in h], np.ones(window) / window, mode="valid")
        style = dict(color=colours[run["mode"]], linestyle="-" if run["straggler"] == 0 else "--", linewidth=1.2)
        label = f"{run['mode']}" + (f", worker 0 sleeps {1e3 * run['straggler']:.0f} ms a step" if run["straggler"]
                                    else ", no straggler")
        handles.append(axes[0].plot(x_step[-len(loss):], loss, label=label, **style)[0])
        axes[1].plot(np.array([r["time"] for r in h])[-len(loss):], loss, **style)
    width = 0.8 / len(stale)
    for k, run in enumerate(stale):
        counts = np.bincount([r["staleness"] for r in run["history"]])
        shown = np.flatnonzero(counts)
        axes[2].bar(shown + (k - (len(stale) - 1) / 2) * width, counts[shown] / counts.sum(), width,
                    color=colours[run["mode"]], hatch="//", edgecolor="white")
    axes[0].set(xlabel="step (updates / W)", ylabel="train loss (moving average of 3 steps)", title="loss against step")
    axes[1].set(xlabel="wall time (s)", ylabel="train loss (moving average of 3 steps)", title="loss against wall time")
    axes[2].set(xlabel="staleness (updates applied between pull and push)", ylabel="fraction of updates (log scale)",
                yscale="log", title="staleness with the straggler (asynchronous)")
    axes[2].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.legend(handles, [h.get_label() for h in handles], loc="lower center", ncol=3, fontsize=9, frameon=False)
    fig.suptitle(f"1 server + {W} workers, {results['config']['steps']} steps of gradient work "
                 f"({W * results['config']['steps']} worker gradients), AdamW", fontsize=11)
    fig.subplots_adjust(left=0.05, right=0.99, top=0.88, bottom=0.25, wspace=0.25)
    fig.savefig(path_convergence, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replot", action="store_true", help="only redraw the figures from results/param_server.json")
    if ap.parse_args().replot:
        results = json.loads((HERE / "results" / "param_server.json").read_text())
        plot(results, HERE / "figures" / "param_server_traffic.png", HERE / "figures" / "param_server_convergence.png")
        return
    world = minidist.init()
    with contextlib.redirect_stdout(io.StringIO()):
        tokens, val_tokens = load_data(CFG)
    runs = []
    for mode, staleness in MODES:
        for straggler in (0.0, STRAGGLER):
            result = convergence(world, staleness, straggler, tokens, val_tokens)
            if world.rank == 0:
                h = result["history"]
                runs.append({"mode": mode, "straggler": straggler, **result})
                per_worker = np.bincount([r["worker"] for r in h]) if "worker" in h[0] else []
                print(f"{mode:<10} straggler {1e3 * straggler:3.0f} ms: {h[-1]['time']:6.2f} s, "
                      f"{len(h) / h[-1]['time']:6.1f} updates/s, val loss {result['val_loss']:.3f}"
                      + (f", max staleness {max(r['staleness'] for r in h)}, updates per worker "
                         f"{per_worker[1:].tolist()}" if mode != "sync" else ""), flush=True)
    if world.rank != 0:
        return
    model_bytes = sum(p.data.nbytes for p in build_model(CFG).parameters())
    rows = []
    for layout, servers, workers in (("1 server, 3 workers", 1, 3), ("2 servers, 3 workers", 2, 3),
                                     ("ring all-reduce, 3 ranks", 0, 3)):
        ranks = traffic(servers, workers)
        rows.append({"layout": layout, "servers": servers, "workers": workers, "ranks": ranks})
        print(f"{layout:<26}" + "  ".join(f"r{r}: out {o / model_bytes:.2f} in {i / model_bytes:.2f}"
                                          for r, (o, i) in enumerate(ranks)))
    results = {"config": vars(CFG), "straggler": STRAGGLER, "model_bytes": model_bytes, "traffic": rows,
               "runs": runs}
    (HERE / "results").mkdir(exist_ok=True)
    with open(HERE / "results" / "param_server.json", "w") as f:
        json.dump(results, f)
    plot(results, HERE / "figures" / "param_server_traffic.png", HERE / "figures" / "param_server_convergence.png")


if __name__ == "__main__":
    main()
