"""``python -m minidist.train --mode ps``: the parameter server through the trainer's command line.

- Synchronous (the default), 1 server and 2 workers train to the weights of one process on the full
  batch (float64, 1e-10): the server averages the workers' gradients before it updates.
- Asynchronous (--staleness s) applies each worker's gradient on arrival; metrics.jsonl has one row
  per update with the worker and how stale its parameters were (bounded by (W - 1)(2s + 1)).
- Collective-only flags and impossible server counts are refused before any message.
- A run that diverges stops at its first NaN loss, synchronous or not: exit 5, one message, the
  metrics up to there, no export.
"""
import json

import numpy as np
import pytest

from minidist.parallel.ps.param_server import staleness_bound
from minidist.train.config import ConfigError, TrainConfig, check_config
from tests.mpi.harness import find_mpiexec, run_mpi

needs_mpi = pytest.mark.skipif(find_mpiexec() is None, reason="needs mpiexec")
TINY = ["--n-layer", 1, "--n-head", 2, "--n-embd", 16, "--block-size", 16, "--batch-size", 6, "--steps", 8,
        "--eval-iters", 1, "--sample-tokens", 0, "--warmup", 2, "--lr", 0.1, "--dtype", "float64"]


@pytest.mark.parametrize("changes, world_size, message", [
    (dict(servers=3), 3, r"--servers must be an int in 1..2"),
    (dict(batch_size=5), 3, "batch size 5 must be divisible by the 2 workers"),
    (dict(dp=2, ckpt_dir="c"), 3, "--mode ps trains whole models on its workers: --dp, --ckpt-dir do not apply"),
])
def test_the_parameter_server_mode_refuses_what_it_cannot_run(changes, world_size, message):
    with pytest.raises(ConfigError, match=message):
        check_config(TrainConfig(**{"mode": "ps", "batch_size": 6, **changes}), world_size)


@needs_mpi
def test_synchronous_parameter_server_equals_one_process(tmp_path):
    common = [*TINY, "--data-dir", tmp_path / "data", "--optimizer", "sgd"]
    run_mpi(1, "-m", "minidist.train", *common, "--export", tmp_path / "one.npz", "--out", tmp_path / "one",
            timeout=120)
    run = run_mpi(3, "-m", "minidist.train", *common, "--mode", "ps", "--servers", 1, "--export", tmp_path / "ps.npz",
                  "--out", tmp_path / "ps", timeout=120)
    assert run.stdout.count("final: train loss") == 1, run.output
    one, ps = dict(np.load(tmp_path / "one.npz")), dict(np.load(tmp_path / "ps.npz"))
    assert one.keys() == ps.keys()
    for k, v in one.items():
        assert np.abs(ps[k] - v).max() <= 1e-10 * np.abs(v).max(), k
    rows = [[json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("one", "ps")]
    assert [r["step"] for r in rows[1]] == list(range(8)) and "val_loss" in rows[1][-1]
    np.testing.assert_allclose([r["loss"] for r in rows[1]], [r["loss"] for r in rows[0]], rtol=1e-10)


@needs_mpi
def test_asynchronous_parameter_server_logs_staleness(tmp_path):
    run_mpi(4, "-m", "minidist.train", *TINY, "--data-dir", tmp_path / "data", "--mode", "ps", "--servers", 1,
            "--staleness", 1, "--straggler", 0.01, "--out", tmp_path, timeout=120)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # a budget of W * steps updates, the synchronous run's work (pushes already in flight when it is
    # spent are applied too: at most one more per other worker)
    assert 3 * 8 <= len(rows) <= 3 * 8 + 2
    assert {r["worker"] for r in rows} == {1, 2, 3}  # world ranks: rank 0 serves
    assert 0 < max(r["staleness"] for r in rows) <= staleness_bound(3, 1)
    assert "val_loss" in rows[-1]


@needs_mpi
@pytest.mark.parametrize("mode", [[], ["--staleness", 1]], ids=["sync", "async"])
def test_a_diverging_run_stops_at_its_first_nan_and_exports_nothing(tmp_path, mode):
    args = [*TINY, "--data-dir", tmp_path / "data", "--mode", "ps", "--servers", 1, *mode, "--steps", 200,
            "--lr", 1e30, "--optimizer", "sgd", "--dtype", "float32", "--out", tmp_path, "--export", tmp_path / "m.npz"]
    run = run_mpi(3, "-m", "minidist.train", *map(str, args), timeout=120, check=False)
    assert run.returncode == 5, run.output
    said = [line for line in run.stderr.splitlines() if line.startswith("python -m minidist.train")]
    assert len(said) == 1 and "the run diverged at step" in said[0] and "nothing is exported" in said[0], run.output
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first = next(i for i, r in enumerate(rows) if r["loss"] is None)  # (NaN is null in metrics.jsonl)
    # stopped there; asynchronous: the other worker's push already in flight is applied too (2 workers)
    assert len(rows) - 1 - first <= (1 if mode else 0), rows
    assert f"diverged at step {rows[first]['step']} (loss nan" in said[0] and not (tmp_path / "m.npz").exists()
