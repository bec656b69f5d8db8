"""Training-step benchmark: minidist vs the same GPT in PyTorch eager, one CPU thread each (or one GPU).

    OMP_NUM_THREADS=1 python benchmarks/train_step.py [--repeats 15] [--quick] [--sizes default,gpt2-124M]
    OMP_NUM_THREADS=1 python benchmarks/train_step.py --sizes gpt2-124M     # GPT-2 124M and AdamW alone
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

The ``gpt2-124M`` row is GPT-2 small with its real vocabulary (50257) and an untied head (162M
parameters, T 128, B 1; the trainer's byte-level models are tied): there the step is also timed in
its parts (forward, backward, clip, optimizer) for both frameworks, and :func:`adamw_alone` times
the AdamW update by itself over that model's parameter shapes: minidist per tensor before and after
cache blocking, one flat buffer, torch.optim.AdamW (for-loop, foreach, fused), against the
memory-bandwidth floor (bytes the update must move / a STREAM-like copy's bandwidth).

On ``--device cuda`` a step's time runs until the GPU has finished it (both step functions return the
loss as a Python float, which waits for the GPU).

Writes benchmarks/results/train_step.json and benchmarks/figures/train_step.png (with ``--device
cuda``: train_step_cuda.json and train_step_cuda.png).
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")   # before numpy is imported: one BLAS thread

import argparse
import contextlib
import cProfile
import dataclasses
import math
import json
import platform
import pstats
import re
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from minidist.allocator import keep_freed_memory
from minidist.data import default_corpus, get_batch, inputs_and_targets, load_tokens, train_val_split
from minidist.device import to_device
from minidist.model import GPT, GPTConfig
from minidist.optim import AdamW, adamw_update, blocks, clip_grad_norm, decays
from minidist.parallel.state import WholeState
from minidist.parallel.step import train_step
from minidist.train.build import build_model, build_optimizer
from minidist.train.config import TrainConfig

HERE = Path(__file__).resolve().parent
SIZES = {   # name: (n_layer, n_head, n_embd, block_size, batch_size); "default" = the CLI's defaults
    "default": (2, 4, 64, 64, 16),
    "small": (4, 4, 128, 128, 8),
    "small-T64": (4, 4, 128, 64, 16),   # issue 22 measured 1.31x here
    "medium": (6, 8, 256, 128, 8),
    "gpt2-124M": (12, 12, 768, 128, 1),
    "nanogpt-char": (4, 4, 128, 64, 12),   # nanoGPT's train_shakespeare_char recipe for a CPU (issue 49)
}
MODELS = {"gpt2-124M": dict(vocab_size=50257, tie_embeddings=False),   # GPTConfig beyond the trainer's
          "nanogpt-char": dict(vocab_size=65, bias=False)}
SLOW = {"gpt2-124M"}   # timed with a third of the repeats (a step takes seconds), and in its parts


def config(size, **overrides):
    n_layer, n_head, n_embd, block_size, batch_size = size
    return TrainConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size,
                       batch_size=batch_size, **overrides)


def overhead_config(cfg):
    """The same depth and op sequence with (almost) empty arrays: its step time is the per-op cost."""
    return dataclasses.replace(cfg, n_embd=cfg.n_head, block_size=1, batch_size=1)


def build(cfg, model_overrides=None):
    """minidist's GPT for ``cfg``: the trainer's (byte-level, tied), or with ``model_overrides`` of
    its GPTConfig (e.g. GPT-2's vocabulary and untied head), initialised as the trainer does."""
    if not model_overrides:
        return build_model(cfg)
    config = GPTConfig(block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                       **model_overrides)
    return GPT(config, seed=cfg.seed, dtype=cfg.dtype).to(cfg.device)


class MinidistStep:
    """One minidist training step on a fixed batch, as minidist.train runs it."""

    def __init__(self, cfg, tokens, model_overrides=None):
        self.cfg, self.model = cfg, build(cfg, model_overrides)
        self.optimizer = build_optimizer(self.model, cfg)
        self.state = WholeState(self.model, self.optimizer)
        batch = get_batch(tokens, 0, cfg.batch_size, cfg.block_size, cfg.seed)   # (B, T+1), host: bytes
        self.batch = batch % self.model.config.vocab_size   # within a smaller vocabulary (nanogpt-char's 65)
        self.device_batch = to_device(self.batch, cfg.device)

    def __call__(self):
        return float(train_step(self.model, self.state, self.device_batch, self.cfg.lr, self.cfg.grad_clip)[0])

    def phases(self):
        """The step's parts, as the trainer runs them on one process, timed: seconds."""
        idx, targets = inputs_and_targets(self.device_batch)        # (B, T), (B, T)
        marks = [time.perf_counter()]
        self.optimizer.zero_grad()
        _, loss = self.model(idx, targets)
        marks.append(time.perf_counter())
        loss.backward(np.ones_like(loss.data))
        marks.append(time.perf_counter())
        clip_grad_norm(self.model.parameters(), self.cfg.grad_clip)
        marks.append(time.perf_counter())
        self.optimizer.lr = self.cfg.lr
        self.optimizer.step()
        marks.append(time.perf_counter())
        return dict(zip(PHASES, np.diff(marks)))


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
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
        self.idx = torch.from_numpy(batch[:, :-1].copy()).to(cfg.device)        # (B, T)
        self.targets = torch.from_numpy(batch[:, 1:].copy()).to(cfg.device)     # (B, T)

    def __call__(self):
        self.optimizer.zero_grad(set_to_none=True)
        _, loss = self.model(self.idx, self.targets)
        loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        return loss.item()

    def phases(self):
        """The step's parts, timed: seconds (on the CPU: no GPU synchronisation needed)."""
        marks = [time.perf_counter()]
        self.optimizer.zero_grad(set_to_none=True)
        _, loss = self.model(self.idx, self.targets)
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        marks.append(time.perf_counter())
        self.optimizer.step()
        marks.append(time.perf_counter())
        return dict(zip(PHASES, np.diff(marks)))


PHASES = ("forward", "backward", "clip", "optimizer")   # forward includes zero_grad


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


def median_phases(steps, repeats):
    """Median seconds of each phase per step object, calling them in turn ``repeats`` times."""
    runs = [[step.phases() for step in steps] for _ in range(repeats)]
    return [{k: statistics.median(run[i][k] for run in runs) for k in PHASES} for i in range(len(steps))]


@contextlib.contextmanager
def unblocked():
    """AdamW as it was before cache blocking: a block longer than any array, so each operation runs
    over the whole array, with whole-array temporaries."""
    saved, blocks.BLOCK = blocks.BLOCK, 1 << 62
    try:
        yield
    finally:
        blocks.BLOCK = saved


def copy_bandwidth(n, repeats=5):
    """A STREAM-like copy of ``n`` float32 elements: bytes read + written per second (best of ``repeats``)."""
    src, dst = np.ones(n, np.float32), np.ones(n, np.float32)
    return 2 * src.nbytes / min(timed(lambda: np.copyto(dst, src)) for _ in range(repeats))


def adamw_alone(named_shapes, repeats, lr=6e-4, weight_decay=0.1):
    """The AdamW update by itself over float32 parameters of ``named_shapes`` (nanoGPT's decay rule,
    betas 0.9, 0.95), median seconds per update, all variants timed in turn on the same memory: one
    minidist AdamW whose parameters and state are laid in one flat buffer (``flatten``, as the step
    does on data-parallel buckets) updated per tensor (``step``) before blocking and blocked, and flat
    (``step_flat``: one call per run of parameters sharing a decay rate, bitwise per tensor);
    ``adamw_update`` over the whole buffer with a 0/1 decay mask (ZeRO's shards), blocked and not;
    torch.optim.AdamW on tensors of the same shapes; and the floor: bytes moved / copy bandwidth."""
    sizes = [math.prod(s) for _, s in named_shapes]
    n, bounds = sum(sizes), np.cumsum([0] + sizes)
    bandwidth = copy_bandwidth(n)
    rng = np.random.default_rng(0)
    grad = 1e-3 * rng.standard_normal(n, dtype=np.float32)      # (n,) the flat gradient, a bucket's
    params = [(name, SimpleNamespace(data=0.02 * rng.standard_normal(shape, dtype=np.float32),
                                     grad=grad[lo:hi].reshape(shape)))
              for (name, shape), lo, hi in zip(named_shapes, bounds, bounds[1:])]
    opt = AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    opt.flatten([[name for name, _ in named_shapes]])
    values, state, _ = opt.flat_groups[0]                        # (n,) each
    mask = np.concatenate([np.full(size, float(decays(shape)), np.float32)
                           for size, (_, shape) in zip(sizes, named_shapes)])
    mask *= weight_decay     # (n,) per-element rates, as ZeRO builds them
    count = iter(range(1, 1 << 30))

    def masked(blocked=True):
        def update():
            with contextlib.nullcontext() if blocked else unblocked():
                adamw_update(values, grad, state["exp_avg"], state["exp_avg_sq"], step=next(count), lr=lr,
                             beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=mask)
        return update

    def before():
        with unblocked():
            opt.step()

    cases = {"minidist per tensor, before blocking": before, "minidist per tensor, blocked (step)": opt.step,
             "minidist flat, blocked (step_flat)": lambda: opt.step_flat([grad]),
             "minidist flat, blocked, 0/1 mask": masked(), "minidist flat, unblocked, 0/1 mask": masked(False)}
    cases.update(torch_adamw(values, grad, bounds, [s for _, s in named_shapes], lr, weight_decay))
    names = list(cases)
    medians = time_alternating([cases[k] for k in names], repeats, warmup=1)
    return {"n_params": int(n), "block": blocks.BLOCK, "copy_bandwidth_GBps": bandwidth / 1e9,
            "bytes_per_update": 28 * n, "bytes_per_update_mask": 32 * n,
            "floor_s": 28 * n / bandwidth, "floor_s_mask": 32 * n / bandwidth,
            "seconds": dict(zip(names, medians))}


def torch_adamw(p, g, bounds, shapes, lr, weight_decay):
    """torch.optim.AdamW steps over tensors of ``shapes`` holding ``p`` with gradients ``g``: the
    for-loop (the CPU default), foreach and fused implementations, each with its own state."""
    try:
        import torch
    except ImportError:
        return {}
    params = [torch.from_numpy(p[lo:hi].reshape(s).copy()) for lo, hi, s in zip(bounds, bounds[1:], shapes)]
    for t, lo, hi in zip(params, bounds, bounds[1:]):
        t.grad = torch.from_numpy(g[lo:hi].reshape(t.shape).copy())
    groups = [{"params": [t for t in params if t.ndim >= 2], "weight_decay": weight_decay},
              {"params": [t for t in params if t.ndim < 2], "weight_decay": 0.0}]
    cases = {}
    for name, kind in (("for-loop", dict(foreach=False)), ("foreach", dict(foreach=True)), ("fused", dict(fused=True))):
        opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **kind)
        cases[f"torch.optim.AdamW {name}"] = opt.step
    return cases


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


