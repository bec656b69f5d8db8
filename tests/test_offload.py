"""ZeRO-Offload and ZeRO-Infinity (minidist/parallel/zero/offload.py): the specification.

1. An offloaded ZeroOptimizer equals the same one without offload BITWISE (every stage, host
   memory or files, optimizer states alone or with ZeRO-3's parameters, float64, float16 and
   bfloat16): the same element-wise update runs on the same numbers, only elsewhere.
2. Each rank holds the bytes the formula says on the device, the host and the disk, and moves the
   bytes it says per step: the gradient shard down, the parameter shard up (under ZeRO-3 with the
   parameters offloaded: once per all-gather instead), the stored state read and written once.
3. The trainer's offloaded runs equal the same runs without offload bitwise, across dp, tp, sp, pp
   (1F1B, ZB-H1, ZB-V), cp, experts, recompute and mixed precision; a checkpoint of an offloaded run
   resumes with or without offload, and one without offload resumes with it, bitwise.
4. State moved to disk leaves the process: its peak RSS falls by it, against the same state kept in
   host memory.
5. Flags that cannot run are refused before anything is sent; offloading parameters below ZeRO-3
   (no parameter shards there) is the optimizer's offload.
"""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import minidist
from minidist import run_local
from minidist.amp import DynamicLossScaler
from minidist.checkpoint import step_dir
from minidist.model import GPT
from minidist.parallel.zero.offload import Offload
from minidist.parallel.zero.full_state import full_parameters
from minidist.parallel.zero.optimizer import ZeroOptimizer
from minidist.train import train
from minidist.train.config import ConfigError, TrainConfig, check_config
from minidist.train.outputs import TIMINGS
from minidist.inspect import zero_memory
from minidist.parallel.compose.gradients import apply_gradients
from tests.mpi import zero_reference as zr

STEPS = 4
MODEL_DTYPE = {None: "float64", "float16": "float16", "bfloat16": "float32"}


def zero_run(group, stage, mixed, offload):
    """Four AdamW steps under ZeRO on ``group`` (clipped; mixed precision with a dynamic loss scale):
    (losses, grad norms, every master weight, bytes held, the formula, bytes moved in the last step)."""
    model = GPT(zr.CONFIG, seed=zr.SEED, dtype=MODEL_DTYPE[mixed])
    zero = ZeroOptimizer(model, group, stage, "adamw", **zr.HYPER["adamw"], offload=offload, mixed_precision=mixed,
                         scaler=DynamicLossScaler(group=group) if mixed else None)
    rows = np.array_split(np.arange(zr.BATCH), group.size)[group.rank]
    losses, norms = [], []
    for step in range(STEPS):
        idx, targets = zr.batch(step)
        zero.zero_grad()
        _, loss = model(idx[rows], targets[rows])
        (loss * (zero.scaler.scale if mixed else 1.0)).backward()
        losses.append(loss.item())
        norms.append(apply_gradients(zero, zr.lr(step, "adamw"), zr.CLIP, zero.scaler))
    held, formula = zero_memory.model_state_bytes(zero), zero_memory.formula(zero)
    moved = dict(offload.moved) if offload is not None else {}
    with full_parameters(zero, masters=True):
        state = {k: v.copy() for k, v in model.state_dict().items()}
    zero.close()
    return losses, norms, state, held, formula, moved


CASES = [(stage, what, disk) for stage in range(4) for what in ("optimizer", "optimizer,params") for disk in (False, True)
         if stage == 3 or what == "optimizer"]


@pytest.mark.parametrize("mixed", [None, "float16", "bfloat16"])
@pytest.mark.parametrize("stage, what, disk", CASES, ids=lambda v: str(v))
def test_an_offloaded_zero_optimizer_is_bitwise_the_one_without_and_holds_the_formula(stage, what, disk, mixed, tmp_path):
    plain = minidist.run_local(lambda g: zero_run(g, stage, mixed, None), 2)
    offloaded = minidist.run_local(
        lambda g: zero_run(g, stage, mixed, Offload(what, tmp_path if disk else None, g.rank)), 2)
    psi = sum(p.data.size for p in GPT(zr.CONFIG).parameters())  # the tied embedding once
    b = np.dtype(MODEL_DTYPE[mixed]).itemsize
    k = 2 * (4 if mixed else b) + 4 * bool(mixed)  # AdamW's K: two moments (+ float32 masters)
    n = {"parameters": 2 if stage == 3 else 1, "gradients": 2 if stage >= 2 else 1, "optimizer": 2 if stage else 1}
    params = what == "optimizer,params"
    stored = psi * k / n["optimizer"] + (psi * b / n["optimizer"] if params or not mixed else 0)
    expected = {"parameters": 0 if params else psi * b / n["parameters"], "gradients": psi * b / n["gradients"],
                "optimizer": 0, "host": psi * b / n["optimizer"] + (0 if disk else stored), "disk": stored if disk else 0}
    for (losses, norms, state, held, formula, moved), (ref_losses, ref_norms, ref_state, *_) in zip(offloaded, plain):
        assert losses == ref_losses and norms == ref_norms
        for name, value in ref_state.items():
            assert np.array_equal(state[name], value), name
        assert formula == expected
        assert held == formula  # measured from the live arrays, to the byte (CONFIG's units divide by 2)
        if not params:  # the new parameter shard goes up once per step
            assert moved["up"] == psi * b / n["optimizer"]
        assert moved["write"] == (stored if disk else 0)  # the whole store, written back once
    assert list(tmp_path.iterdir()) == []  # close() removed the files


