"""The rules of the backward pass, PyTorch's: gradients accumulate into leaves, no_grad records
nothing, detach cuts, backward may start anywhere with an upstream gradient, the graph is freed after
use, deep graphs are fine, and grad-ready hooks fire once per leaf per pass with the final gradient."""
import threading

import numpy as np
import pytest

from minidist.autograd import Function, Tensor, is_grad_enabled, no_grad


def leaf(*values):
    return Tensor(np.array(values, dtype=np.float64), requires_grad=True)


def test_gradients_accumulate_across_backward_calls_until_cleared():
    x = leaf(1.0, 2.0)
    (x * x).sum().backward()
    np.testing.assert_array_equal(x.grad, [2, 4])
    (x * x).sum().backward()  # a second pass adds
    np.testing.assert_array_equal(x.grad, [4, 8])
    x.grad = None  # what Module.zero_grad() does
    (3.0 * x).sum().backward()
    np.testing.assert_array_equal(x.grad, [3, 3])


def test_graph_is_freed_after_backward_unless_retained():
    x = leaf(1.0, 2.0)
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_array_equal(x.grad, [4, 8])
    with pytest.raises(RuntimeError, match="retain_graph"):
        y.backward()


def test_leaf_grads_are_separate_arrays_even_when_backward_shares_one():
    x, w = leaf(1.0), leaf(2.0)
    (x + w).backward(np.array([1.0]))  # Add's backward hands the same array to both inputs
    x.grad += 10
    np.testing.assert_array_equal(w.grad, [1])


def test_only_tensors_that_require_grad_receive_one():
    x, c = leaf(1.0, 2.0), Tensor(np.array([3.0, 4.0]))
    (x * c).sum().backward()
    np.testing.assert_array_equal(x.grad, [3, 4])
    assert c.grad is None


def test_no_grad_records_nothing_and_is_per_thread():
    x = leaf(1.0)
    with no_grad():
        y = x * 2.0
        seen_in_other_thread = []
        t = threading.Thread(target=lambda: seen_in_other_thread.append(is_grad_enabled()))
        t.start()
        t.join()
    assert not y.requires_grad and y.is_leaf
    assert seen_in_other_thread == [True]
    assert is_grad_enabled() and (x * 2.0).requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.backward()


def test_detach_shares_data_but_cuts_the_graph():
    x = leaf(1.0, 2.0)
    d = (x * 3.0).detach()
    assert d.is_leaf and not d.requires_grad
    (x * d).sum().backward()  # d is a constant here
    np.testing.assert_array_equal(x.grad, d.data)


def test_backward_from_a_middle_tensor_with_an_upstream_gradient():
    """What a pipeline stage does: the next stage sends back d loss / d activation."""
    w1, w2 = leaf(0.5, -1.0), leaf(2.0, 3.0)
    h = (w1 * w1 + 1.0) * w2  # stage 1
    (h * h).sum().backward()  # reference: one graph
    expected = w1.grad.copy(), w2.grad.copy()
    w1.grad = w2.grad = None

    h = (w1 * w1 + 1.0) * w2  # stage 1 again
    received = h.detach()
    received.requires_grad = True
    (received * received).sum().backward()  # stage 2 computes d loss / d h ...
    h.backward(received.grad)  # ... and stage 1 continues from it
    np.testing.assert_allclose(w1.grad, expected[0])
    np.testing.assert_allclose(w2.grad, expected[1])


def test_backward_checks_its_gradient_argument():
    x = leaf(1.0, 2.0)
    with pytest.raises(RuntimeError, match="one-element"):
        (x * 2.0).backward()
    with pytest.raises(ValueError, match="shape"):
        (x * 2.0).backward(np.ones(3))


def test_ten_thousand_chained_ops_do_not_overflow_the_stack():
    x = leaf(1.0)
    y = x
    for _ in range(10_000):
        y = y * 1.0001
    y.backward(np.ones(1))
    np.testing.assert_allclose(x.grad, [1.0001 ** 10_000])


def test_grad_ready_hook_fires_once_per_pass_with_the_final_gradient():
    w_tied, w_early, w_unused = leaf(1.0, 2.0), leaf(3.0, 4.0), leaf(5.0, 6.0)
    fired = []
    for name, w in [("tied", w_tied), ("early", w_early), ("unused", w_unused)]:
        w.register_grad_ready_hook(lambda p, name=name: fired.append((name, p.grad.copy())))
    h = w_tied * w_early  # w_tied used first here ...
    for _ in range(5):
        h = h * 1.5
    loss = (h * w_tied).sum()  # ... and again at the very end (like tied embeddings)

    loss.backward()
    assert sorted(name for name, _ in fired) == ["early", "tied"]  # once each; unused never
    grads = dict(fired)
    np.testing.assert_array_equal(grads["tied"], w_tied.grad)  # already final when the hook ran
    np.testing.assert_array_equal(grads["early"], w_early.grad)

    fired.clear()
    (w_tied * w_tied).sum().backward()  # next pass: fires again, with the accumulated gradient
    assert [name for name, _ in fired] == ["tied"]
    np.testing.assert_array_equal(fired[0][1], w_tied.grad)


def test_grad_ready_hook_order_follows_backward_and_can_be_removed():
    a, b = leaf(1.0), leaf(2.0)
    order = []
    handle = a.register_grad_ready_hook(lambda p: order.append("a"))
    b.register_grad_ready_hook(lambda p: order.append("b"))
    ((a * 2.0) * 3.0 * b).sum().backward()  # b's gradient is complete before a's
    assert order == ["b", "a"]
    handle.remove()
    order.clear()
    ((a * 2.0) * b).sum().backward()
    assert order == ["b"]
    with pytest.raises(RuntimeError, match="leaf"):
        (a * 2.0).register_grad_ready_hook(print)


class ScaleGradient(Function):
    """Identity forward, gradient times `factor` backward: the shape of Megatron's f/g pair."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class SplitHalves(Function):
    """Two outputs; backward receives None for an output that got no gradient."""

    @staticmethod
    def forward(ctx, x):
        n = len(x) // 2
        return x[:n], x[n:]

    @staticmethod
    def backward(ctx, grad_lo, grad_hi):
        zeros = np.zeros(len(grad_hi)) if grad_lo is None else grad_lo
        return np.concatenate([zeros, grad_hi])


def test_custom_functions_single_and_multi_output():
    x = leaf(1.0, 2.0, 3.0, 4.0)
    y = ScaleGradient.apply(x, 4.0)
    np.testing.assert_array_equal(y.data, x.data)
    y.sum().backward()
    np.testing.assert_array_equal(x.grad, [4, 4, 4, 4])

    x.grad = None
    lo, hi = SplitHalves.apply(x)
    (hi * hi).sum().backward()
    np.testing.assert_array_equal(x.grad, [0, 0, 6, 8])
