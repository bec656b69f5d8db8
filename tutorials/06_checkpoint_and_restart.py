"""Lesson 6: sharded checkpoints that reshard, that know their run, and that trust none of their files.

    python tutorials/06_checkpoint_and_restart.py       (4 ranks as threads; no MPI needed)

A checkpoint stores GLOBAL tensors under single-process names (GPT-2 parameters, ``exp_avg/<name>``
for optimizer state), each rank writing only the boxes of them it holds (minidist/checkpoint/):

    step-000003/rank-00000.safetensors   "transformer.h.0.mlp.c_fc.weight[0:48,0:24]", ...
    step-000003/rank-00000.json          per piece: global name, global shape, dtype, box; sha256
    step-000003/manifest.json            written last by rank 0: every file's size and sha256, the
                                         run's identity, and the sha256 of the manifest itself

Loading into another layout is just asking for other boxes. This script:
  1. trains 3 steps of AdamW at (dp 2, tp 2) and saves; shows the manifest's checksum and identity;
  2. loads that checkpoint at (dp 4) and trains 3 more steps;
  3. checks the result against 6 uninterrupted steps at (dp 4): equal to 1e-10 (float64);
  4. tries to resume it with another seed: refused, naming the field (the layout may change, the run not);
  5. edits one digit of the newest manifest and shows latest_valid() fall back to the previous;
  6. exports one consolidated safetensors file with GPT-2 names;
  7. restarts a job for real: ``python -m minidist.run -n 2 --max-restarts 1 -- -m minidist.train ...
     --save-every 3 --fail-at-step 7 --fail-rank 1`` trains a tiny GPT on 2 MPI ranks, rank 1 kills
     itself (SIGKILL, as a lost node) at step 7, the launcher starts the whole job again with --resume,
     the trainer continues from step-000006, and the final loss equals an uninterrupted run's, bitwise.
Between 2 and 3 it also loads the (dp 2, tp 2) save at (tp 3), where boxes no longer line up: new
rank 1 needs c_fc rows 32:64, half of them in saved rank 0's file and half in rank 1's.

    python tutorials/06_checkpoint_and_restart.py --png ckpt.png   (also draw who reads which saved box)

Everything is written in a temporary folder that is removed at the end, also when a check fails.
"""
import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import safetensors.numpy

import minidist
from minidist.checkpoint import Checkpoint, CheckpointWriter, export_safetensors, latest_valid, step_dir
from minidist.checkpoint.identity import run_identity
from minidist.checkpoint.layout import load_whole, training_meta, whole_pieces
from minidist.checkpoint.regions import intersect
from minidist.checkpoint.training import ResumeRefused, TrainingCheckpoints
from minidist.launch_check import check_launch
from minidist.optim import lr_at
from minidist.parallel.data.data_parallel import DataParallel
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.data.sampler import DistributedSampler
from minidist.parallel.state import WholeState
from minidist.parallel.step import train_step
from minidist.parallel.tensor.layout import regions, unshard
from minidist.train.build import build_model, build_optimizer, load_data
from minidist.launchers import find_mpiexec
from minidist.train.config import TrainConfig

CFG = TrainConfig(n_layer=2, n_head=6, n_embd=24, block_size=16, batch_size=8, steps=6, warmup=2, lr=1e-2,
                  dtype="float64", dp=2, tp=2)


def run(cfg, root, start, stop, load=None):
    """Train steps start..stop on dp * tp ranks (first loading checkpoint ``load``), save step ``stop``."""
    def rank_fn(group):
        mesh = DeviceMesh(group, dp=cfg.dp, tp=cfg.tp)
        model = build_model(cfg, mesh.tp_group)
        optimizer = build_optimizer(model, cfg)
        if load is not None:
            load_whole(Checkpoint(load), model, optimizer, mesh)  # this rank's boxes, from any layout
        dp = DataParallel(model, mesh.dp_group)
        corpus = load_data(cfg)[1]
        sampler = DistributedSampler(corpus.train, cfg.batch_size, cfg.block_size, cfg.seed, mesh.dp_rank, cfg.dp)
        for step in range(start, stop):
            train_step(model, WholeState(model, optimizer, dp), sampler.batch(step),
                       lr_at(step, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr), cfg.grad_clip, mesh=mesh)
        writer = CheckpointWriter(root, group)
        meta = {**training_meta(mesh, optimizer), "data_position": stop, "run": run_identity(cfg, corpus.identity)}
        writer.save(stop, whole_pieces(model, optimizer, mesh), meta)
    minidist.run_local(rank_fn, cfg.dp * cfg.tp)
    return Checkpoint(step_dir(root, stop))


