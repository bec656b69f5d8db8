"""Rank script: parameter-server training under real MPI, several layouts in one launch (4 ranks).

Rank 0 trains the single-process reference itself and compares: synchronous training with 1 and 2
servers (SGD + momentum, AdamW) must match it to 1e-10 in losses and weights (float64); asynchronous
training must respect its staleness bound, and with one worker equal the reference too. Prints one
"OK ..." line per layout, then "PS OK".
"""
import contextlib
import io
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import minidist  # noqa: E402
from minidist.parallel.ps.param_server import staleness_bound, train_parameter_server  # noqa: E402
from minidist.train import train  # noqa: E402
from minidist.train.build import build_model, load_data  # noqa: E402
from minidist.train.config import TrainConfig  # noqa: E402


def config(optimizer):
    return TrainConfig(steps=10, batch_size=6, dtype="float64", optimizer=optimizer,
                       lr=0.1 if optimizer == "sgd" else 3e-3, warmup=2, n_layer=1, n_embd=16, n_head=2,
                       block_size=16, eval_iters=1, sample_tokens=0, grad_clip=1.0)


def rel_err(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / np.abs(b).max())


def main():
    world = minidist.init(timeout=60)
    layouts = [("sgd", 1, None, 0.0), ("adamw", 2, None, 0.0), ("adamw", 3, 1, 0.0), ("sgd", 1, 1, 0.02)]
    for optimizer, servers, staleness, straggler in layouts:
        cfg = config(optimizer)
        model = build_model(cfg)
        history = train_parameter_server(world, model, cfg, load_data(cfg)[1].train, servers=servers,
                                         staleness=staleness, straggler=straggler)
        if world.rank != 0:
            continue
        workers = world.size - servers
        name = f"{optimizer} servers={servers} workers={workers} staleness={staleness}"
        if staleness is not None and workers > 1:
            worst = max(r["staleness"] for r in history)
            assert 0 < worst <= staleness_bound(workers, staleness), (name, worst)
            print(f"OK {name}: {len(history)} updates, max staleness {worst}", flush=True)
            continue
        with contextlib.redirect_stdout(io.StringIO()):
            reference_model, reference = train(cfg, progress=False)
        loss_err = rel_err([r["loss"] for r in history], [r["loss"] for r in reference])
        weight_err = max(rel_err(v, model.state_dict()[k]) for k, v in reference_model.state_dict().items())
        assert loss_err <= 1e-10 and weight_err <= 1e-10, (name, loss_err, weight_err)
        print(f"OK {name}: loss error {loss_err:.1e}, weight error {weight_err:.1e}", flush=True)
    if world.rank == 0:
        print("PS OK", flush=True)


if __name__ == "__main__":
    main()