def test_bytes_moved_per_step_follow_the_formula_and_zero_3_parameters_go_up_once_per_all_gather(tmp_path):
    def run(group):
        model = GPT(zr.CONFIG, seed=zr.SEED, dtype="float64")
        off = Offload("optimizer,params", tmp_path, group.rank)
        zero = ZeroOptimizer(model, group, 3, "adamw", **zr.HYPER["adamw"], offload=off)
        idx, targets = zr.batch(0)
        rows = np.array_split(np.arange(zr.BATCH), group.size)[group.rank]
        zero.zero_grad()
        group.trace.clear()
        model(idx[rows], targets[rows])[1].backward()
        zero.reduce()  # ZeRO's own steps of the pipeline (no clipping)
        zero.unscale(1.0)
        zero.update(1e-3)
        gathered = sum(e.nbytes for e in group.trace.events if e.op == "all_gather" and e.group == group.name)
        shard = sum(s.unit.hi - s.unit.lo for s in zero.shards) * 8
        stored = sum(a.nbytes for s in zero.shards for a in s.stored)
        return dict(off.moved), gathered, shard, stored
    for moved, gathered, shard, stored in minidist.run_local(run, 2):
        assert moved["down"] == shard  # every gradient shard once
        assert moved["up"] == gathered / 2  # each all-gather's input: this rank's shard, fetched first
        assert moved["write"] == stored  # masters (= the shards in float64) and moments, once
        assert moved["read"] == stored + gathered / 2  # once by the step, once per all-gather


def test_offload_requires_zero_3_for_parameters():
    with pytest.raises(ValueError, match="stages 0-2 keep every parameter whole"):
        minidist.run_local(lambda g: ZeroOptimizer(GPT(zr.CONFIG, dtype="float64"), g, 2, "sgd", lr=0.1,
                                                   offload=Offload("optimizer,params")), 1)


# ---- the trainer ---------------------------------------------------------------------------------------

TINY = dict(n_layer=4, n_head=4, n_embd=16, block_size=16, batch_size=8, steps=4, eval_every=100, eval_iters=1,
            dtype="float64", sample_tokens=0, warmup=1, lr=1e-2, grad_clip=0.5, bucket_mb=0.01, optimizer="adamw")


def fit(cfg):
    """(history rows without timings, exported weights) of ``cfg`` on its thread ranks."""
    histories = run_local(lambda group: train(cfg, progress=False, world=group)[1], cfg.dp * cfg.tp * cfg.pp * cfg.cp)
    rows = [{k: v for k, v in r.items() if k not in TIMINGS} for r in histories[0]]
    return rows, dict(np.load(cfg.export))


LAYOUTS = [
    dict(dp=2, tp=2, zero=1, sequence_parallel=True, offload="optimizer"),
    dict(dp=2, pp=2, zero=2, schedule="zb-h1", micro_batches=4, dtype="bfloat16", offload="optimizer", disk=True),
    dict(dp=2, pp=2, zero=3, micro_batches=2, offload="optimizer,params", disk=True),
    dict(dp=2, tp=2, zero=3, dtype="float16", offload="optimizer,params", recompute="full"),
    dict(pp=2, schedule="zbv", virtual_stages=2, zero=2, offload="optimizer", dtype="float16"),
    dict(dp=2, cp=2, cp_algorithm="zigzag", zero=3, offload="optimizer,params"),
    dict(dp=2, ep=2, n_experts=4, moe_every=2, zero=2, offload="optimizer", disk=True),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: " ".join(f"{k}={v}" for k, v in c.items()))
def test_offloaded_training_runs_are_bitwise_the_runs_without_offload(layout, data_dir, tmp_path):
    layout = dict(layout)
    disk = layout.pop("disk", False)
    cfg = TrainConfig(**{**TINY, **layout}, data_dir=data_dir, export=str(tmp_path / "off.npz"),
                      offload_dir=str(tmp_path / "offload") if disk else None)
    rows, weights = fit(cfg)
    ref_rows, ref_weights = fit(dataclasses.replace(cfg, offload="none", offload_dir=None, export=str(tmp_path / "ref.npz")))
    assert rows == ref_rows
    for name, value in ref_weights.items():
        assert np.array_equal(weights[name], value), name
    if disk:
        assert not any((tmp_path / "offload").rglob("*.bin"))  # the run removed its files


