"""Training-step benchmark: minidist vs the same GPT in PyTorch eager, one CPU thread each (or one GPU).

    OMP_NUM_THREADS=1 python benchmarks/train_step.py [--repeats 15] [--quick]
    python benchmarks/train_step.py --device cuda      # both on the GPU: minidist on CuPy, PyTorch on CUDA

A step is what ``python -m minidist.train`` does per step: zero_grad, forward, backward, global-norm
clipping, AdamW update. For every model size both frameworks start from identical weights (the
PyTorch twin loads minidist's state_dict; their first losses must agree, a free cross-check of the
forward), then their steps are timed ALTERNATELY (minidist, torch, minidist, ...) so machine noise
hits both alike, and medians are reported.

Where does the time go? A step = array kernels + a fixed per-op cost (Python, autograd bookkeeping,
dispatch). We measure the fixed part directly: the same model depth with every dimension shrunk to
almost nothing (B = T = 1, n_embd = n_head, one element per head) runs the same ops, in the same
order, whose kernels take ~0 time. Kernel time ~= step time - that "overhead" step. The same split is
made for PyTorch. cProfile's top functions (by own time) for the default size are saved for diagnosis.

On ``--device cuda`` a step's time runs until the GPU has finished it (both step functions return the
loss as a Python float, which waits for the GPU).

Writes benchmarks/results/train_step.json and benchmarks/figures/train_step.png (with ``--device
cuda``: train_step_cuda.json and train_step_cuda.png).
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")   # before numpy is imported: one BLAS thread

import argparse
import cProfile
import dataclasses
import json
import platform
import pstats
import statistics
import time
from pathlib import Path

import numpy as np

from minidist.allocator import keep_freed_memory
from minidist.data import default_corpus, get_batch, load_tokens, train_val_split
from minidist.device import to_device
from minidist.parallel.compose.step import train_step
from minidist.train.build import build_model, build_optimizer
from minidist.train.config import TrainConfig

HERE = Path(__file__).resolve().parent
SIZES = {   # name: (n_layer, n_head, n_embd, block_size, batch_size); "default" = the CLI's defaults
    "default": (2, 4, 64, 64, 16),
    "small": (4, 4, 128, 128, 8),
    "small-T64": (4, 4, 128, 64, 16),   # issue 22 measured 1.31x here
    "medium": (6, 8, 256, 128, 8),
}


def config(size, **overrides):
    n_layer, n_head, n_embd, block_size, batch_size = size
    return TrainConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size,
                       batch_size=batch_size, **overrides)


def overhead_config(cfg):
    """The same depth and op sequence with (almost) empty arrays: its step time is the per-op cost."""
    return dataclasses.replace(cfg, n_embd=cfg.n_head, block_size=1, batch_size=1)


class MinidistStep:
    """One minidist training step on a fixed batch, as minidist.train runs it."""

    def __init__(self, cfg, tokens):
        self.cfg, self.model = cfg, build_model(cfg)
        self.optimizer = build_optimizer(self.model, cfg)
        self.batch = get_batch(tokens, 0, cfg.batch_size, cfg.block_size, cfg.seed)   # (B, T+1), host
        self.device_batch = to_device(self.batch, cfg.device)

    def __call__(self):
        return float(train_step(self.model, self.optimizer, self.device_batch, self.cfg.lr, self.cfg.grad_clip)[0])


class TorchStep:
    """The same step in PyTorch eager: AdamW with decay on >= 2-D parameters, clip_grad_norm_."""

    def __init__(self, cfg, minidist_model, batch):
        import torch
        from torch_gpt import TorchGPT     # benchmarks/torch_gpt.py, next to this script
        self.torch, self.cfg = torch, cfg
        self.model = TorchGPT.from_minidist(minidist_model, getattr(torch, cfg.dtype)).to(cfg.device)
        params = list(self.model.parameters())
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
        self.idx = torch.from_numpy(batch[:, :-1].copy()).to(cfg.device)        # (B, T)
        self.targets = torch.from_numpy(batch[:, 1:].copy()).to(cfg.device)     # (B, T)

    def __call__(self):
        self.optimizer.zero_grad(set_to_none=True)
        _, loss = self.model(self.idx, self.targets)
        loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        return loss.item()


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_alternating(steps, repeats, warmup=2):
    """Median seconds per call of each callable in ``steps``, calling them in turn ``repeats`` times."""
    for _ in range(warmup):
        for fn in steps:
            fn()
    times = [[] for _ in steps]
    for _ in range(repeats):
        for fn, ts in zip(steps, times):
            ts.append(timed(fn))
    return [statistics.median(ts) for ts in times]


def first_losses(cfg, tokens):
    """Forward both twins on one batch before any update; returns (minidist loss, torch loss)."""
    ours = MinidistStep(cfg, tokens)
    theirs = TorchStep(cfg, ours.model, ours.batch)
    return ours(), theirs()


def profile_minidist(cfg, tokens, steps=10, top=15):
    """cProfile's top functions by own time over ``steps`` minidist steps (seconds per step)."""
    step = MinidistStep(cfg, tokens)
    step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    stats = pstats.Stats(prof).stats   # {(file, line, name): (calls, ncalls, tottime, cumtime, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(f).name}:{line}:{name}", "calls_per_step": nc / steps,
             "own_s_per_step": tt / steps} for (f, line, name), (_, nc, tt, _, _) in rows]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--quick", action="store_true", help="default size only, 5 repeats")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: one thread each; cuda: minidist on CuPy and PyTorch on CUDA, same GPU")
    p.add_argument("--system-allocator", action="store_true",
                   help="keep glibc's default malloc settings (default: keep freed memory, as the trainer does)")
    p.add_argument("--out", help="JSON results (default benchmarks/results/train_step[_cuda].json)")
    p.add_argument("--figure", help="PNG (default benchmarks/figures/train_step[_cuda].png)")
    args = p.parse_args()
    kept = False if args.system_allocator else keep_freed_memory()   # both frameworks share the process
    suffix = "_cuda" if args.device == "cuda" else ""
    args.out = args.out or str(HERE / "results" / f"train_step{suffix}.json")
    args.figure = args.figure or str(HERE / "figures" / f"train_step{suffix}.png")
    sizes = {"default": SIZES["default"]} if args.quick else SIZES
    repeats = 5 if args.quick else args.repeats
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        torch = None
    tokens, _ = train_val_split(load_tokens(default_corpus()))
    results = []
    for name, size in sizes.items():
        cfg = config(size, device=args.device)
        row = {"size": name, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
               "block_size": cfg.block_size, "batch_size": cfg.batch_size, "dtype": cfg.dtype}
        ours = MinidistStep(cfg, tokens)
        row["n_params"] = int(sum(p.data.size for p in ours.model.parameters()))
        tiny = MinidistStep(overhead_config(cfg), tokens)
        steps = [ours, tiny]
        if torch is not None:
            loss_ours, loss_torch = first_losses(cfg, tokens)
            row["first_loss"] = {"minidist": loss_ours, "torch": loss_torch}
            assert abs(loss_ours - loss_torch) < 1e-4 * abs(loss_torch), row["first_loss"]
            theirs = TorchStep(cfg, ours.model, ours.batch)
            tiny_torch = TorchStep(overhead_config(cfg), tiny.model, tiny.batch)
            steps += [theirs, tiny_torch]
        medians = time_alternating(steps, repeats)
        tokens_per_step = cfg.batch_size * cfg.block_size
        row["minidist"] = {"step_s": medians[0], "tokens_per_s": tokens_per_step / medians[0],
                           "overhead_s": medians[1]}
        if torch is not None:
            row["torch"] = {"step_s": medians[2], "tokens_per_s": tokens_per_step / medians[2],
                            "overhead_s": medians[3]}
            row["ratio"] = medians[0] / medians[2]
        print(json.dumps(row))
        results.append(row)
    report = {"machine": machine(args.device), "numpy": np.__version__, "device": args.device,
              "torch": torch.__version__ if torch is not None else None, "threads": 1,
              "keep_freed_memory": kept,
              "repeats": repeats, "results": results,
              "profile_default": profile_minidist(config(SIZES["default"], device=args.device), tokens)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    plot(results, args.figure, report["machine"] if args.device == "cuda" else "one CPU thread")
    print(f"wrote {args.out} and {args.figure}")


def machine(device):
    """The CPU, or the GPU's name for ``device == "cuda"``."""
    if device == "cuda":
        import cupy
        return cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    return platform.processor() or platform.machine()


def plot(results, path, where):
    """One panel per model size: step time of each framework, split into per-op overhead (hatched)
    and array kernels, with the minidist / PyTorch ratio in the title."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    frameworks = [f for f in ("minidist", "torch") if f in results[0]]
    fig, axes = plt.subplots(1, len(results), figsize=(3.2 * len(results), 3.6), squeeze=False)
    for ax, r in zip(axes[0], results):
        step = np.array([r[f]["step_s"] for f in frameworks]) * 1e3
        over = np.minimum(np.array([r[f]["overhead_s"] for f in frameworks]) * 1e3, step)
        xs = np.arange(len(frameworks))
        colors = [f"C{j}" for j in xs]
        ax.bar(xs, over, color=colors, alpha=0.4, hatch="//")
        ax.bar(xs, step - over, bottom=over, color=colors)
        for x, s in zip(xs, step):
            ax.text(x, s, f"{s:.1f} ms", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(xs)
        ax.set_xticklabels(frameworks)
        ratio = f", {r['ratio']:.2f}x" if "ratio" in r else ""
        ax.set_title(f"{r['size']}: {r['n_layer']}L {r['n_embd']}d T{r['block_size']} B{r['batch_size']}{ratio}",
                     fontsize=9)
        ax.margins(y=0.15)
    axes[0][0].set_ylabel("ms per training step (median)")
    from matplotlib.patches import Patch
    fig.legend(handles=[Patch(facecolor="0.6", alpha=0.4, hatch="//", label="per-op overhead (Python, dispatch)"),
                        Patch(facecolor="0.6", label="array kernels")],
               loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(f"Training step on {where}: forward + backward + clip + AdamW", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
