"""ZeRO and activation recomputation in the trainer: ``--zero 1|2|3`` and ``--recompute`` train to
the numbers of one process on the full batch (losses and exported weights, float64, 1e-10 relative,
SGD with momentum and AdamW, clipping active), in-process and through the command line under real
MPI; combinations they do not support are refused before anything is sent, with one clear message."""
import dataclasses
import json
import re

import numpy as np
import pytest

from minidist import run_local
from minidist.train import train
from minidist.train.config import ConfigError, TrainConfig, check_config
from minidist.train.cli import parse_args
from minidist.train.outputs import sample
from tests.mpi.harness import find_mpiexec, run_mpi

needs_mpi = pytest.mark.skipif(find_mpiexec() is None, reason="mpiexec not found")
TINY = dict(n_layer=2, n_head=4, n_embd=16, block_size=16, batch_size=8, steps=10, eval_every=100,
            eval_iters=1, dtype="float64", sample_tokens=0, warmup=2, lr=1e-2, grad_clip=0.5, bucket_mb=0.01)
MPI_LAYOUTS = [f"--dp 4 --zero {stage} --optimizer {opt}" for stage in (1, 2, 3) for opt in ("sgd", "adamw")] + [
    "--dp 2 --tp 2 --zero 1 --optimizer sgd", "--dp 2 --tp 2 --zero 1 --sequence-parallel --optimizer adamw",
    "--dp 4 --zero 2 --recompute --optimizer adamw", "--dp 2 --tp 2 --recompute --optimizer sgd",
    "--dp 2 --pp 2 --zero 3 --micro-batches 2 --optimizer sgd", "--dp 2 --tp 2 --zero 2 --sequence-parallel --optimizer sgd",
    "--dp 4 --zero 3 --recompute --optimizer adamw"]


def test_the_flags_map_onto_the_config():
    assert parse_args([]).zero == 0 and parse_args([]).recompute == "none"
    cfg = parse_args(["--zero", "3", "--recompute"])
    assert (cfg.zero, cfg.recompute) == (3, "full")
    with pytest.raises(SystemExit):
        parse_args(["--zero", "4"])


def test_a_zero_stage_outside_0_to_3_is_refused_with_a_clear_message():
    with pytest.raises(ConfigError, match=re.escape("--zero must be in [0, 3], got 5")):
        check_config(dataclasses.replace(TrainConfig(**TINY), zero=5), 1)


@pytest.mark.parametrize("changes, world_size", [
    (dict(dp=2, pp=2, zero=1), 4), (dict(dp=2, pp=2, zero=2, micro_batches=2), 4),
    (dict(dp=2, pp=2, zero=3, micro_batches=2), 4), (dict(dp=2, tp=2, zero=2, sequence_parallel=True), 4),
    (dict(dp=2, tp=2, zero=3, sequence_parallel=True), 4), (dict(dp=2, zero=3, recompute="full"), 2)])
def test_every_zero_stage_composes_with_pipelines_sequence_parallelism_and_recompute(changes, world_size):
    check_config(dataclasses.replace(TrainConfig(**TINY), **changes), world_size)  # once refused: now run


def losses_and_export(cfg, world_size, path):
    """Train ``cfg`` on ``world_size`` in-process ranks: (losses, exported full weights)."""
    cfg = dataclasses.replace(cfg, export=str(path))
    histories = run_local(lambda group: train(cfg, progress=False, world=group)[1], world_size)
    losses = np.array([r["loss"] for r in histories[0]])
    assert all([r["loss"] for r in h] == list(losses) for h in histories)  # every rank reports the same
    return losses, dict(np.load(path))


def assert_matches(result, reference):
    (losses, weights), (ref_losses, ref_weights) = result, reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0)
    assert weights.keys() == ref_weights.keys()
    for name, value in ref_weights.items():
        np.testing.assert_allclose(weights[name], value, rtol=1e-10, atol=1e-10 * np.abs(value).max(), err_msg=name)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_every_zero_stage_and_recompute_train_like_one_process(data_dir, tmp_path, optimizer):
    base = TrainConfig(**TINY, data_dir=data_dir, optimizer=optimizer)
    reference = losses_and_export(base, 1, tmp_path / "one.npz")
    for i, changes in enumerate([dict(dp=2, zero=1), dict(dp=2, zero=2, micro_batches=2), dict(dp=4, zero=3),
                                 dict(dp=2, tp=2, zero=3), dict(dp=2, recompute="full"),
                                 dict(dp=2, zero=2, recompute="full")]):
        cfg = dataclasses.replace(base, **changes)
        assert_matches(losses_and_export(cfg, cfg.dp * cfg.tp, tmp_path / f"{i}.npz"), reference)


