"""Input validation of ``python -m minidist.train``: every numeric flag has a range, nonsense (a
negative learning rate, an empty batch, nan) is refused with one message listing every problem, on
every rank, with exit status 2 and before anything is sent; so is data too short for one window.
"""
import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from minidist.train import train
from minidist.train.build import load_data
from minidist.parallel.spec import RANGES as LAYOUT_RANGES
from minidist.train.config import RANGES, ConfigError, TrainConfig, check_config
from minidist.train.cli import parse_args
from tests.mpi.harness import REPO, run_mpi

TINY = ["--steps", "2", "--batch-size", "2", "--n-layer", "1", "--n-head", "2", "--n-embd", "8",
        "--block-size", "8", "--eval-iters", "1", "--sample-tokens", "0"]


@pytest.mark.parametrize("flag, value, message", [
    ("--steps", "0", "--steps must be >= 1, got 0"),
    ("--steps", "-5", "--steps must be >= 1, got -5"),
    ("--batch-size", "0", "--batch-size must be >= 1, got 0"),
    ("--lr", "-1", "--lr must be >= 0, got -1.0"),  # 0 is allowed: tests/test_quiet_errors.py
    ("--lr", "nan", "--lr must be >= 0, got nan"),
    ("--lr", "inf", "--lr must be >= 0 and finite, got inf"),
    ("--min-lr", "-0.1", "--min-lr must be >= 0, got -0.1"),
    ("--min-lr", "1", "--min-lr 1.0 is larger than --lr 0.003"),
    ("--warmup", "-1", "--warmup must be >= 0, got -1"),
    ("--momentum", "1", "--momentum must be in [0, 1), got 1.0"),
    ("--momentum", "-0.5", "--momentum must be in [0, 1), got -0.5"),
    ("--weight-decay", "-1", "--weight-decay must be >= 0, got -1.0"),
    ("--weight-decay", "nan", "--weight-decay must be >= 0, got nan"),
    ("--grad-clip", "-1", "--grad-clip must be >= 0, got -1.0"),
    ("--grad-clip", "inf", "--grad-clip must be >= 0 and finite, got inf"),
    ("--n-layer", "0", "--n-layer must be >= 1, got 0"),
    ("--n-head", "0", "--n-head must be >= 1, got 0"),
    ("--n-embd", "0", "--n-embd must be >= 1, got 0"),
    ("--block-size", "0", "--block-size must be >= 1, got 0"),
    ("--eval-every", "0", "--eval-every must be >= 1, got 0"),
    ("--eval-iters", "0", "--eval-iters must be >= 1, got 0"),
    ("--sample-tokens", "-1", "--sample-tokens must be >= 0, got -1"),
    ("--loss-scale-window", "0", "--loss-scale-window must be >= 1, got 0"),
    ("--seed", "-1", "--seed must be >= 0, got -1"),
    ("--servers", "0", "--servers must be >= 1, got 0"),
    ("--staleness", "-2", "--staleness must be >= -1, got -2"),
    ("--straggler", "-1", "--straggler must be >= 0, got -1.0"),
    ("--virtual-stages", "0", "--virtual-stages must be >= 1, got 0"),
    ("--bucket-mb", "nan", "--bucket-mb must be positive, got nan"),
    ("--fail-at-step", "-2", "--fail-at-step must be >= -1, got -2"),
    ("--fail-rank", "-1", "--fail-rank must be >= 0, got -1"),
])
def test_a_number_out_of_range_is_refused_naming_the_flag(flag, value, message):
    with pytest.raises(ConfigError) as error:
        check_config(parse_args([flag, value]), 1)
    assert message in str(error.value)


def test_every_problem_is_listed_in_one_error():
    with pytest.raises(ConfigError) as error:
        check_config(parse_args(["--lr", "-1", "--batch-size", "0", "--steps", "-5", "--eval-iters", "0"]), 1)
    for flag in ("--lr", "--batch-size", "--steps", "--eval-iters"):
        assert f"{flag} must be" in str(error.value)


def test_every_numeric_field_has_a_range_or_a_check_of_its_own():
    elsewhere = {"save_every", "keep", "comm_timeout"}  # checked with their features
    numeric = {f.name for f in dataclasses.fields(TrainConfig)
               if type(getattr(TrainConfig(), f.name)) in (int, float)}
    assert numeric - elsewhere == set(RANGES) | set(LAYOUT_RANGES), "a numeric flag without a range"
    assert not set(RANGES) & set(LAYOUT_RANGES), "a range in two places"  # the layout's: minidist/parallel/spec.py


