"""nanoGPT's character recipe for a CPU, side by side: ``python -m minidist.train`` against a training
loop written as nanoGPT's ``train.py`` runs it (PyTorch eager), on the same folder (issue 49).

    python benchmarks/nanogpt_recipe.py [--steps 300] [--runs 3]

The recipe is nanoGPT's ``config/train_shakespeare_char.py`` with its README's CPU flags: 4 blocks x 4
heads x 128, T 64, B 12, no biases, a tied head, AdamW (0.9, 0.99), weight decay 0.1 on >= 2-D
parameters, clip 1.0, 100 warm-up steps then a cosine from 1e-3 to 1e-4, an evaluation of 20 batches
of each split every 250 steps, dropout 0. The corpus is minidist's generated text, written as
nanoGPT's ``prepare.py`` writes a character folder (``train.bin``, ``val.bin`` of uint16 ids and
``meta.pkl``), its vocabulary filled up to Shakespeare's 65 characters (the text uses 34 of them).

Both sides start from the same weights (the PyTorch model loads minidist's initial ``state_dict``);
nanoGPT's model is used as nanoGPT writes it: exact GELU (minidist's is GPT-2's tanh form;
``benchmarks/train_step.py``'s ``nanogpt-char`` row times the same model on both sides). Rows:

- one process, one thread each: ``OMP_NUM_THREADS=1`` / ``torch.set_num_threads(1)``;
- two cores: ``mpiexec -n 2 python -m minidist.train ... --dp 2`` (one thread a rank) against the
  PyTorch loop on 2 threads (nanoGPT on a CPU uses its cores through PyTorch's threads).

Every run is a fresh process; the two sides alternate, ``--runs`` times each. A run's per-step time is
the median over its steps of one step's wall time (the batch read, forward, backward, clip and update:
minidist's ``tokens_per_s`` in ``metrics.jsonl``, the loop's own clock), the evaluations excluded; its
wall time is the whole process's. Writes benchmarks/results/nanogpt_recipe.json.
"""
import argparse
import json
import math
import os
import pickle
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RECIPE = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12, lr=1e-3, min_lr=1e-4, warmup=100,
              beta2=0.99, weight_decay=0.1, grad_clip=1.0, eval_every=250, eval_iters=20)


def prepare(folder: Path) -> int:
    """minidist's generated corpus as a nanoGPT character folder in ``folder``: its vocabulary size."""
    from minidist.data import default_corpus
    text = Path(default_corpus()).read_text(encoding="utf-8")
    chars = sorted(set(text))
    chars += [c for c in string.printable if c not in chars][:65 - len(chars)]   # Shakespeare's 65, some unused
    lookup = {c: i for i, c in enumerate(chars)}
    ids = np.fromiter((lookup[c] for c in text), dtype=np.uint16, count=len(text))
    n = int(0.9 * len(ids))
    folder.mkdir(parents=True, exist_ok=True)
    ids[:n].tofile(folder / "train.bin")
    ids[n:].tofile(folder / "val.bin")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}, f)
    return len(chars)


def minidist_command(folder: Path, steps: int, out: Path, ranks: int) -> list[str]:
    r = RECIPE
    train = [sys.executable, "-m", "minidist.train", "--data", str(folder), "--n-layer", str(r["n_layer"]),
             "--n-head", str(r["n_head"]), "--n-embd", str(r["n_embd"]), "--block-size", str(r["block_size"]),
             "--batch-size", str(r["batch_size"]), "--steps", str(steps), "--lr", str(r["lr"]),
             "--min-lr", str(r["min_lr"]), "--warmup", str(r["warmup"]), "--beta2", str(r["beta2"]), "--no-bias",
             "--dropout", "0.0", "--eval-every", str(r["eval_every"]), "--eval-iters", str(r["eval_iters"]),
             "--sample-tokens", "0", "--out", str(out)]
    if ranks == 1:
        return train
    from minidist.launchers import find_mpiexec
    return [find_mpiexec(), "-n", str(ranks), *train, "--dp", str(ranks)]


