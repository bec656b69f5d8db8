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
from minidist.train_config import ConfigError, TrainConfig, check_config, parse_args
from minidist.train_outputs import sample
from tests.mpi.harness import find_mpiexec, run_mpi

needs_mpi = pytest.mark.skipif(find_mpiexec() is None, reason="mpiexec not found")
TINY = dict(n_layer=2, n_head=4, n_embd=16, block_size=16, batch_size=8, steps=10, eval_every=100,
            eval_iters=1, dtype="float64", sample_tokens=0, warmup=2, lr=1e-2, grad_clip=0.5, bucket_mb=0.01)
MPI_LAYOUTS = [f"--dp 4 --zero {stage} --optimizer {opt}" for stage in (1, 2, 3) for opt in ("sgd", "adamw")] + [
    "--dp 2 --tp 2 --zero 1 --optimizer sgd", "--dp 2 --tp 2 --zero 1 --sequence-parallel --optimizer adamw",
    "--dp 4 --zero 2 --recompute --optimizer adamw", "--dp 2 --tp 2 --recompute --optimizer sgd"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


def test_the_flags_map_onto_the_config():
    assert parse_args([]).zero == 0 and parse_args([]).recompute is False  # not bool("False")
    cfg = parse_args(["--zero", "3", "--recompute"])
    assert (cfg.zero, cfg.recompute) == (3, True)
    with pytest.raises(SystemExit):
        parse_args(["--zero", "4"])


@pytest.mark.parametrize("changes, world_size, message", [
    (dict(dp=2, pp=2, zero=2, micro_batches=2), 4, "ZeRO stage 2 with pipeline parallelism"),
    (dict(dp=2, pp=2, zero=3, micro_batches=2), 4, "ZeRO stage 3 with pipeline parallelism"),
    (dict(dp=2, tp=2, zero=2, sequence_parallel=True), 4, "--zero 2 with --sequence-parallel is not supported"),
    (dict(dp=2, zero=3, recompute=True), 2, "--recompute with --zero 3 is redundant"),
    (dict(zero=5), 1, "ZeRO stage must be 0, 1, 2 or 3, got 5"),
])
def test_unsupported_combinations_are_refused_with_a_clear_message(changes, world_size, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(dataclasses.replace(TrainConfig(**TINY), **changes), world_size)


def test_zero_1_under_pipeline_parallelism_is_a_valid_layout():
    check_config(TrainConfig(**dict(TINY, dp=2, pp=2, zero=1)), 4)


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
                                 dict(dp=2, tp=2, zero=3), dict(dp=2, recompute=True),
                                 dict(dp=2, zero=2, recompute=True)]):
        cfg = dataclasses.replace(base, **changes)
        assert_matches(losses_and_export(cfg, cfg.dp * cfg.tp, tmp_path / f"{i}.npz"), reference)


def assert_cli_layouts_match_one_process(layouts, tmp_path):
    """One 4-rank mpiexec launch of tests/mpi/train_pp_zero_cli.py: every layout's losses and weights
    within 1e-10 of one process's."""
    run = run_mpi(4, "train_pp_zero_cli.py", tmp_path / "data", tmp_path, *layouts, timeout=120)
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
def test_the_command_line_refuses_zero_2_with_a_pipeline_on_every_rank(tmp_path):
    run = run_mpi(4, "-m", "minidist.train", "--dp", "2", "--pp", "2", "--zero", "2", "--data-dir",
                  tmp_path, timeout=60, check=False)
    assert run.returncode == 2, run.output
    assert run.stderr.count("invalid configuration") == 1, run.output
    assert "ZeRO stage 2 with pipeline parallelism (pp=2) is not supported" in run.stderr
    assert "Traceback" not in run.stderr
