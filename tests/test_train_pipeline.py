"""Pipeline parallelism in the trainer: ``--pp`` with every schedule, alone and with data and tensor
parallelism (the 8-rank 3D layout too), trains to the numbers of one process on the full batch
(losses and exported weights, float64, 1e-10 relative, SGD with momentum and AdamW, clipping active),
in-process and through the command line under real MPI. Layouts a pipeline cannot run are refused
before anything is sent; the stages' state dicts are merged into one full export."""
import dataclasses
import re

import numpy as np
import pytest

from minidist import run_local
from minidist.parallel.whole_model.consolidate import gather_state_dicts
from minidist.train.config import ConfigError, TrainConfig, check_config
from minidist.train.cli import parse_args
from tests.mpi.harness import find_mpiexec
from tests.test_train_zero import TINY, assert_cli_layouts_match_one_process, assert_matches, losses_and_export

needs_mpi = pytest.mark.skipif(find_mpiexec() is None, reason="mpiexec not found")
MPI_LAYOUTS = [f"{flags} --optimizer {opt}" for opt in ("sgd", "adamw") for flags in (
    "--pp 2 --schedule gpipe --micro-batches 4",
    "--pp 2 --schedule interleaved --virtual-stages 2 --micro-batches 4 --n-layer 4",
    "--dp 2 --pp 2 --schedule 1f1b --micro-batches 2",
    "--tp 2 --pp 2 --schedule 1f1b --micro-batches 4",
    "--dp 2 --pp 2 --zero 1 --micro-batches 2")]


@pytest.mark.parametrize("changes, world_size, message", [
    (dict(dp=2, pp=2), 2, "world size 2 != dp * pp * tp = 2 * 2 * 1 = 4"),
    (dict(pp=2, virtual_stages=2, schedule="interleaved", micro_batches=2), 2,
     "pp * virtual_stages = 2 * 2 pipeline stages need at least as many blocks, n_layer is 2"),
    (dict(pp=2, virtual_stages=2, n_layer=4), 2, "--virtual-stages 2 needs --schedule interleaved"),
    (dict(pp=2, schedule="interleaved", micro_batches=1), 2,
     "the interleaved schedule needs micro_batches (1) to be a multiple of pp (2)"),
    (dict(pp=2, schedule="zbv", n_layer=4), 2,
     "--schedule zbv places two chunks per rank in a V: it needs --virtual-stages 2, got 1"),
    (dict(schedule="zigzag"), 1, "--schedule must be one of gpipe, 1f1b, interleaved, zb-h1, zbv, got 'zigzag'"),
    (dict(pp=0), 0, "--pp must be >= 1, got 0"),
])
def test_layouts_a_pipeline_cannot_run_are_refused_with_a_clear_message(changes, world_size, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(dataclasses.replace(TrainConfig(**TINY), **changes), world_size)


def test_the_stages_state_dicts_are_merged_on_the_first_rank_in_rank_order():
    dtypes = ["float64", "int64", "float32"]

    def fn(group):
        r = group.rank
        return gather_state_dicts({f"w{r}": np.full((r + 1, 2), r, dtype=dtypes[r]), "shared": np.array([r])}, group)

    merged, *others = run_local(fn, 3)
    assert others == [None, None]
    assert list(merged) == ["w0", "shared", "w1", "w2"]
    for r, dtype in enumerate(dtypes):
        np.testing.assert_array_equal(merged[f"w{r}"], np.full((r + 1, 2), r, dtype=dtype), strict=True)
    assert merged["shared"].tolist() == [2]  # a name several ranks hold: the last rank's value


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_every_schedule_with_data_and_tensor_parallelism_trains_like_one_process(data_dir, tmp_path, optimizer):
    base = TrainConfig(**dict(TINY, n_layer=4), data_dir=data_dir, optimizer=optimizer)
    reference = losses_and_export(base, 1, tmp_path / "one.npz")
    for i, changes in enumerate([
            dict(pp=2, schedule="gpipe", micro_batches=4), dict(pp=4, micro_batches=2),
            dict(pp=2, schedule="interleaved", virtual_stages=2, micro_batches=4),
            dict(dp=2, pp=2, micro_batches=2), dict(tp=2, pp=2, sequence_parallel=True, micro_batches=4),
            dict(pp=2, recompute="full", micro_batches=2)]):
        cfg = dataclasses.replace(base, **changes)
        assert_matches(losses_and_export(cfg, cfg.dp * cfg.pp * cfg.tp, tmp_path / f"{i}.npz"), reference)


def test_zero_1_under_pipeline_parallelism_trains_like_one_process(data_dir, tmp_path):
    base = TrainConfig(**TINY, data_dir=data_dir, optimizer="adamw")
    reference = losses_and_export(base, 1, tmp_path / "one.npz")
    cfg = dataclasses.replace(base, dp=2, pp=2, zero=1)
    assert_matches(losses_and_export(cfg, 4, tmp_path / "zero1.npz"), reference)


def test_the_3d_command_line_on_8_in_process_ranks_trains_like_one_process(data_dir, tmp_path):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()] + [
        "--batch-size", "16", "--optimizer", "adamw", "--data-dir", data_dir]
    reference = losses_and_export(parse_args(flags), 1, tmp_path / "one.npz")
    cfg = parse_args(flags + "--dp 2 --tp 2 --pp 2 --schedule 1f1b --micro-batches 8".split())
    assert_matches(losses_and_export(cfg, 8, tmp_path / "3d.npz"), reference)


@needs_mpi
def test_pipeline_command_lines_under_mpi_match_one_process(tmp_path):
    assert_cli_layouts_match_one_process(MPI_LAYOUTS, tmp_path)
