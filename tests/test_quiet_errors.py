"""Quiet, complete errors from ``python -m minidist.train``: under ``mpiexec`` a usage error and a refused
configuration print once (rank 0; the other ranks exit 2 silently), a refusal lists every problem at
once, numbers and layout and the trainer's own, one per line; ``--help`` is grouped and shows each
default once; and ``--lr 0`` is a run whose weights never move (to evaluate or convert a model).
"""
import dataclasses
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from minidist.train.build import build_model
from minidist.train.config import ConfigError, TrainConfig, check_config
from minidist.train.cli import GROUPS, launcher_rank, parse_args
from tests.mpi.harness import REPO, ranks_said, run_mpi

TINY = ["--n-layer", "2", "--n-head", "4", "--n-embd", "16", "--block-size", "16", "--steps", "2", "--batch-size", "4",
        "--eval-iters", "1", "--sample-tokens", "0"]


def test_what_the_launcher_adds_is_not_counted_as_the_ranks_words():
    """Open MPI's mpiexec adds a boxed note on a non-zero exit, PMIx errors about ranks that already left,
    and its event library's warnings as their descriptors close (seen on CI); none is a rank's line."""
    stderr = ("python -m minidist.train: invalid configuration:\n"
              "  - --lr must be >= 0, got -1.0\n"
              "[warn] Epoll MOD(4) on fd 21 failed. Old events were 6; read change was 2 (del); write change was 0 "
              "(none); close change was 0 (none): Bad file descriptor\n"
              + "-" * 74 + "\nprterun detected that one or more processes exited with non-zero status,\n" + "-" * 74 + "\n"
              "[vm:01234] PMIX ERROR: UNREACHABLE in file server/pmix_server.c at line 1234\n")
    assert ranks_said(stderr).splitlines() == ["python -m minidist.train: invalid configuration:",
                                               "  - --lr must be >= 0, got -1.0"]


def test_a_usage_error_is_printed_once_under_mpiexec(tmp_path):
    run = run_mpi(4, "-m", "minidist.train", "--dpp", 2, "--data-dir", tmp_path, check=False)
    assert run.returncode == 2, run.output
    assert run.said.splitlines() == [
        "usage: python -m minidist.train [--flag value ...]  (--help lists every flag)",
        "python -m minidist.train: error: unrecognized arguments: --dpp 2"], run.output
    assert run.stdout == ""


def test_every_problem_is_listed_once_numbers_layout_and_the_trainers_own(tmp_path):
    """Before: --comm-timeout alone, printed by each of the 4 ranks; then, once fixed, --lr and the layout,
    and only after that --save-every without --ckpt-dir."""
    run = run_mpi(4, "-m", "minidist.train", "--dp", 2, "--tp", 3, "--lr", -1, "--comm-timeout", -1, "--save-every", 2,
                  "--data-dir", tmp_path, check=False)
    assert run.returncode == 2, run.output
    assert run.said.splitlines() == [
        "python -m minidist.train: invalid configuration:",
        "  - --lr must be >= 0, got -1.0",
        "  - world size 4 != dp * tp = 2 * 3 = 6 (start 6 ranks: mpiexec -n 6 ...)",
        "  - n_head 4 is not divisible by tp 3 (each tp rank holds whole heads)",
        "  - --comm-timeout must be a positive, finite number of seconds, got -1.0",
        "  - --save-every and --resume need --ckpt-dir (where the checkpoints live)"], run.output


