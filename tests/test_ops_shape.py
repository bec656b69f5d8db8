"""Reshape, permute/transpose, indexing, split and concatenate: the values NumPy gives, and
gradients that flow back to exactly the elements that were used (repeated picks add up)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minidist.autograd import Tensor, cat
from tests.gradcheck import check_gradients

FAST = settings(max_examples=20, deadline=None)
shapes = st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple)
seeds = st.integers(0, 2**31 - 1)


@FAST
@given(shape=shapes, seed=seeds)
def test_reshape_round_trips_gradient(shape, seed):
    a = np.random.default_rng(seed).standard_normal(shape)
    np.testing.assert_array_equal(Tensor(a).reshape(-1).data, a.reshape(-1))
    check_gradients(lambda x: x.reshape(a.size, 1), a)
    check_gradients(lambda x: x.view(*shape[::-1]), a)


@FAST
@given(shape=shapes, seed=seeds, data=st.data())
def test_permute_and_transpose(shape, seed, data):
    a = np.random.default_rng(seed).standard_normal(shape)
    axes = tuple(data.draw(st.permutations(range(len(shape)))))
    np.testing.assert_array_equal(Tensor(a).permute(*axes).data, a.transpose(axes))
    check_gradients(lambda x: x.permute(axes), a)
    i, j = data.draw(st.integers(0, len(shape) - 1)), data.draw(st.integers(0, len(shape) - 1))
    np.testing.assert_array_equal(Tensor(a).transpose(i, j).data, np.swapaxes(a, i, j))
    check_gradients(lambda x: x.transpose(i, j), a)


@pytest.mark.parametrize("index", [
    1, -1, slice(1, 3), (slice(None), 0), (Ellipsis, slice(None, None, 2)), (None, 1),
    np.array([0, 2, 2, 0]),                      # repeated rows: their gradients add
    (np.array([0, 1, 1]), np.array([3, 0, 0])),  # element picks, one repeated
    (slice(None), np.array([1, 1])),
    np.array([True, False, True]),
])
def test_getitem(index):
    a = np.random.default_rng(0).standard_normal((3, 4))
    np.testing.assert_array_equal(Tensor(a)[index].data, a[index])
    check_gradients(lambda x: x[index], a)


def test_getitem_accepts_a_tensor_index():
    a = np.arange(6.0)
    x = Tensor(a, requires_grad=True)
    x[Tensor(np.array([5, 5, 1]))].sum().backward()
    np.testing.assert_array_equal(x.grad, [0, 1, 0, 0, 0, 2])


@FAST
@given(n=st.integers(1, 7), size=st.integers(1, 7), seed=seeds)
def test_split_by_size_like_torch(n, size, seed):
    a = np.random.default_rng(seed).standard_normal((2, n))
    pieces = Tensor(a).split(size, axis=1)
    assert [p.shape[1] for p in pieces] == [min(size, n - s) for s in range(0, n, size)]
    np.testing.assert_array_equal(np.concatenate([p.data for p in pieces], axis=1), a)
    weights = np.arange(1.0, len(pieces) + 1)
    check_gradients(lambda x: cat([w * p for w, p in zip(weights, x.split(size, axis=1))], axis=1), a)


def test_split_by_sections_and_unused_piece_gets_zero_gradient():
    x = Tensor(np.arange(6.0), requires_grad=True)
    a, b, c = x.split([1, 2, 3])
    assert (a.shape, b.shape, c.shape) == ((1,), (2,), (3,))
    (c * 2.0).sum().backward()  # a and b get no gradient at all
    np.testing.assert_array_equal(x.grad, [0, 0, 0, 2, 2, 2])
    with pytest.raises(ValueError, match="do not add up"):
        x.split([1, 2])


def test_cat_routes_each_slice_of_the_gradient_back():
    rng = np.random.default_rng(0)
    a, b, c = rng.standard_normal((2, 1, 3)), rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 2, 3))
    np.testing.assert_array_equal(cat([Tensor(a), Tensor(b), Tensor(c)], axis=1).data,
                                  np.concatenate([a, b, c], axis=1))
    check_gradients(lambda x, y, z: cat([x, y, z], axis=1), a, b, c)
    check_gradients(lambda x, y, z: cat([x, y, z], axis=-2), a, b, c)