def assert_cli_layouts_match_one_process(layouts, tmp_path):
    """One 4-rank mpiexec launch of tests/mpi/train_pp_zero_cli.py: every layout's losses and weights
    within 1e-10 of one process's."""
    run = run_mpi(4, "train_pp_zero_cli.py", tmp_path / "data", tmp_path, *layouts, timeout=300)
    rows = dict(re.findall(r"PARITY (.+) \| (\S+ \S+)", run.stdout))
    assert sorted(rows) == sorted(layouts), run.output
    for flags, errors in rows.items():
        loss_err, weight_err = map(float, errors.split())
        assert loss_err <= 1e-10 and weight_err <= 1e-10, f"{flags}: {errors}\n{run.output}"


@needs_mpi
def test_zero_command_lines_under_mpi_match_one_process(tmp_path):
    assert_cli_layouts_match_one_process(MPI_LAYOUTS, tmp_path)


@needs_mpi
def test_the_command_line_with_zero_3_exports_the_weights_of_one_process(data_dir, tmp_path):
    cfg = TrainConfig(**TINY, data_dir=data_dir, optimizer="adamw")
    reference = losses_and_export(cfg, 1, tmp_path / "one.npz")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    run = run_mpi(4, "-m", "minidist.train", *flags, "--data-dir", data_dir, "--optimizer", "adamw",
                  "--dp", "4", "--zero", "3", "--sample-tokens", "20", "--export", tmp_path / "zero3.npz",
                  "--out", tmp_path, timeout=90)
    assert "ZeRO-3 formula" in run.stdout and "measured on rank 0" in run.stdout, run.output
    one, _ = train(cfg, progress=False)  # ZeRO-3's sharded model writes one process's sample
    one.eval()
    assert "sample:\n" + sample(one, "The ", 20, seed=cfg.seed) + "\n" in run.stdout, run.output
    assert "10,944 parameters on rank 0" in run.stdout  # all of them: ZeRO shards what it stores, not the model
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert_matches((np.array(losses), dict(np.load(tmp_path / "zero3.npz"))), reference)


@needs_mpi
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_over_mpis_own_collectives_trains_like_one_process(data_dir, tmp_path, stage):
    # backend "mpi": ZeRO's all-gather of the updated shard sits inside its own receive buffer, which
    # MPI_Allgatherv refuses unless it is told MPI_IN_PLACE (this used to abort the job)
    cfg = TrainConfig(**TINY, data_dir=data_dir, optimizer="sgd")
    reference = losses_and_export(cfg, 1, tmp_path / "one.npz")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    run_mpi(2, "-m", "minidist.train", *flags, "--data-dir", data_dir, "--optimizer", "sgd", "--backend", "mpi",
            "--dp", "2", "--zero", str(stage), "--export", tmp_path / "z.npz", "--out", tmp_path, timeout=90)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert_matches((np.array(losses), dict(np.load(tmp_path / "z.npz"))), reference)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_2_and_3_under_a_pipeline_send_one_reduce_scatter_and_one_all_gather_per_step(data_dir, stage):
    # the design (torchtitan's FSDP with pipelining): a stage's gradients accumulate over its
    # micro-batches and are reduce-scattered once, after the last backward; ZeRO-3 keeps the stage's
    # units gathered from their first forward to their last backward. So per step each dp rank sends
    # (N-1)/N (G + P) on the dp group, whatever the number of micro-batches: ZeRO-1's traffic.
    from minidist.inspect.accounting import bus_bytes
    from minidist.parallel.mesh import DeviceMesh
    from minidist.parallel.step import train_step
    from minidist.train.build import build_parallel

    def sent(micro_batches):
        cfg = TrainConfig(**{**TINY, "n_layer": 2}, data_dir=data_dir, dp=2, pp=2, zero=stage, optimizer="sgd",
                          micro_batches=micro_batches)

        def run(group):
            mesh = DeviceMesh(group, dp=2, pp=2)
            model, optimizer, engine = build_parallel(cfg, mesh)
            batch = np.random.default_rng(0).integers(0, 256, size=(4, cfg.block_size + 1))
            train_step(model, optimizer, batch, 1e-3, 0.0, engine=engine, mesh=mesh, n_micro=micro_batches)
            mesh.dp_group.trace.clear()
            train_step(model, optimizer, batch, 1e-3, 0.0, engine=engine, mesh=mesh, n_micro=micro_batches)
            events = [e for e in mesh.dp_group.trace.events if e.kind != "compute"]
            P = sum(s.unit.numel for s in optimizer.shards) * 8  # float64 parameter bytes of this stage
            return bus_bytes(events, mesh.dp_group.name, 2), P
        return run_local(run, 4)
    for m in (2, 4):
        for (bytes_, P) in sent(m):
            assert bytes_["reduce_scatter"] == bytes_["all_gather"] == P / 2  # (N-1)/N G and (N-1)/N P
            assert bytes_["all_reduce"] == 8 + 16  # the step's loss (one float64), the norm's two partial sums
