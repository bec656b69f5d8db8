"""Activation recomputation: the same gradients, bit for bit, for less activation memory.

A recomputed block keeps only its input (B, T, C) from forward to backward; it re-runs its forward
inside backward. The saving is measured from the live autograd graph.
"""
import numpy as np
import pytest

from minidist.autograd import no_grad
from minidist.model import GPT, GPTConfig
from minidist.inspect.accounting import activation_bytes
from minidist.nn.recompute import checkpoint, recompute_blocks
from tests.mpi.zero_reference import CONFIG, batch


def gradients(recompute: bool, config=CONFIG):
    model = GPT(config, seed=1, dtype="float64")
    if recompute:
        recompute_blocks(model)
    idx, targets = batch(0)
    _, loss = model(idx, targets)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def test_recomputed_blocks_give_bitwise_identical_loss_and_gradients():
    loss, grads = gradients(recompute=False)
    loss_r, grads_r = gradients(recompute=True)
    assert loss_r == loss
    for name in grads:
        np.testing.assert_array_equal(grads_r[name], grads[name], err_msg=name)


def saved_bytes(recompute: bool, n_layer: int) -> int:
    model = GPT(GPTConfig(**{**vars(CONFIG), "n_layer": n_layer}), dtype="float64")
    if recompute:
        recompute_blocks(model)
    idx, targets = batch(0)
    _, loss = model(idx, targets)
    return activation_bytes(loss, exclude=[p.data for p in model.parameters()])


def test_a_recomputed_block_keeps_only_its_input_activation():
    B, T = batch(0)[0].shape
    per_block_recomputed = saved_bytes(True, 3) - saved_bytes(True, 2)
    per_block_kept = saved_bytes(False, 3) - saved_bytes(False, 2)
    assert per_block_recomputed == B * T * CONFIG.n_embd * 8  # the block input (B, T, C), float64
    assert per_block_kept > 10 * per_block_recomputed
    assert saved_bytes(True, 3) < saved_bytes(False, 3)


def test_checkpoint_of_a_function_of_two_tensors_returns_both_input_gradients():
    from minidist.autograd import Tensor
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((4, 2))
    grads = []
    for wrap in (False, True):
        x, y = Tensor(a, requires_grad=True), Tensor(b, requires_grad=True)
        fn = lambda x, y: (x @ y) * (x @ y)  # noqa: E731
        (checkpoint(fn, x, y) if wrap else fn(x, y)).sum().backward()
        grads.append((x.grad, y.grad))
    for g, g_r in zip(*grads):
        np.testing.assert_array_equal(g_r, g)


def test_recomputation_under_no_grad_backward_is_refused():
    model = GPT(CONFIG, dtype="float64")
    recompute_blocks(model)
    idx, targets = batch(0)
    _, loss = model(idx, targets)
    with no_grad(), pytest.raises(RuntimeError, match="grad mode"):
        loss.backward()
