"""Arithmetic, matmul and reductions: values equal NumPy's, gradients equal finite differences,
including every broadcasting case (size-1 axes, missing leading axes, scalars)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes

from minidist.autograd import Tensor, unbroadcast
from tests.gradcheck import check_gradients

FAST = settings(max_examples=25, deadline=None)
pairs = mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=3)
seeds = st.integers(0, 2**31 - 1)


def randn(seed, *shapes):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in shapes]


@pytest.mark.parametrize("op", [np.add, np.subtract, np.multiply])
@FAST
@given(shapes=pairs, seed=seeds)
def test_binary_ops_broadcast(op, shapes, seed):
    a, b = randn(seed, *shapes.input_shapes)
    fn = {np.add: lambda x, y: x + y, np.subtract: lambda x, y: x - y, np.multiply: lambda x, y: x * y}[op]
    np.testing.assert_array_equal(fn(Tensor(a), Tensor(b)).data, op(a, b))
    check_gradients(fn, a, b)


@FAST
@given(shapes=pairs, seed=seeds)
def test_div_broadcast(shapes, seed):
    a, b = randn(seed, *shapes.input_shapes)
    b = np.sign(b) * (np.abs(b) + 0.5)  # keep away from 0
    np.testing.assert_array_equal((Tensor(a) / Tensor(b)).data, a / b)
    check_gradients(lambda x, y: x / y, a, b)


@FAST
@given(shape=st.lists(st.integers(1, 3), max_size=3).map(tuple), seed=seeds,
       p=st.sampled_from([2, 3, 0.5, -1.0]))
def test_neg_and_pow(shape, seed, p):
    (a,) = randn(seed, shape)
    a = np.abs(a) + 0.5  # fractional and negative powers need positive bases
    np.testing.assert_allclose((Tensor(a) ** p).data, a ** p)
    check_gradients(lambda x: -(x ** p), a)


def test_python_scalars_on_either_side_get_no_gradient():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    y = (2.0 * x + 1.0) / 4.0 - 3.0 + (1.0 - x) + 6.0 / x
    np.testing.assert_allclose(y.data, (2 * x.data + 1) / 4 - 3 + (1 - x.data) + 6 / x.data)
    y.backward(np.ones(2))
    np.testing.assert_allclose(x.grad, 0.5 - 1 - 6 / x.data ** 2)


def test_float32_stays_float32_with_python_scalars():
    x = Tensor(np.ones(3, dtype=np.float32), requires_grad=True)
    y = (x * 0.5 + 2.0) ** 2
    assert y.dtype == np.float32
    y.sum().backward()
    assert x.grad.dtype == np.float32


batch_shapes = mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=2, max_side=3)


@FAST
@given(batch=batch_shapes, n=st.integers(1, 3), k=st.integers(1, 3), m=st.integers(1, 3), seed=seeds)
def test_matmul_broadcasts_batch_axes(batch, n, k, m, seed):
    ba, bb = batch.input_shapes
    a, b = randn(seed, ba + (n, k), bb + (k, m))
    np.testing.assert_allclose((Tensor(a) @ Tensor(b)).data, a @ b)
    check_gradients(lambda x, y: x @ y, a, b)


def test_matmul_rejects_vectors():
    with pytest.raises(ValueError, match="rank >= 2"):
        Tensor(np.ones(3)) @ Tensor(np.ones((3, 2)))


reduce_shapes = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)


@FAST
@given(shape=reduce_shapes, seed=seeds, keepdims=st.booleans(), data=st.data())
def test_sum_and_mean_over_any_axes(shape, seed, keepdims, data):
    axis = data.draw(st.one_of(
        st.none(),
        st.integers(-len(shape), len(shape) - 1),
        st.lists(st.integers(0, len(shape) - 1), min_size=1, unique=True).map(tuple)))
    (a,) = randn(seed, shape)
    np.testing.assert_allclose(Tensor(a).sum(axis, keepdims).data, a.sum(axis=axis, keepdims=keepdims))
    np.testing.assert_allclose(Tensor(a).mean(axis, keepdims).data, a.mean(axis=axis, keepdims=keepdims))
    check_gradients(lambda x: x.sum(axis, keepdims), a)
    check_gradients(lambda x: x.mean(axis, keepdims), a)


def test_unbroadcast_sums_added_and_stretched_axes():
    g = np.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(unbroadcast(g, (3, 1)), g.sum(axis=0).sum(axis=1, keepdims=True))
    np.testing.assert_array_equal(unbroadcast(g, ()), g.sum())
    assert unbroadcast(g, (2, 3, 4)) is g
