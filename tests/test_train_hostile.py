"""Extreme numbers on the trainer's command line end in exit status 2 and one clear message per
problem, on every rank, before anything is sent; a run that cannot fit in memory is refused with
the estimate and the memory available (minidist/train/config.py, minidist/train/memory.py).

Each case here was a traceback before (a 200-case fuzz of the trainer's real flags found them:
tests/test_fuzz_train.py keeps looking): ``--bucket-mb 1e-300`` (ValueError), ``--bucket-mb 1e308``
(OverflowError), ``--n-embd 10**20`` (ValueError: maximum allowed dimension exceeded), ``--steps
2**63`` (OverflowError in the progress bar), ``--batch-size 2**31`` (MemoryError),
``--capacity-factor 1e308`` with experts (OverflowError), ``--n-embd 100000 --n-layer 1000``
(MemoryError: 112 GiB for one weight).
"""
import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from minidist import run_local
from minidist.model import GPT, GPTConfig
from minidist.parallel.mesh import DeviceMesh
from minidist.plan.models import from_gpt_config, parameter_count
from minidist.train import train
from minidist.train.build import build_parallel
from minidist.train.config import ConfigError, TrainConfig, bucket_bytes, check_config
from minidist.train.cli import parse_args
from minidist.train.memory import memory_available, memory_problems, model_elements, rank_bytes
from tests.mpi.harness import REPO, run_mpi
from tests.python_lines import python_lines

GiB = 2 ** 30
SHORT = ["--steps", "1", "--eval-every", "1", "--eval-iters", "1", "--sample-tokens", "0"]
TINY = dict(steps=2, batch_size=4, n_layer=2, n_head=2, n_embd=8, block_size=8, eval_every=100, eval_iters=1,
            sample_tokens=0, optimizer="sgd", dtype="float64")


def refusal(args, memory_bytes=64 * GiB) -> str:
    """The ConfigError check_config raises for ``args`` on one rank with ``memory_bytes``."""
    with pytest.raises(ConfigError) as error:
        check_config(parse_args(args), 1, memory_bytes)
    return str(error.value)


@pytest.mark.parametrize("args, message", [
    (["--n-embd", str(10 ** 20)], f"--n-embd must be below 2**63 (NumPy's sizes and indices are int64), got {10**20}"),
    (["--steps", str(2 ** 63)], f"--steps must be below 2**63 (NumPy's sizes and indices are int64), got {2 ** 63}"),
    (["--keep", str(2 ** 63)], "--keep must be below 2**63"),
    (["--dp", str(2 ** 63)], "--dp must be below 2**63"),
    (["--seed", str(10 ** 20)], "--seed must be below 2**63"),
    (["--fail-at-step", str(2 ** 64)], "--fail-at-step must be below 2**63"),
    (["--capacity-factor", "1e308", "--n-experts", "2"], "--capacity-factor must be in [0, 1e6], got 1e+308"),
    (["--straggler", "1e308"], "--straggler 1e+308 is not below --comm-timeout 300.0"),
    (["--bucket-mb", "inf"], "--bucket-mb must be positive and finite, got inf"),
    (["--bucket-mb", "0"], "--bucket-mb must be positive, got 0.0"),
])
def test_an_extreme_number_is_refused_naming_the_flag(args, message):
    text = refusal(args)
    assert message in text and text.count("\n  - ") == text.count("\n")  # one line per problem


@pytest.mark.parametrize("args, parts", [
    (["--n-embd", "100000", "--n-layer", "1000"], ["building: the whole GPT, 436.6 TiB", "optimizer 873.1 TiB"]),
    (["--batch-size", str(2 ** 31)], ["batch 1.0 TiB"]),
    (["--n-experts", str(2 ** 31), "--top-k", "1"], ["building: the whole GPT"]),
    (["--n-embd", str(2 ** 40)], ["e+"]),
    (["--block-size", str(2 ** 24)], ["activations"]),
])
def test_a_run_that_cannot_fit_in_memory_is_refused_with_the_estimate(args, parts):
    text = refusal(args)
    assert "the run needs at least" in text and "more than the 64.0 GiB of memory available here" in text
    for part in parts:
        assert part in text


def test_without_a_memory_size_the_limit_is_int64():
    """Library callers (no memory given) still never reach an int64 overflow in a shape product."""
    assert "more than 2**63 bytes" in refusal(["--n-embd", str(2 ** 40)], memory_bytes=None)
    check_config(parse_args(["--n-embd", "100000", "--n-layer", "1000"]), 1)  # 1.8 PiB: int64 counts it