def resume_refusal(cfg, root):
    """What ``--resume`` says when run ``cfg`` (one rank) tries to continue the checkpoints in ``root``."""
    def rank_fn(group):
        mesh = DeviceMesh(group)
        model = build_model(cfg, mesh.tp_group)
        ckpts = TrainingCheckpoints(root, mesh, run_identity(cfg, load_data(cfg)[1].identity))
        try:
            ckpts.resume(WholeState(model, build_optimizer(model, cfg)))
        except ResumeRefused as e:
            return str(e)
    return minidist.run_local(rank_fn, 1)[0]


DRAWN = ("transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight")


def saved_boxes(ckpt, name):
    """[(rank file, box)] of the saved pieces of tensor ``name``, read from the rank-*.json files."""
    out = []
    for path in sorted(ckpt.dir.glob("rank-*.json")):
        tensors = json.loads(path.read_text())["tensors"]
        out += [(int(path.stem.split("-")[1]), tuple(map(tuple, t["box"]))) for t in tensors.values() if t["name"] == name]
    return out


def reads(ckpt, name, tp_rank, tp):
    """What rank ``tp_rank`` of a tp-``tp`` layout reads for ``name``: [(its box, saved rank, overlap)],
    the intersections the reader copies (minidist/checkpoint/reader.py)."""
    shape = ckpt.global_shape(name)
    return [(box, rank, overlap) for _, _, box in regions(name, shape, tp_rank, tp)
            for rank, stored in saved_boxes(ckpt, name) if (overlap := intersect(stored, box)) is not None]


def load_at_tp3(ckpt):
    """Load the checkpoint at (tp 3) on 3 threads; the shards joined back must equal the saved tensors."""
    cfg = dataclasses.replace(CFG, dp=1, tp=3)

    def rank_fn(group):
        mesh = DeviceMesh(group, tp=3)
        model = build_model(cfg, mesh.tp_group)
        load_whole(ckpt, model, build_optimizer(model, cfg), mesh)
        worst = 0.0
        for name, p in model.named_parameters():
            full = unshard(name, list(group.all_gather(np.ascontiguousarray(p.data)[None])), model.config.vocab_size)
            worst = max(worst, float(np.abs(full - ckpt.read_full(name)).max()))
        return worst
    return max(minidist.run_local(rank_fn, 3))