@pytest.mark.parametrize("first, then", [("offload", "plain"), ("offload", "offload"), ("plain", "offload")])
def test_checkpoints_resume_with_or_without_offload_bitwise(first, then, data_dir, tmp_path):
    offload = dict(offload="optimizer,params", offload_dir=str(tmp_path / "offload"))
    plain = dict(offload="none", offload_dir=None)
    cfg = TrainConfig(**{**TINY, "steps": 6, "dtype": "bfloat16"}, data_dir=data_dir, dp=2, zero=3,
                      ckpt_dir=str(tmp_path / "ckpt"), save_every=3, export=str(tmp_path / "w.npz"))
    whole_rows, whole = fit(dataclasses.replace(cfg, ckpt_dir=None, save_every=0, export=str(tmp_path / "whole.npz")))
    fit(dataclasses.replace(cfg, **(offload if first == "offload" else plain)))
    step_dir(cfg.ckpt_dir, 6).rename(tmp_path / "lost")  # as if the job died before its last save
    rows, weights = fit(dataclasses.replace(cfg, resume=True, **(offload if then == "offload" else plain)))
    assert rows == whole_rows[3:]
    for name, value in whole.items():
        assert np.array_equal(weights[name], value), name


def test_explain_and_the_memory_table_say_what_lives_and_moves_where(data_dir, tmp_path, capsys):
    cfg = TrainConfig(**{**TINY, "steps": 1}, data_dir=data_dir, dp=2, zero=2, offload="optimizer",
                      offload_dir=str(tmp_path / "off"), explain=True)
    run_local(lambda group: train(cfg, progress=False, world=group), 2)
    out = capsys.readouterr().out
    assert out.count("offload: its optimizer shard (masters, moments) in files under") == 2  # one per rank
    assert "disk: read" in out and "down " in out and "up " in out
    assert "ZeRO-2 + offload to the disk formula" in out and "host" in out and "disk" in out


@pytest.mark.parametrize("changes, message", [
    (dict(offload="params"), "--offload must be one of none, optimizer, optimizer,params"),
    (dict(offload_dir="x"), "--offload-dir is where offloaded state lives"),
    (dict(offload="optimizer", mode="ps", servers=1), "--offload"),
])
def test_flags_that_cannot_run_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_config(TrainConfig(**changes), 2 if changes.get("mode") == "ps" else 1)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_offloading_parameters_below_zero_3_is_refused_saying_what_to_use_instead(zero, tmp_path):
    # stages 0-2 keep every parameter whole on each rank: no parameter shard to move (the trainer, the
    # planner and the support matrix refuse it alike: tests/test_layout_problems.py)
    cfg = TrainConfig(**TINY, dp=2, zero=zero, offload="optimizer,params", offload_dir=str(tmp_path / "off"))
    with pytest.raises(ConfigError, match=rf"--offload optimizer,params needs --zero 3, got --zero {zero} .*: use "
                                          rf"--offload optimizer, or --zero 3 to offload the parameter shards too"):
        check_config(cfg, 2)


def test_an_offload_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="is not a folder"):
        check_config(TrainConfig(offload="optimizer", offload_dir=str(tmp_path / "f" / "sub")), 1)


# ---- memory --------------------------------------------------------------------------------------------

RSS_SCRIPT = """
import json, sys
from pathlib import Path
from minidist.train import train
from minidist.train.config import TrainConfig
cfg = TrainConfig(**json.loads(sys.argv[1]))
model, _ = train(cfg, progress=False)
peak = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
print(json.dumps({"peak_rss": int(peak.split()[1]) * 1024}))
"""


def peak_rss(cfg: dict) -> int:
    """The peak resident set of a process that trains ``cfg``: its VmHWM (``ru_maxrss`` would start
    from this process's own peak, which Linux hands to a child started by vfork + exec). glibc's mmap
    threshold is fixed, so every large array is its own mapping and a freed temporary leaves the
    resident set at once (by default the threshold grows with the arrays freed, and freed heap memory
    stays resident)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, json.dumps(cfg)], capture_output=True, text=True,
                         check=True, env=env)
    return json.loads(out.stdout.splitlines()[-1])["peak_rss"]


def test_state_moved_to_disk_leaves_the_process(data_dir, tmp_path):
    # 8 blocks of width C = 256, float32 AdamW: the store holds a master copy and two moments, 12
    # bytes per parameter. In host memory they are resident; in files only the unit being updated is.
    C, layers = 256, 8
    base = dict(n_layer=layers, n_head=4, n_embd=C, block_size=32, batch_size=2, steps=2, eval_every=100, eval_iters=1,
                sample_tokens=0, optimizer="adamw", zero=1, offload="optimizer", data_dir=data_dir)
    host = peak_rss(base)
    disk = peak_rss({**base, "offload_dir": str(tmp_path / "off")})
    block = 12 * C * C + 13 * C
    psi = layers * block + 256 * C + 32 * C + 2 * C
    assert host - disk >= 12 * psi - 12 * block, (host, disk, 12 * psi)