@pytest.mark.parametrize("changes, messages", [
    (dict(steps=0, min_lr=1.0), ["--steps must be >= 1, got 0", "--min-lr 1.0 is larger than --lr 0.003"]),
    (dict(lr=float("nan"), min_lr=1.0), ["--lr must be >= 0, got nan"]),  # no comparison with a nan
    (dict(warmup=-1, optimizer="lion", offload_dir="d"),
     ["--warmup must be >= 0, got -1", "--optimizer must be one of sgd, adamw, got 'lion'",
      "--offload-dir is where offloaded state lives"]),
    (dict(mode="ps", straggler=400.0, servers=0),
     ["--servers must be >= 1, got 0", "--straggler 400.0 is not below --comm-timeout 300.0"]),
])
def test_a_bad_number_does_not_hide_the_other_problems(changes, messages, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a relative --offload-dir would go
    with pytest.raises(ConfigError) as error:
        check_config(TrainConfig(**changes), 2 if changes.get("mode") == "ps" else 1)
    lines = str(error.value).splitlines()[1:]
    assert len(lines) == len(messages), lines
    for line, message in zip(lines, messages):
        assert line.startswith(f"  - {message}"), lines


def test_the_rank_that_prints_a_usage_error_comes_from_the_launcher():
    assert launcher_rank({}) == 0
    assert launcher_rank({"PMI_RANK": "3"}) == 3
    assert launcher_rank({"OMPI_COMM_WORLD_RANK": "2", "SLURM_PROCID": "0"}) == 2  # srun's when nothing nearer says
    assert launcher_rank({"PMI_RANK": "", "SLURM_PROCID": "5"}) == 5


def test_a_quiet_rank_exits_2_printing_nothing(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--dpp", "2"], quiet=True)
    assert exit_info.value.code == 2 and capsys.readouterr() == ("", "")
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"], quiet=True)
    assert exit_info.value.code == 0 and capsys.readouterr() == ("", "")


def help_text() -> str:
    run = subprocess.run([sys.executable, "-m", "minidist.train", "--help"], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, COLUMNS="120"), timeout=60)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    return run.stdout


def test_help_is_grouped_and_shows_each_default_once():
    text = help_text()
    titles = [line[:-1] for line in text.splitlines() if re.fullmatch(r"[a-z][a-z ]+:", line)]
    assert titles == ["options", "training", "model", "data", "parallelism", "precision and memory",
                      "checkpoints and faults", "output and inspection"]
    options = text.split("\noptions:\n")[1].split("\n\n")[0]
    assert options.split() == ["-h,", "--help", "show", "this", "help", "message", "and", "exit"]  # every flag in a group
    assert "(default: None)" not in text and "(default: False)" not in text
    entries = re.split(r"\n  (?=-)", text)
    assert not [e for e in entries if e.count("(default:") > 1], "a default shown twice"
    assert "--offload {none,optimizer,optimizer,params}" not in text
    assert '--offload {none,optimizer,"optimizer,params"}' in text
    assert "(default: 800)" in text and "(default: the generated corpus)" in text


def test_every_field_has_one_place_in_the_help():
    grouped = [name for helps in GROUPS.values() for name in helps]
    assert sorted(grouped) == sorted(f for f in TrainConfig.__dataclass_fields__)
    assert len(grouped) == len(set(grouped))


def test_help_is_printed_once_under_mpiexec():
    run = run_mpi(4, "-m", "minidist.train", "--help")
    assert run.stdout.count("usage: python -m minidist.train") == 1, run.output


def test_a_learning_rate_of_0_is_accepted_and_the_rest_stays_refused():
    assert TrainConfig(lr=0).min_lr == 0 and TrainConfig().min_lr == 3e-4 and TrainConfig(lr=1e-4).min_lr == 1e-4
    check_config(parse_args(["--lr", "0"]), 1)
    for bad, message in (("-1", "--lr must be >= 0, got -1.0"), ("nan", "--lr must be >= 0, got nan"),
                         ("inf", "--lr must be >= 0 and finite, got inf")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_config(parse_args(["--lr", bad]), 1)
    with pytest.raises(ConfigError, match=re.escape("--min-lr 0.001 is larger than --lr 0.0")):
        check_config(parse_args(["--lr", "0", "--min-lr", "1e-3"]), 1)  # a rising "decay" is still refused


def test_a_learning_rate_of_0_trains_without_moving_the_weights(tmp_path):
    """AdamW with its weight decay, 2 data-parallel replicas of a 2-way tensor-parallel model: the
    exported weights are the initial ones, bit for bit."""
    args = TINY + ["--lr", "0", "--dp", "2", "--tp", "2", "--data-dir", str(tmp_path / "data")]
    run_mpi(4, "-m", "minidist.train", *args, "--export", tmp_path / "after.npz")
    after = np.load(tmp_path / "after.npz")
    before = build_model(dataclasses.replace(parse_args(args), dp=1, tp=1)).state_dict()  # (seed, name, shape)
    assert sorted(after.files) == sorted(before)
    for name, value in before.items():
        assert np.array_equal(after[name], value), name