def torch_loop(folder: Path, steps: int, threads: int) -> dict:
    """nanoGPT's training loop at the recipe (in this process): per-step seconds and the last val loss."""
    import torch
    sys.path.insert(0, str(HERE))
    from torch_gpt import TorchGPT
    from minidist.model import GPT, GPTConfig
    torch.set_num_threads(threads)
    r = RECIPE
    vocab = pickle.load(open(folder / "meta.pkl", "rb"))["vocab_size"]
    config = GPTConfig(vocab_size=vocab, block_size=r["block_size"], n_layer=r["n_layer"], n_head=r["n_head"],
                       n_embd=r["n_embd"], bias=False)
    model = TorchGPT.from_minidist(GPT(config, seed=0), torch.float32, gelu_approximate="none")
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": r["weight_decay"]},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=r["lr"], betas=(0.9, r["beta2"]))
    data = {split: np.memmap(folder / f"{split}.bin", dtype=np.uint16, mode="r") for split in ("train", "val")}
    B, T = r["batch_size"], r["block_size"]

    def get_batch(split):
        d = data[split]
        ix = torch.randint(len(d) - T, (B,))
        x = torch.stack([torch.from_numpy(d[i:i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(d[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
        return x, y

    def lr_at(it):
        if it < r["warmup"]:
            return r["lr"] * (it + 1) / (r["warmup"] + 1)
        ratio = (it - r["warmup"]) / max(1, steps - r["warmup"])
        return r["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (r["lr"] - r["min_lr"])

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        out = {split: float(torch.stack([model(*get_batch(split))[1] for _ in range(r["eval_iters"])]).mean())
               for split in ("train", "val")}
        model.train()
        return out

    step_s, val = [], None
    for it in range(steps):
        if it % r["eval_every"] == 0 or it == steps - 1:
            val = estimate_loss()["val"]
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(it)
        x, y = get_batch("train")
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), r["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        step_s.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(step_s), "val_loss": val}


def run_minidist(folder: Path, steps: int, ranks: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        done = subprocess.run(minidist_command(folder, steps, Path(out), ranks), capture_output=True, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        wall = time.perf_counter() - t0
        assert done.returncode == 0, done.stdout + done.stderr
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    tokens = RECIPE["batch_size"] * RECIPE["block_size"]
    return {"step_s": statistics.median(tokens / row["tokens_per_s"] for row in rows),
            "val_loss": [row["val_loss"] for row in rows if "val_loss" in row][-1], "wall_s": wall}


def run_torch(folder: Path, steps: int, threads: int) -> dict:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--torch-loop", str(folder), "--steps", str(steps),
                           "--threads", str(threads)], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(json.loads(done.stdout.splitlines()[-1]), wall_s=time.perf_counter() - t0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--torch-loop", type=Path, help=argparse.SUPPRESS)   # the child process's side
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(HERE / "results" / "nanogpt_recipe.json"))
    args = p.parse_args()
    if args.torch_loop:
        print(json.dumps(torch_loop(args.torch_loop, args.steps, args.threads)))
        return
    import torch
    from train_step import machine
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "chars"
        vocab = prepare(folder)
        rows = []
        for cores in (1, 2):
            runs = {"minidist": [], "nanoGPT loop": []}
            for _ in range(args.runs):   # alternating: machine noise hits both alike
                runs["minidist"].append(run_minidist(folder, args.steps, cores))
                runs["nanoGPT loop"].append(run_torch(folder, args.steps, cores))
            row = {"cores": cores, "minidist": "one process" if cores == 1 else "mpiexec -n 2 --dp 2",
                   "torch_threads": cores, "runs": runs,
                   **{f"{side}_step_ms": 1e3 * min(r["step_s"] for r in rs) for side, rs in runs.items()}}
            row["ratio"] = row["minidist_step_ms"] / row["nanoGPT loop_step_ms"]
            print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
            rows.append(row)
    report = {"machine": machine("cpu"), "load_before": load_before, "load_after": os.getloadavg(), "numpy": np.__version__,
              "torch": torch.__version__, "steps": args.steps, "vocab_size": vocab, "recipe": RECIPE, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
