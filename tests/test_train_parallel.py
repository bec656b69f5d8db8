"""The parallel trainer: a bad layout is rejected before any communication with one clear message;
global-norm clipping counts every parameter once; and data-parallel training (in-process ranks
here, real MPI processes in test_train_parallel_mpi.py) matches one process on the full batch."""
import dataclasses

import numpy as np
import pytest

from minidist import run_local
from minidist.nn import Parameter
from minidist.optim import clip_grad_norm
from minidist.parallel.compose.clip import clip_grad_norm_parallel
from minidist.parallel.mesh import DeviceMesh
from minidist.train import train
from minidist.train.config import ConfigError, TrainConfig, check_config

TINY = dict(n_layer=2, n_head=4, n_embd=16, block_size=16, batch_size=8, steps=10, eval_every=100,
            eval_iters=1, dtype="float64", sample_tokens=0, warmup=2)


@pytest.mark.parametrize("changes, world_size, message", [
    (dict(dp=2, tp=2), 2, r"world size 2 != dp \* tp = 2 \* 2 = 4"),
    (dict(tp=3), 3, "n_head 4 is not divisible by tp 3"),
    (dict(dp=3), 3, "batch_size 8 is not divisible by dp \\* micro_batches = 3 \\* 1"),
    (dict(dp=2, micro_batches=8), 2, "batch_size 8 is not divisible by dp \\* micro_batches = 2 \\* 8"),
    (dict(sequence_parallel=True), 1, "--sequence-parallel needs --tp > 1"),
    (dict(tp=2, block_size=15, sequence_parallel=True), 2, "the sequence of 15 tokens is not divisible by tp 2"),
    (dict(n_embd=18), 1, "n_embd 18 is not divisible by n_head 4"),
    (dict(bucket_mb=0.0), 1, "--bucket-mb must be positive"),
    (dict(micro_batches=0), 1, "--micro-batches must be >= 1"),
])
def test_bad_configurations_are_rejected_with_a_clear_message(changes, world_size, message):
    cfg = dataclasses.replace(TrainConfig(**TINY), **changes)
    with pytest.raises(ConfigError, match=message):
        check_config(cfg, world_size)


def test_every_problem_is_listed_at_once():
    cfg = TrainConfig(**dict(TINY, dp=3, tp=3))
    with pytest.raises(ConfigError) as error:
        check_config(cfg, 4)
    assert str(error.value).count("\n  - ") == 3  # world size, heads, batch


def test_train_checks_before_any_communication():
    def fn(group):
        with pytest.raises(ConfigError, match="world size 2"):
            train(TrainConfig(**dict(TINY, dp=4)), progress=False, world=group)
        return group.seq

    assert run_local(fn, world_size=2) == [0, 0]


def test_clip_counts_tensor_parallel_shards_on_every_rank_and_replicated_params_once():
    full = np.arange(1.0, 9.0)  # a sharded parameter's gradient, split over 2 tp ranks
    replicated = np.array([3.0, -4.0])

    def fn(group):
        mesh = DeviceMesh(group, tp=2)
        shard = Parameter(np.zeros(4))
        shard.tensor_parallel = True
        shard.grad = np.split(full, 2)[mesh.tp_rank].copy()
        rep = Parameter(np.zeros(2))
        rep.grad = replicated.copy()
        norm = clip_grad_norm_parallel([shard, rep], 1.0, mesh)
        return norm, shard.grad, rep.grad

    ref_full, ref_rep = Parameter(full.copy()), Parameter(replicated.copy())
    ref_full.grad, ref_rep.grad = full.copy(), replicated.copy()
    expected = clip_grad_norm([ref_full, ref_rep], 1.0)
    (norm0, shard0, rep0), (norm1, shard1, rep1) = run_local(fn, world_size=2)
    assert norm0 == norm1 and norm0 == pytest.approx(expected, rel=1e-15)
    np.testing.assert_allclose(np.concatenate([shard0, shard1]), ref_full.grad, rtol=1e-15)
    np.testing.assert_allclose(rep0, ref_rep.grad, rtol=1e-15)
    np.testing.assert_array_equal(rep0, rep1)


def run_parallel(cfg, world_size):
    """``train(cfg)`` on ``world_size`` in-process ranks: every rank's (history, final state)."""
    return run_local(lambda group: _losses_and_state(*train(cfg, progress=False, world=group)),
                     world_size=world_size)


def _losses_and_state(model, history):
    return [r["loss"] for r in history], model.state_dict()


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("dp, n_micro", [(2, 1), (2, 2), (4, 1), (1, 4)])
def test_data_parallel_training_matches_one_process_in_float64(data_dir, optimizer, dp, n_micro):
    base = TrainConfig(**TINY, data_dir=data_dir, optimizer=optimizer, lr=1e-2, grad_clip=0.5)
    ref_losses, ref_state = _losses_and_state(*train(base, progress=False))
    cfg = dataclasses.replace(base, dp=dp, micro_batches=n_micro, bucket_mb=0.01)
    for losses, state in run_parallel(cfg, dp):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)
        for name, value in ref_state.items():
            np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


def test_data_parallel_training_matches_one_process_in_float32(data_dir):
    """Every parameter equal to float32 rounding, except the attention KEY biases, whose exact gradient is
    zero: q . (k + b) adds the same q . b to every score of a softmax row, which the softmax ignores. In
    float32 their gradient is rounding noise only, which AdamW divides by its own tiny root-mean-square
    (plus eps): the update is noise of size ~lr * noise / eps in ANY layout, so the two runs' key biases
    share no digits. What must hold for them is that they stay noise: within steps * lr * noise / eps of
    zero, with noise = float32's epsilon times the gradients' size (~1e-3 here), 10 * 3e-3 * 1.2e-10 / 1e-8
    = 3.6e-4, far below the query/value biases that really train (~1e-2 here)."""
    base = TrainConfig(**dict(TINY, dtype="float32"), data_dir=data_dir, optimizer="adamw")
    ref_losses, ref_state = _losses_and_state(*train(base, progress=False))
    C = base.n_embd
    noise_bound = base.steps * base.lr * np.finfo(np.float32).eps * 1e-3 / 1e-8  # AdamW's eps is 1e-8
    for losses, state in run_parallel(dataclasses.replace(base, dp=2, micro_batches=2), 2):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for name, value in ref_state.items():
            if name.endswith("attn.c_attn.bias"):  # [q; k; v]: the key third is noise in both runs
                for run in (state[name], value):
                    assert np.abs(run[C:2 * C]).max() < noise_bound, name
                state, value = dict(state), np.concatenate([value[:C], value[2 * C:]])
                state[name] = np.concatenate([state[name][:C], state[name][2 * C:]])
            np.testing.assert_allclose(state[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