def restart(root):
    """Section 7: the launcher restarts a killed 2-rank job from its last checkpoint; an uninterrupted
    run of the same job for comparison. Returns the two runs' losses per step."""
    common = ["-m", "minidist.train", "--dp", "2", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
              "--block-size", "16", "--batch-size", "4", "--steps", "8", "--warmup", "2", "--dtype", "float64",
              "--eval-every", "1000", "--sample-tokens", "0"]
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def launch(*args):
        done = subprocess.run([sys.executable, "-m", "minidist.run", *map(str, args)], capture_output=True,
                              text=True, timeout=120, env=env)
        if done.returncode != 0:
            raise AssertionError(f"minidist.run failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done
    faulty = ["--ckpt-dir", root / "ckpt", "--save-every", 3, "--fail-at-step", 7, "--fail-rank", 1, "--out", root / "a"]
    print("7. python -m minidist.run -n 2 --max-restarts 1 -- -m minidist.train --dp 2 --n-layer 1 ... --steps 8\n"
          "     --ckpt-dir CKPT --save-every 3 --fail-at-step 7 --fail-rank 1 --out A")
    run = launch("-n", 2, "--max-restarts", 1, "--", *common, *faulty)
    for line in run.stderr.splitlines():
        if line.startswith("minidist.run:") and "attempt 1 exited" in line or "restart 1/1" in line:
            print("   " + line.replace(str(root) + "/", ""))
    print("   " + next(line for line in run.stdout.splitlines() if line.startswith("resumed from")).replace(
        str(root) + "/", ""))
    launch("-n", 2, "--", *common, "--out", root / "b")  # the same job, never interrupted
    losses = [[json.loads(line)["loss"] for line in (root / d / "metrics.jsonl").read_text().splitlines()]
              for d in ("a", "b")]
    return losses


def draw(path, ckpt, names):
    """Per tensor (row): the saved boxes coloured by the rank file that holds them, then what each
    rank of (dp 4) and of (tp 3) reads, coloured by the saved file each part comes from."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    colours = plt.get_cmap("tab10")
    writers = sorted({rank for name in names for rank, _ in saved_boxes(ckpt, name)})
    cmap = ListedColormap(["#eeeeee"] + [colours(r) for r in writers])  # 0: not read
    columns = [("saved at (dp 2, tp 2)\nwho wrote what", None)] + [("(dp 4), each rank\nreads all of it", (0, 1))] \
        + [(f"(tp 3) rank {r}\nreads", (r, 3)) for r in range(3)]
    fig, axes = plt.subplots(len(names), len(columns), figsize=(2.4 * len(columns), 2.6 * len(names)),
                             squeeze=False)
    for i, name in enumerate(names):
        shape = ckpt.global_shape(name)
        for j, (title, layout) in enumerate(columns):
            grid = np.zeros(shape)
            pieces = saved_boxes(ckpt, name) if layout is None else [(rank, o) for _, rank, o in reads(ckpt, name, *layout)]
            for rank, box in pieces:
                grid[tuple(slice(a, b) for a, b in box)] = writers.index(rank) + 1
            ax = axes[i, j]
            ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=len(writers) + 0.5, interpolation="nearest", aspect="auto")
            for rank, box in pieces:  # each box read (or written) as one outlined rectangle
                (r0, r1), (c0, c1) = box
                ax.add_patch(plt.Rectangle((c0 - 0.5, r0 - 0.5), c1 - c0, r1 - r0, fill=False, ec="black", lw=0.8))
            ax.set_xticks(sorted({0, shape[1] - 1} | {b[1][0] for _, b in pieces}))
            ax.set_yticks(sorted({0, shape[0] - 1} | {b[0][0] for _, b in pieces}))
            ax.tick_params(labelsize=7)
            if i == 0:
                ax.set_title(title, fontsize=9)
            if j == 0:
                ax.set_ylabel(f"{name.replace('transformer.', '')}\n{tuple(shape)}", fontsize=8)
    fig.legend(handles=[Patch(color=colours(r), label=f"from rank-{r:05d}") for r in writers]
               + [Patch(fc="#eeeeee", ec="0.7", label="not read")], loc="upper left", bbox_to_anchor=(1.0, 0.95),
               fontsize=8, frameon=False)
    fig.suptitle("Resharding a (dp 2, tp 2) checkpoint: which saved boxes each new rank reads "
                 "(outlined: one copy each)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def lesson(root, png=None):
    first = run(CFG, root / "run", 0, 3)
    print(f"1. saved at (dp 2, tp 2): {sorted(p.name for p in first.dir.iterdir())}")
    rank1 = json.loads((first.dir / "rank-00001.json").read_text())["tensors"]
    key = next(k for k in rank1 if "c_attn.weight" in k and "/" not in k)
    print(f"   rank 1 (tp rank 1) holds {key}: box {rank1[key]['box']} of {rank1[key]['global_shape']}")
    identity = first.meta["run"]
    print(f"   manifest sha256 {first.manifest['sha256'][:16]}...; run identity: seed {identity['seed']}, lr "
          f"{identity['lr']}, steps {identity['steps']}, data {identity['data_tokens']:,} tokens sha256 "
          f"{identity['data_sha256'][:12]}..., {len(identity)} fields")

    name = "transformer.h.0.mlp.c_fc.weight"
    print(f"   resharding is box intersection. At (dp 4) every rank reads all of {name} {first.global_shape(name)}"
          f"\n   from the files of ranks {sorted({r for r, _ in saved_boxes(first, name)})}; at (tp 3) each rank "
          "reads its rows from the file(s) that hold them:")
    for r in range(3):
        parts = reads(first, name, r, 3)
        print(f"     tp rank {r} needs rows {parts[0][0][0][0]}:{parts[0][0][0][1]} <- "
              + ", ".join(f"rank-{rank:05d} rows {o[0][0]}:{o[0][1]}" for _, rank, o in parts))
    worst = load_at_tp3(first)
    print(f"   loaded at (tp 3) and joined back: max difference from the saved tensors {worst:.1e}")
    assert worst == 0.0

    dp4 = dataclasses.replace(CFG, dp=4, tp=1)
    resumed = run(dp4, root / "run", 3, 6, load=first.dir)
    whole = run(dp4, root / "whole", 0, 6)
    worst = max(np.abs(resumed.read_full(n) - whole.read_full(n)).max() / np.abs(whole.read_full(n)).max()
                for n in whole.names)
    print(f"2-3. resumed at (dp 4) vs uninterrupted (dp 4): {len(whole.names)} tensors, max relative "
          f"difference {worst:.1e}")
    assert worst <= 1e-10

    dp4_identity = resumed.meta["run"]
    print(f"4. identity at (dp 4) == at (dp 2, tp 2): {dp4_identity == identity} (the layout is not part of it)")
    print("   with --seed 1: " + resume_refusal(dataclasses.replace(dp4, seed=1), root / "run").replace(
        str(root) + "/", "").replace("\n", "\n   "))

    manifest = resumed.dir / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"data_position": 6', '"data_position": 9'))
    found = latest_valid(root / "run", log=lambda line: print("5. " + line.replace(str(root) + "/", "")))
    print(f"   latest valid: {found.name}")
    assert found == first.dir

    state = export_safetensors(whole.dir, root / "model.safetensors")
    loaded = safetensors.numpy.load_file(root / "model.safetensors")
    print(f"6. exported {len(state)} parameters, e.g. transformer.wte.weight {loaded['transformer.wte.weight'].shape}")
    assert all(np.array_equal(loaded[n], whole.read_full(n)) for n in state)

    if png:
        draw(png, first, DRAWN)
        print(f"   who reads which saved box drawn in {png}")
    try:
        find_mpiexec()
    except SystemExit:
        print("7. skipped: the restart needs mpiexec (pip install mpich)")
        return
    restarted, uninterrupted = restart(root / "restart")
    print(f"   losses, restarted:     {' '.join(f'{x:.4f}' for x in restarted)}\n"
          f"   losses, uninterrupted: {' '.join(f'{x:.4f}' for x in uninterrupted)}")
    assert restarted == uninterrupted, (restarted, uninterrupted)
    print(f"   final loss {restarted[-1]!r} = the uninterrupted run's, bitwise (steps 6 and 7 ran again after the "
          "restart)")


def main():
    ap = argparse.ArgumentParser(description="Lesson 6: sharded checkpoints that reshard; a restart.")
    ap.add_argument("--png", help="draw which saved boxes each rank of a new layout reads into this PNG")
    args = ap.parse_args()
    check_launch(ap, args, mpiexec=False)  # alone: it starts its jobs itself
    with tempfile.TemporaryDirectory(prefix="lesson6-") as root:  # removed on the way out, failed or not
        lesson(Path(root), args.png)
    print("\nTry: in restart(), --fail-at-step 5: the launcher resumes from step-000003 (the newest save\n"
          "     before the kill), steps 3 and 4 run twice, and the losses still match bitwise.\n"
          "     In 5., flip the last byte of run/step-000006/rank-00001.safetensors instead of editing the\n"
          "     manifest: 'checkpoint step-000006 skipped: run/step-000006/rank-00001.safetensors: checksum\n"
          "     mismatch ...', and latest valid is step-000003 again.")
    print("Checkpoints reshard, refuse another run, skip a corrupt save, and restart to the same loss. "
          "All checks passed.")


if __name__ == "__main__":
    main()
