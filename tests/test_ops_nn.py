"""The fused neural-network ops: each forward against a plain NumPy reference written the obvious
way, each backward against finite differences (float64)."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minidist.autograd import (Tensor, cross_entropy, embedding, gelu, layer_norm, linear, merge_heads,
                               scaled_dot_product_attention, self_attention, split_heads)
from minidist.autograd import attention
from minidist.autograd.attention import causal_mask, kept_probabilities, query_blocks
from minidist.autograd.backend import sum_last, sum_rows
from minidist.nn.dropout import Dropout, DropoutKey
from tests.gradcheck import check_gradients

rng = np.random.default_rng(0)
FAST = settings(max_examples=15, deadline=None)


@pytest.mark.parametrize("x_shape", [(5,), (2, 5), (2, 3, 5)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_uses_pytorch_layout(x_shape, bias):
    x, w, b = rng.standard_normal(x_shape), rng.standard_normal((4, 5)), rng.standard_normal(4)
    y = linear(Tensor(x), Tensor(w), Tensor(b) if bias else None)
    np.testing.assert_allclose(y.data, x @ w.T + (b if bias else 0))
    if bias:
        check_gradients(linear, x, w, b)
    else:
        check_gradients(lambda x, w: linear(x, w), x, w)


def test_gelu_tanh_form():
    x = np.linspace(-6, 6, 41)
    ref = [0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3))) for v in x]
    np.testing.assert_allclose(gelu(Tensor(x)).data, ref, rtol=1e-14, atol=1e-15)
    check_gradients(gelu, rng.standard_normal((3, 4)) * 2)


@FAST
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple), bias=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_layer_norm(shape, bias, seed):
    r = np.random.default_rng(seed)
    x, w, b = r.standard_normal(shape) * 3 + 1, r.standard_normal(shape[-1]), r.standard_normal(shape[-1])
    ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * w + (b if bias else 0)
    np.testing.assert_allclose(layer_norm(Tensor(x), Tensor(w), Tensor(b) if bias else None).data, ref,
                               rtol=1e-12, atol=1e-12)
    if bias:
        check_gradients(layer_norm, x, w, b)
    else:
        check_gradients(lambda x, w: layer_norm(x, w), x, w)


def attention_reference(q, k, v, is_causal):
    """Loops over batch, head and query: softmax of scaled scores over the allowed keys, then mix v."""
    B, H, T, hs = q.shape
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                keys = range(min(t + 1, k.shape[2])) if is_causal else range(k.shape[2])
                scores = np.array([q[b, h, t] @ k[b, h, s] / math.sqrt(hs) for s in keys])
                p = np.exp(scores - scores.max())
                p /= p.sum()
                out[b, h, t] = sum(p[j] * v[b, h, s] for j, s in enumerate(keys))
    return out


@pytest.mark.parametrize("is_causal,S", [(True, 4), (False, 4), (False, 2)])
def test_attention_matches_reference_and_finite_differences(is_causal, S):
    q = rng.standard_normal((2, 3, 4, 5))
    k, v = rng.standard_normal((2, 3, S, 5)), rng.standard_normal((2, 3, S, 5))
    y = scaled_dot_product_attention(Tensor(q), Tensor(k), Tensor(v), is_causal=is_causal)
    np.testing.assert_allclose(y.data, attention_reference(q, k, v, is_causal), rtol=1e-12, atol=1e-12)
    check_gradients(lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal), q, k, v)


def test_causal_attention_never_looks_ahead():
    q, k, v = (Tensor(rng.standard_normal((1, 2, 6, 4)), requires_grad=True) for _ in range(3))
    y = scaled_dot_product_attention(q, k, v, is_causal=True)
    y[:, :, 2].sum().backward()  # the output at position 2 ...
    for t in (k, v):              # ... depends on keys and values 0..2 only
        assert np.all(t.grad[:, :, 3:] == 0) and np.any(t.grad[:, :, :3] != 0)


@pytest.mark.parametrize("with_dropout", [False, True])
def test_causal_attention_by_query_blocks_equals_one_block_of_every_query(monkeypatch, with_dropout):
    """T = 70 runs as blocks of 32, 32 and 6 queries, each over the keys up to its last; as one block
    of all 70 queries over all 70 keys (a block size past T) it gives the same output and gradients,
    with dropout the same masks."""
    q, k, v, grad = (rng.standard_normal((2, 3, 70, 8)) for _ in range(4))
    drop = Dropout(DropoutKey(0.3, 5, 3, (0, 1), 70), np.arange(70), range(3)).attention(1) if with_dropout else None

    def run():
        ts = [Tensor(a, requires_grad=True) for a in (q, k, v)]
        y = scaled_dot_product_attention(*ts, is_causal=True, dropout=drop)
        y.backward(grad)
        return [y.data] + [t.grad for t in ts]

    assert query_blocks(70, 70, True) == [(0, 32, 32), (32, 64, 64), (64, 70, 70)]
    assert kept_probabilities(70, 70) == 32 * 32 + 32 * 64 + 6 * 70 and kept_probabilities(128, 128) == 128 * 160 // 2
    blocked = run()
    if not with_dropout:
        np.testing.assert_allclose(blocked[0], attention_reference(q, k, v, True), rtol=1e-12, atol=1e-12)
    monkeypatch.setattr(attention, "QUERY_BLOCK", 1024)
    assert query_blocks(70, 70, True) == [(0, 70, 70)]
    for got, whole in zip(blocked, run()):
        np.testing.assert_allclose(got, whole, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("T,S", [(40, 70), (70, 40)])
def test_causal_attention_of_more_keys_than_queries_and_fewer(T, S):
    """Query t sees keys 0..t whatever S: with S > T the keys past T get no gradient (0, never left
    unwritten); with S < T the blocks past S all see every key, and their dK and dV add up."""
    q = rng.standard_normal((1, 2, T, 3))
    k, v = rng.standard_normal((1, 2, S, 3)), rng.standard_normal((1, 2, S, 3))
    Q, K, V = (Tensor(a, requires_grad=True) for a in (q, k, v))
    y = scaled_dot_product_attention(Q, K, V, is_causal=True)
    np.testing.assert_allclose(y.data, attention_reference(q, k, v, True), rtol=1e-12, atol=1e-12)
    y.backward(np.ones_like(y.data))
    if S > T:
        assert np.all(K.grad[:, :, T:] == 0) and np.all(V.grad[:, :, T:] == 0)
    check_gradients(lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True),
                    q[:, :1, :, :2], k[:, :1, :, :2], v[:, :1, :, :2])


def test_split_and_merge_heads_pass_the_gradient_check():
    x = rng.standard_normal((2, 3, 3 * 2 * 2))  # B 2, T 3, 2 heads of 2
    check_gradients(lambda x: merge_heads(split_heads(x, 2)[1]) * merge_heads(split_heads(x, 2)[2]), x)
    assert [a.shape for a in split_heads(Tensor(x), 2)] == [(2, 2, 3, 2)] * 3


@pytest.mark.parametrize("T", [5, 70])
@pytest.mark.parametrize("with_dropout", [False, True])
def test_self_attention_of_the_fused_projection_equals_its_heads_cut_attended_and_joined(T, with_dropout):
    """The model's attention (one op over q | k | v, writing into the layouts of its output and of the
    gradient) against the same done in three ops: split_heads, scaled_dot_product_attention,
    merge_heads. Outputs and the fused gradient agree to 1e-13 (float64)."""
    nh, hs = 3, 4
    x, dy = rng.standard_normal((2, T, 3 * nh * hs)), rng.standard_normal((2, T, nh * hs))
    drop = Dropout(DropoutKey(0.3, 5, 3, (0, 1), T), np.arange(T), range(nh)).attention(1) if with_dropout else None
    fused, parts = Tensor(x.copy(), requires_grad=True), Tensor(x.copy(), requires_grad=True)
    y = self_attention(fused, nh, drop)
    y.backward(dy)
    q, k, v = split_heads(parts, nh)
    assert q.shape == (2, nh, T, hs) and np.shares_memory(q.data, parts.data)  # views, no copy
    reference = merge_heads(scaled_dot_product_attention(q, k, v, is_causal=True, dropout=drop))
    reference.backward(dy)
    np.testing.assert_allclose(y.data, reference.data, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(fused.grad, parts.grad, rtol=1e-13, atol=1e-13)


def test_embedding_gathers_rows_and_adds_gradients_of_repeats():
    w = rng.standard_normal((5, 3))
    idx = np.array([[0, 4, 4], [2, 4, 0]])
    np.testing.assert_array_equal(embedding(idx, Tensor(w)).data, w[idx])
    weight = Tensor(w, requires_grad=True)
    embedding(idx, weight).backward(np.ones((2, 3, 3)))
    np.testing.assert_array_equal(weight.grad[:, 0], [2, 0, 1, 0, 3])  # how often each row was used
    check_gradients(lambda w: embedding(idx, w), w)


def test_embedding_gradient_equals_add_at_over_rows_bitwise():
    """The flat scatter-add of backward adds the same values in the same order as add.at on rows."""
    grad = rng.standard_normal((4, 16, 8)).astype(np.float32)
    idx = rng.integers(0, 10, size=(4, 16))
    weight = Tensor(np.zeros((10, 8), np.float32), requires_grad=True)
    embedding(idx, weight).backward(grad)
    expected = np.zeros((10, 8), np.float32)
    np.add.at(expected, idx.reshape(-1), grad.reshape(-1, 8))
    np.testing.assert_array_equal(weight.grad, expected)


def assert_same_sum(ours, numpy_sum, terms, axis):
    """Two sums of the same ``terms`` in different orders differ by at most 2 n eps sum|x| (each is
    within (n - 1) eps sum|x| of the exact sum): a bound that holds where the terms cancel, which a
    relative tolerance on the result does not (a float32 row summing to -0.0437 from terms near 1 once
    missed rtol 1e-6 by a factor of 3, from another test's draws)."""
    n, eps = terms.shape[axis], np.finfo(terms.dtype).eps
    bound = 2 * n * eps * np.abs(terms.astype(np.float64)).sum(axis, keepdims=ours.ndim == terms.ndim)
    assert np.all(np.abs(ours.astype(np.float64) - numpy_sum.astype(np.float64)) <= bound)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_sum_last_and_sum_rows_equal_numpy_sums(dtype):
    x = np.random.default_rng(7).standard_normal((3, 4, 7)).astype(dtype)  # its own draws, whatever ran before
    for a in (x, x.swapaxes(0, 2)):  # contiguous and not
        assert sum_last(a).shape == a.shape[:-1] + (1,) and sum_last(a).dtype == a.dtype
        assert_same_sum(sum_last(a), a.sum(-1, keepdims=True), a, -1)
    m = x.reshape(12, 7)
    assert sum_rows(m).dtype == m.dtype
    assert_same_sum(sum_rows(m), m.sum(0), m, 0)
    assert_same_sum(sum_rows(m.T), m.T.sum(0), m.T, 0)


def test_causal_mask_is_made_once_per_shape_and_read_only():
    like = np.zeros((1, 1, 3, 4), np.float32)
    mask = causal_mask(3, 4, like=like)
    assert mask is causal_mask(3, 4, like=like) and mask.dtype == np.float32
    np.testing.assert_array_equal(mask == 0, np.tril(np.ones((3, 4), bool)))
    with pytest.raises(ValueError):
        mask[0, 0] = 1.0


def cross_entropy_reference(logits, targets, ignore_index=-1):
    z = logits.reshape(-1, logits.shape[-1])
    log_probs = z - np.log(np.exp(z).sum(-1, keepdims=True))
    losses = [-log_probs[i, t] for i, t in enumerate(targets.reshape(-1)) if t != ignore_index]
    return np.mean(losses), np.sum(losses)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_ignores_targets_equal_to_ignore_index(reduction):
    logits = rng.standard_normal((2, 3, 7))
    targets = np.array([[1, -1, 6], [0, 3, -1]])
    mean, total = cross_entropy_reference(logits, targets)
    loss = cross_entropy(Tensor(logits), targets, reduction=reduction)
    np.testing.assert_allclose(loss.item(), mean if reduction == "mean" else total, rtol=1e-13)
    check_gradients(lambda z: cross_entropy(z, targets, reduction=reduction), logits)


def test_cross_entropy_is_stable_for_huge_logits():
    logits = np.array([[1e4, 0.0, -1e4], [5e3, 5e3, 0.0]])
    z = Tensor(logits, requires_grad=True)
    loss = cross_entropy(z, np.array([0, 1]))
    np.testing.assert_allclose(loss.item(), (0.0 + math.log(2)) / 2, atol=1e-12)
    loss.backward()
    np.testing.assert_allclose(z.grad, [[0, 0, 0], [0.25, -0.25, 0]], atol=1e-12)


def test_cross_entropy_custom_ignore_index_and_all_ignored_is_nan():
    logits = rng.standard_normal((3, 4))
    mean, _ = cross_entropy_reference(logits, np.array([2, 0, 3]), ignore_index=0)
    np.testing.assert_allclose(cross_entropy(Tensor(logits), np.array([2, 0, 3]), ignore_index=0).item(), mean)
    assert math.isnan(cross_entropy(Tensor(logits), np.array([-1, -1, -1])).item())