def measure(name, cfg, tokens, torch, repeats):
    """One row: minidist's step (and PyTorch's, when ``torch``) at the size ``name`` of ``cfg``, with
    the per-op overhead of each; for the sizes in SLOW the step's parts too, and the parameter shapes
    (``"shapes"``) for :func:`adamw_alone`."""
    row = {"size": name, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
           "block_size": cfg.block_size, "batch_size": cfg.batch_size, "dtype": cfg.dtype}
    overrides = MODELS.get(name)
    ours = MinidistStep(cfg, tokens, overrides)
    row["n_params"] = int(sum(p.data.size for p in ours.model.parameters()))
    row["vocab_size"], row["tied"] = ours.model.config.vocab_size, ours.model.config.tie_embeddings
    tiny = MinidistStep(overhead_config(cfg), tokens, overrides and dict(overrides, vocab_size=256))
    steps = [ours, tiny]
    if torch is not None:   # twins of the untouched models; each first call returns its loss before any update
        steps += [TorchStep(cfg, ours.model, ours.batch), TorchStep(overhead_config(cfg), tiny.model, tiny.batch)]
        loss_ours, loss_torch = ours(), steps[2]()
        row["first_loss"] = {"minidist": loss_ours, "torch": loss_torch}
        assert abs(loss_ours - loss_torch) < 1e-4 * abs(loss_torch), row["first_loss"]
    row["repeats"] = max(3, repeats // 3) if name in SLOW else repeats
    medians = time_alternating(steps, row["repeats"])
    tokens_per_step = cfg.batch_size * cfg.block_size
    for framework, (step_s, overhead_s) in zip(("minidist", "torch"), zip(medians[::2], medians[1::2])):
        row[framework] = {"step_s": step_s, "tokens_per_s": tokens_per_step / step_s, "overhead_s": overhead_s}
    if torch is not None:
        row["ratio"] = medians[0] / medians[2]
    if name in SLOW:
        row["phases"] = dict(zip(("minidist", "torch"), median_phases(steps[::2], row["repeats"])))
    print(json.dumps(row))
    if name in SLOW:
        row["shapes"] = [(name, p.data.shape) for name, p in ours.model.named_parameters()]
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--quick", action="store_true", help="default size only, 5 repeats")
    p.add_argument("--sizes", help=f"comma-separated, of {', '.join(SIZES)} (default: all)")
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
    names = ["default"] if args.quick else args.sizes.split(",") if args.sizes else list(SIZES)
    sizes = {name: SIZES[name] for name in names}
    repeats = 5 if args.quick else args.repeats
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        torch = None
    tokens, _ = train_val_split(load_tokens(default_corpus()))
    results = [measure(name, config(size, device=args.device), tokens, torch, repeats) for name, size in sizes.items()]
    shapes = next((r.pop("shapes") for r in results if "shapes" in r), None)
    adamw = adamw_alone(shapes, repeats) if shapes and args.device == "cpu" else None
    if adamw:
        print(json.dumps(adamw))
    report = {"machine": machine(args.device), "numpy": np.__version__, "device": args.device,
              "torch": torch.__version__ if torch is not None else None, "threads": 1,
              "keep_freed_memory": kept,
              "repeats": repeats, "results": results, "adamw": adamw,
              "profile_default": profile_minidist(config(SIZES["default"], device=args.device), tokens)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    plot(results, args.figure, report["machine"] if args.device == "cuda" else "one CPU thread")
    print(f"wrote {args.out} and {args.figure}")


def machine(device):
    """The CPU's model name (/proc/cpuinfo's) and logical cores, or the GPU's name for ``device == "cuda"``."""
    if device == "cuda":
        import cupy
        return cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    try:
        info = Path("/proc/cpuinfo").read_text()
        name = re.search(r"^model name\s*:\s*(.+)$", info, re.M).group(1).strip()
    except (OSError, AttributeError):
        name = platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} logical cores"


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
