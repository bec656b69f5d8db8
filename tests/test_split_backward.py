"""Backward split in two (zero-bubble pipelines): B, the activations' gradients, now; W, the
parameters', later. For every op and for whole models, B + W equals one backward, bit for bit."""
import numpy as np
import pytest

from minidist import nn
from minidist.autograd import (Tensor, cat, combine, cross_entropy, embedding, gelu, grouped_bias, grouped_linear,
                               layer_norm, linear, mean, scaled_dot_product_attention, softmax, split, take_rows,
                               weight_grads_later)
from minidist.model import GPT, GPTConfig
from minidist.nn.recompute import checkpoint, recompute_blocks

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3, 4))  # the activation every op gets: a leaf that is not a parameter
W = RNG.standard_normal((5, 4))
V = RNG.standard_normal((4,))
COUNTS = np.array([2, 0, 4])

# name -> fn(x, w, v) with x an activation (2, 3, 4), w (5, 4) and v (4,) parameters
OPS = {
    "add": lambda x, w, v: x + v,
    "sub": lambda x, w, v: v - x,
    "mul": lambda x, w, v: x * v,
    "div": lambda x, w, v: x / (v * v + 1.0),
    "neg+pow": lambda x, w, v: -(x ** 2.0) * v,
    "matmul": lambda x, w, v: x @ w.transpose(0, 1),
    "sum/mean": lambda x, w, v: (x * v).sum(axis=1) + mean(x * v, axis=1),
    "reshape/permute": lambda x, w, v: (x.reshape(6, 4) * v).permute(1, 0),
    "getitem": lambda x, w, v: x[:, 1:] * w[2],
    "split/cat": lambda x, w, v: cat([split(x, 2, axis=-1)[1] * v[:2], w[:3, :2].reshape(1, 3, 2)
                                      + split(x, 2, axis=-1)[0][:1]], axis=0),
    "linear": lambda x, w, v: linear(x, w, v[:1].reshape(1) * 0 + w[0, :1].reshape(1)),
    "linear+bias": lambda x, w, v: linear(x, w.transpose(0, 1).transpose(0, 1), w[:, 0]),
    "gelu": lambda x, w, v: gelu(x * v),
    "layer_norm": lambda x, w, v: layer_norm(x, v, w[0]),
    "embedding": lambda x, w, v: embedding(np.array([[0, 4, 4]]), w) * x[:1],
    "softmax": lambda x, w, v: softmax(x * v),
    "cross_entropy": lambda x, w, v: cross_entropy(linear(x, w), np.array([[0, 1, 4], [4, 4, 2]])),
    "attention": lambda x, w, v: scaled_dot_product_attention(linear(x, w[:4]).reshape(2, 1, 3, 4), x.reshape(2, 1, 3, 4),
                                                              (x * v).reshape(2, 1, 3, 4), is_causal=True),
    "grouped_linear": lambda x, w, v: grouped_linear(x.reshape(6, 4), w.reshape(1, 5, 4) + w[:3, :1].reshape(3, 1, 1),
                                                     w.transpose(0, 1)[:3], COUNTS),
    "grouped_bias": lambda x, w, v: grouped_bias(x.reshape(6, 4), w[:3, :4], COUNTS),
    "take_rows": lambda x, w, v: take_rows(x.reshape(6, 4) * v, np.array([5, 0, 3, 2]), 2),
    "combine": lambda x, w, v: combine(x.reshape(6, 4), softmax(w[:3, :2]), np.array([[0, 3], [5, -1], [1, 2]])),
}


def run(fn, split_backward: bool):
    """The gradients of x, w and v after a full backward or B (then checked) and W."""
    x, w, v = Tensor(X.copy(), requires_grad=True), nn.Parameter(W.copy()), nn.Parameter(V.copy())
    out = fn(x, w, v)
    upstream = np.random.default_rng(1).standard_normal(out.shape)
    if not split_backward:
        out.backward(upstream)
        return x.grad, w.grad, v.grad
    with weight_grads_later() as later:
        out.backward(upstream)
    assert w.grad is None and v.grad is None, "B computed a parameter's gradient"
    x_grad = x.grad
    later.run()
    assert x.grad is x_grad, "W touched the activation's gradient"
    return x.grad, w.grad, v.grad


@pytest.mark.parametrize("name", list(OPS))
def test_b_then_w_equals_backward_bitwise_for_every_op(name):
    for full, parts in zip(run(OPS[name], False), run(OPS[name], True)):
        if full is None:
            assert parts is None
        else:
            np.testing.assert_array_equal(parts, full)


def test_grad_ready_hooks_fire_in_w_once_each():
    w = nn.Parameter(W.copy())
    fired = []
    w.register_grad_ready_hook(lambda t: fired.append(t.grad.copy()))
    x = Tensor(X.copy(), requires_grad=True)
    with weight_grads_later() as later:
        (linear(x, w) + linear(x * 2.0, w)).sum().backward()
    assert fired == []
    later.run()
    assert len(fired) == 1 and np.array_equal(fired[0], w.grad)


def gpt_grads(split_backward: bool, recompute=False, **overrides):
    config = GPTConfig(**{**dict(vocab_size=31, block_size=8, n_layer=2, n_head=2, n_embd=16), **overrides})
    model = GPT(config, seed=3, dtype="float64")
    if recompute:
        recompute_blocks(model)
    idx = np.random.default_rng(2).integers(0, 31, (3, 9))
    x = model.embed(idx[:, :-1])  # the activation between "stages"
    x_in = Tensor(x.data.copy(), requires_grad=True)
    h = x_in
    for block in model.transformer.h:
        h = block(h)
    _, loss = model.head(h, idx[:, 1:])
    if split_backward:
        with weight_grads_later() as later:
            loss.backward()
        assert all(p.grad is None for p in model.parameters())
        x_grad = x_in.grad.copy()
        later.run()
    else:
        loss.backward()
        x_grad = x_in.grad
    x.backward(x_in.grad)  # the "first stage": its own full backward
    return x_grad, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("variant", [dict(), dict(recompute=True), dict(n_experts=4, top_k=2, aux_loss_coef=0.01),
                                     dict(tie_embeddings=False)], ids=["gpt", "recompute", "moe", "untied"])
def test_gpt_split_backward_is_bitwise_one_backward(variant):
    x_full, full = gpt_grads(False, **variant)
    x_split, parts = gpt_grads(True, **variant)
    np.testing.assert_array_equal(x_split, x_full)
    for name in full:
        np.testing.assert_array_equal(parts[name], full[name], err_msg=name)


def test_nested_recompute_defers_into_the_outer_pass():
    w = nn.Parameter(W.copy())
    x = Tensor(X.copy(), requires_grad=True)
    with weight_grads_later() as later:
        checkpoint(lambda t: gelu(linear(t, w)), x).sum().backward()
    assert x.grad is not None and w.grad is None
    later.run()
    assert w.grad is not None