def test_the_estimate_costs_the_same_for_any_number_of_blocks():
    """Counted in Python lines, not timed (tests/python_lines.py): a loop over the blocks would run
    millions of lines for 10**6 of them."""
    rank_bytes(TrainConfig(n_layer=3, n_experts=4, moe_every=3))  # first calls fill caches
    lines = []
    for n_layer in (3, 10 ** 6, 10 ** 18):
        with python_lines(limit=100_000) as counted:
            rank_bytes(TrainConfig(n_layer=n_layer, n_experts=4, moe_every=3))
        lines.append(counted.count)
    assert max(lines) <= 2 * lines[0], lines


@pytest.mark.parametrize("changes", [{}, dict(n_experts=4), dict(n_experts=4, moe_every=2, n_layer=5),
                                     dict(n_layer=7, n_embd=48, n_head=3, block_size=40)])
def test_the_count_by_kind_of_block_is_the_planners_count_and_the_built_models(changes):
    cfg = TrainConfig(**changes)
    model = from_gpt_config(cfg)
    assert model_elements(model) == parameter_count(model)
    gpt = GPT(GPTConfig(vocab_size=256, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                        n_embd=cfg.n_embd, n_experts=cfg.n_experts, moe_every=cfg.moe_every))
    assert rank_bytes(cfg)["build"] == sum(p.data.nbytes for p in gpt.parameters())


def test_a_run_that_fits_is_accepted_at_its_measured_size():
    """The estimate is a lower bound: the default run fits in a bit more than its own estimate."""
    cfg = TrainConfig()
    need = max(rank_bytes(cfg)["build"], sum(v for k, v in rank_bytes(cfg).items() if k != "build"))
    assert not memory_problems(cfg, int(need) + 1) and memory_problems(cfg, int(need) - 1)


def test_memory_available_is_the_machine_or_the_address_space_limit():
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < memory_available() <= physical
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
            "from minidist.train.memory import memory_available; print(memory_available())")
    limited = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0 < limited < 3 << 30


@pytest.mark.parametrize("bucket_mb, buckets", [(1e-300, "one per parameter"), (1e308, 1)])
def test_any_positive_bucket_size_trains_the_same(bucket_mb, buckets):
    """--bucket-mb 1e-300 was a ValueError and 1e308 an OverflowError: a bucket closes once it holds
    --bucket-mb, so a tiny one holds one parameter and a huge one the whole model; the losses are
    the ones of the default buckets."""
    assert bucket_bytes(1e-300) == 1 and bucket_bytes(1e308) == 2 ** 60 and bucket_bytes(1.0) == 2 ** 20
    cfg = TrainConfig(**TINY, dp=2, bucket_mb=bucket_mb, keep=2 ** 31)

    def count(group):
        model, state, _ = build_parallel(cfg, DeviceMesh(group, dp=2))
        return len(state.dp.buckets), len(list(model.parameters()))

    n_buckets, n_params = run_local(count, world_size=2)[0]
    assert n_buckets == (n_params if buckets == "one per parameter" else buckets)
    losses = run_local(lambda g: [h["loss"] for h in train(cfg, progress=False, world=g)[1]], world_size=2)
    default = run_local(lambda g: [h["loss"] for h in train(dataclasses.replace(cfg, bucket_mb=1.0), progress=False,
                                                                               world=g)[1]], world_size=2)
    assert losses == default and np.isfinite(losses[0]).all()


def test_nothing_is_sent_before_the_refusal():
    cfg = TrainConfig(**dict(TINY, n_embd=100_000, n_layer=1000, n_head=4, dp=2))

    def fn(group):
        with pytest.raises(ConfigError, match="the run needs at least"):
            train(cfg, progress=False, world=group, memory_bytes=64 * GiB)
        return group.seq

    assert run_local(fn, world_size=2) == [0, 0]


@pytest.mark.parametrize("args, message", [
    (["--bucket-mb", "1e-300"], None),
    (["--bucket-mb", "1e308", "--keep", "2147483648"], None),
    (["--n-embd", str(10 ** 20)], "--n-embd must be below 2**63"),
    (["--n-embd", "100000", "--n-layer", "1000"], "of memory available here"),
    (["--steps", "nan"], "argument --steps: invalid int value: 'nan'"),
])
def test_the_command_line_ends_in_0_or_2_without_a_traceback(tmp_path, args, message):
    run = subprocess.run([sys.executable, "-m", "minidist.train", *SHORT, "--data-dir", str(tmp_path), *args], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert "Traceback" not in run.stderr and run.returncode == (0 if message is None else 2), run.stderr
    if message is not None:
        assert message in run.stderr and len(run.stderr.splitlines()) <= 3, run.stderr


def test_every_rank_refuses_an_extreme_number_under_mpi(tmp_path):
    run = run_mpi(2, "-m", "minidist.train", "--dp", 2, "--n-embd", 10 ** 20, "--data-dir", tmp_path, check=False)
    assert run.returncode == 2, run.output
    assert run.stderr.count("--n-embd must be below 2**63") == 1 and "Traceback" not in run.stderr
