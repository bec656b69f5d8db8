"""Checkpoint cost: save and load time and bytes against model size, and the per-step overhead of a
blocking save against an asynchronous one. One process (a world of one), float32, AdamW (so a
checkpoint holds 3 floats per parameter: the weights and two moments).

    python benchmarks/checkpoint.py            # prints a Markdown table, writes results/checkpoint.json
"""
import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from minidist.checkpoint import Checkpoint, CheckpointWriter, step_dir
from minidist.checkpoint.layout import load_whole, training_meta, whole_pieces
from minidist.optim import lr_at
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.data.sampler import DistributedSampler
from minidist.parallel.state import WholeState
from minidist.parallel.step import train_step
from minidist.train.build import build_model, build_optimizer, load_data, world_of_one
from minidist.train.config import TrainConfig

SIZES = [(2, 64), (4, 128), (6, 256), (8, 384)]  # (n_layer, n_embd)


def best(fn, repeats=3):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def save_and_load(n_layer, n_embd, root):
    cfg = TrainConfig(n_layer=n_layer, n_embd=n_embd, n_head=4, block_size=64, dtype="float32")
    world = world_of_one()
    mesh = DeviceMesh(world)
    model, writer = build_model(cfg, mesh.tp_group), CheckpointWriter(root, world, keep=1)
    optimizer = build_optimizer(model, cfg)
    params = sum(p.data.size for p in model.parameters())
    save = best(lambda: writer.save(0, whole_pieces(model, optimizer, mesh), training_meta(mesh, optimizer)))
    load = best(lambda: load_whole(Checkpoint(step_dir(root, 0)), model, optimizer, mesh))
    nbytes = sum(f.stat().st_size for f in step_dir(root, 0).iterdir())
    return dict(n_layer=n_layer, n_embd=n_embd, params=params, bytes=nbytes, save_s=save, load_s=load)


def step_overhead(mode, root, steps=16, every=4):
    """Seconds per training step (2 layers x 256 wide, batch 8 x 64) saving every ``every`` steps:
    mode "none", "sync" or "async"."""
    cfg = TrainConfig(n_layer=2, n_embd=256, n_head=4, block_size=64, batch_size=8, dtype="float32", steps=steps)
    world = world_of_one()
    mesh = DeviceMesh(world)
    model = build_model(cfg, mesh.tp_group)
    optimizer, writer = build_optimizer(model, cfg), CheckpointWriter(root, world, keep=1)
    sampler = DistributedSampler(load_data(cfg)[0], cfg.batch_size, cfg.block_size, cfg.seed, 0, 1)
    t0 = time.perf_counter()
    for step in range(steps):
        train_step(model, WholeState(model, optimizer), sampler.batch(step), lr_at(step, cfg.lr, cfg.warmup, steps,
                   cfg.min_lr), cfg.grad_clip)
        if mode != "none" and step % every == every - 1:
            writer.save(step, whole_pieces(model, optimizer, mesh), training_meta(mesh, optimizer),
                        async_=mode == "async")
    writer.wait()
    return (time.perf_counter() - t0) / steps


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    try:
        sizes = [save_and_load(n_layer, n_embd, root / f"{n_layer}x{n_embd}") for n_layer, n_embd in SIZES]
        overhead = {mode: min(step_overhead(mode, root / f"{mode}{i}") for i in range(2))  # the quieter of 2
                    for mode in ("none", "sync", "async")}
    finally:
        shutil.rmtree(root)
    print("| n_layer | n_embd | parameters | checkpoint MB | save ms | load ms | save MB/s |")
    print("|---|---|---|---|---|---|---|")
    for r in sizes:
        print(f"| {r['n_layer']} | {r['n_embd']} | {r['params']:,} | {r['bytes'] / 1e6:.2f} | {1e3 * r['save_s']:.1f} "
              f"| {1e3 * r['load_s']:.1f} | {r['bytes'] / 1e6 / r['save_s']:.0f} |")
    print("\n| saving every 4 steps | ms per step | overhead |")
    print("|---|---|---|")
    for mode, s in overhead.items():
        print(f"| {mode} | {1e3 * s:.1f} | {1e3 * (s - overhead['none']):+.1f} ms |")
    out = Path(__file__).parent / "results" / "checkpoint.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(dict(sizes=sizes, step_seconds=overhead), indent=1))


if __name__ == "__main__":
    main()