@pytest.mark.parametrize("flag, value, message", [
    ("--dp", "0", "--dp must be >= 1, got 0"),
    ("--tp", "-1", "--tp must be >= 1, got -1"),
    ("--micro-batches", "0", "--micro-batches must be >= 1, got 0"),
    ("--n-experts", "-1", "--n-experts must be >= 0, got -1"),
    ("--top-k", "0", "--top-k must be >= 1, got 0"),
])
def test_a_layout_number_out_of_range_is_refused_naming_the_flag(flag, value, message):
    with pytest.raises(ConfigError) as error:
        check_config(parse_args([flag, value]), 1)
    assert message in str(error.value)


def test_numbers_and_the_layout_are_refused_together():
    """A bad number does not hide a layout that cannot run: the user sees both at once."""
    with pytest.raises(ConfigError) as error:
        check_config(parse_args(["--lr", "-1", "--tp", "3", "--schedule", "gpipe"]), 3)
    for message in ("--lr must be >= 0, got -1.0", "n_head 4 is not divisible by tp 3",
                    "--schedule gpipe needs --pp > 1"):
        assert message in str(error.value)


def test_the_defaults_are_in_range():
    check_config(TrainConfig(), 1)


def test_fail_rank_outside_a_resumed_world_is_allowed():
    """A resumed run never crashes on purpose, so an elastic restart on fewer ranks keeps --fail-rank."""
    cfg = TrainConfig(dp=2, ckpt_dir="c", fail_at_step=3, fail_rank=2)
    with pytest.raises(ConfigError, match="--fail-rank 2 is not a rank of the 2-rank world"):
        check_config(cfg, 2)
    check_config(dataclasses.replace(cfg, resume=True), 2)


def test_the_command_line_refuses_a_negative_learning_rate_with_exit_status_2(tmp_path):
    run = subprocess.run([sys.executable, "-m", "minidist.train", "--lr", "-1", "--data-dir", str(tmp_path)],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert run.returncode == 2, run.stderr
    assert "--lr must be >= 0, got -1.0" in run.stderr and "Traceback" not in run.stderr
    assert not list(tmp_path.iterdir())  # refused before the data was even generated


def test_every_rank_refuses_a_bad_flag_under_mpi(tmp_path):
    run = run_mpi(2, "-m", "minidist.train", "--dp", 2, "--steps", 0, "--data-dir", tmp_path, check=False)
    assert run.returncode == 2, run.output
    assert run.stderr.count("--steps must be >= 1, got 0") == 1 and "Traceback" not in run.stderr


def short_file(tmp_path, n_tokens):
    path = tmp_path / "short.txt"
    path.write_bytes(b"ab" * (n_tokens // 2))
    return path


@pytest.mark.parametrize("n_tokens", [0, 40, 120])
def test_data_too_short_for_a_training_and_a_validation_window_is_refused(tmp_path, n_tokens):
    path = short_file(tmp_path, n_tokens)
    with pytest.raises(ConfigError) as error:
        load_data(parse_args(["--data", str(path), "--block-size", "16"]))
    n_val = n_tokens // 10
    assert (f"--data {path}: {n_tokens} tokens, {n_tokens - n_val} for training and {n_val} for validation; "
            f"each needs at least block_size + 1 = 17") in str(error.value)


def test_a_missing_data_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="--data .*missing.txt: no such file"):
        load_data(parse_args(["--data", str(tmp_path / "missing.txt")]))


def test_just_long_enough_data_trains(tmp_path):
    path = short_file(tmp_path, 180)  # 162 train, 18 validation tokens: windows of 17 fit both
    corpus = load_data(parse_args(["--data", str(path), "--block-size", "16"]))[1]
    train_tokens, val_tokens = corpus.train, corpus.val
    assert len(train_tokens) == 162 and len(val_tokens) == 18
    _, history = train(parse_args(TINY + ["--data", str(path), "--block-size", "16"]), progress=False)
    assert len(history) == 2 and np.isfinite(history[-1]["val_loss"])


def test_data_too_short_exits_2_on_every_rank_before_any_step(tmp_path):
    path = short_file(tmp_path, 100)
    run = run_mpi(2, "-m", "minidist.train", *TINY, "--dp", 2, "--block-size", 16, "--data", path,
                  "--out", tmp_path / "out", check=False)
    assert run.returncode == 2, run.output
    assert f"--data {path}: 100 tokens" in run.stderr and "Traceback" not in run.stderr
    assert "step" not in run.stdout and not (tmp_path / "out" / "metrics.jsonl").exists()
