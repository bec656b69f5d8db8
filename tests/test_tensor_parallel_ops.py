"""The pieces of tensor parallelism, one rule each: Megatron's f and g and their sequence-parallel
twins (what each sends forward and backward), a column-parallel Linear followed by a row-parallel
one, which rank holds which slice of every GPT parameter, the vocab-parallel embedding, and the
vocab-parallel cross-entropy in exactly 3 all-reduces of one number per token."""
import numpy as np
import pytest

import minidist
from minidist import nn
from minidist.autograd import Tensor, cross_entropy
from minidist.model import GPT, GPTConfig
from minidist.parallel.tensor.tensor_parallel import (copy_to_tensor_parallel_region,
                                                      gather_from_sequence_parallel_region,
                                                      reduce_from_tensor_parallel_region,
                                                      reduce_scatter_to_sequence_parallel_region, row_parallel,
                                                      shard_for, tp_layout, unshard)
from minidist.parallel.tensor.vocab_parallel import (vocab_parallel_cross_entropy, vocab_parallel_embedding,
                                                     vocab_range)

N = 3  # ranks
B, T, C = 2, 6, 4


def per_rank(seed, shape):
    """Different values on each rank, integer-valued so sums are exact."""
    return [np.random.default_rng([seed, r]).integers(-9, 10, shape).astype(np.float64) for r in range(N)]


def run(op, xs, grads):
    """Apply ``op(x, group)`` on each rank to its x, backward with its grad: [(y, x.grad)] per rank."""
    def rank(group):
        x = Tensor(xs[group.rank], requires_grad=True)
        y = op(x, group)
        (y * grads[group.rank]).sum().backward()
        return y.data, x.grad
    return minidist.run_local(rank, N)


def test_f_is_identity_forward_and_all_reduce_backward():
    xs, gs = per_rank(0, (B, T, C)), per_rank(1, (B, T, C))
    for r, (y, grad) in enumerate(run(copy_to_tensor_parallel_region, xs, gs)):
        np.testing.assert_array_equal(y, xs[r])
        np.testing.assert_array_equal(grad, sum(gs))


def test_g_is_all_reduce_forward_and_identity_backward():
    xs, gs = per_rank(0, (B, T, C)), per_rank(1, (B, T, C))
    for r, (y, grad) in enumerate(run(reduce_from_tensor_parallel_region, xs, gs)):
        np.testing.assert_array_equal(y, sum(xs))
        np.testing.assert_array_equal(grad, gs[r])


def test_sequence_all_gather_forward_reduce_scatter_backward():
    xs, gs = per_rank(0, (B, T // N, C)), per_rank(1, (B, T, C))
    mine = np.split(np.arange(T), N)  # the tokens each rank holds
    for r, (y, grad) in enumerate(run(gather_from_sequence_parallel_region, xs, gs)):
        np.testing.assert_array_equal(y, np.concatenate(xs, axis=1))  # (B, T, C), rank order
        np.testing.assert_array_equal(grad, sum(gs)[:, mine[r]])


def test_sequence_reduce_scatter_forward_all_gather_backward():
    xs, gs = per_rank(0, (B, T, C)), per_rank(1, (B, T // N, C))
    mine = np.split(np.arange(T), N)
    for r, (y, grad) in enumerate(run(reduce_scatter_to_sequence_parallel_region, xs, gs)):
        np.testing.assert_array_equal(y, sum(xs)[:, mine[r]])
        np.testing.assert_array_equal(grad, np.concatenate(gs, axis=1))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_column_then_row_parallel_linear_is_the_full_two_layer_map(sequence_parallel):
    """Y = (X A^T + a) B^T + b with A split by rows of its (out, in) layout (columns of the math),
    B by its input columns: the column-parallel Linear is a plain one on its block, the row-parallel
    one adds the replicated bias after the sum; the ranks only talk in g (or the reduce-scatter)."""
    rng = np.random.default_rng(0)
    x, A, a, Bw, b = (rng.standard_normal(s) for s in [(B, T, C), (6, C), (6,), (C, 6), (C,)])

    def rank(group):
        col, row = nn.Linear(C, 6 // N, dtype="float64"), nn.Linear(6 // N, C, dtype="float64")
        row_parallel(row, group, sequence_parallel)
        col.weight.data[...] = shard_for("mlp.c_fc.weight", A, group.rank, N)
        col.bias.data[...] = shard_for("mlp.c_fc.bias", a, group.rank, N)
        row.weight.data[...] = shard_for("mlp.c_proj.weight", Bw, group.rank, N)
        row.bias.data[...] = b
        group.trace.clear()
        y = row(col(Tensor(x))).data
        return y, [e.op for e in group.trace.events]

    full = (x @ A.T + a) @ Bw.T + b  # (B, T, C)
    for r, (y, ops) in enumerate(minidist.run_local(rank, N)):
        np.testing.assert_allclose(y, full[:, np.split(np.arange(T), N)[r]] if sequence_parallel else full, rtol=1e-12)
        assert ops == ["reduce_scatter" if sequence_parallel else "all_reduce"]  # g, after the row-parallel layer


UNTIED = GPTConfig(vocab_size=11, block_size=4, n_layer=1, n_head=6, n_embd=6, tie_embeddings=False)
GPT_SHAPES = {name: value.shape for name, value in GPT(UNTIED, dtype="float64").state_dict().items()}


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_shard_for_and_unshard_are_inverse_for_every_gpt_parameter(tp):
    for name, shape in GPT_SHAPES.items():
        full = np.random.default_rng(0).standard_normal(shape)
        shards = [shard_for(name, full, r, tp) for r in range(tp)]
        assert len({s.shape for s in shards}) == 1, name  # equal shards (the vocabulary is padded)
        np.testing.assert_array_equal(unshard(name, shards, vocab_size=11), full)


def test_layouts_by_name():
    split = {name: tp_layout(name) for name in GPT_SHAPES if tp_layout(name) != "replicated"}
    assert split == {
        "transformer.wte.weight": "vocab", "lm_head.weight": "vocab",
        "transformer.h.0.attn.c_attn.weight": "qkv", "transformer.h.0.attn.c_attn.bias": "qkv",
        "transformer.h.0.attn.c_proj.weight": "row",  # its bias is replicated: added once, after g
        "transformer.h.0.mlp.c_fc.weight": "column", "transformer.h.0.mlp.c_fc.bias": "column",
        "transformer.h.0.mlp.c_proj.weight": "row",
    }  # replicated: LayerNorms, wpe, c_proj biases


def test_c_attn_shard_holds_whole_heads_of_q_k_and_v():
    C, tp = 6, 3  # 6 heads of size 1: rank r holds heads 2r and 2r+1
    full = np.arange(3 * C)[:, None] * np.ones((1, C))  # row i of c_attn.weight is the number i
    shard = shard_for("transformer.h.0.attn.c_attn.weight", full, 1, tp)
    np.testing.assert_array_equal(shard[:, 0], [2, 3, 2 + C, 3 + C, 2 + 2 * C, 3 + 2 * C])  # [q_1; k_1; v_1]


def test_vocab_padding():
    shards = [shard_for("transformer.wte.weight", np.ones((11, 2)), r, 4) for r in range(4)]
    assert [len(s) for s in shards] == [3, 3, 3, 3]  # 11 rows padded to 12
    np.testing.assert_array_equal(shards[3][-1], 0.0)  # the padded row is zero
    assert vocab_range(11, 3, 4) == (9, 12)
    with pytest.raises(ValueError, match="needs vocab_size"):
        unshard("lm_head.weight", shards)
    with pytest.raises(ValueError, match="divisible"):
        shard_for("transformer.h.0.mlp.c_fc.weight", np.ones((10, 2)), 0, 3)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_vocab_parallel_embedding_equals_the_full_lookup(sequence_parallel):
    V = 7
    table = np.random.default_rng(0).standard_normal((V, C))
    idx = np.random.default_rng(1).integers(0, V, (B, T))

    def rank(group):
        emb = nn.Embedding(-(-V // N), C, dtype="float64")  # this rank's rows of the padded vocabulary
        vocab_parallel_embedding(emb, V, group, sequence_parallel)
        emb.weight.data[...] = shard_for("transformer.wte.weight", table, group.rank, N)
        out = emb(idx)
        out.sum().backward()
        return out.data, emb.weight.grad

    counts = np.bincount(idx.reshape(-1), minlength=V)[:, None] * np.ones((1, C))  # d sum / d row = uses
    ranks = minidist.run_local(rank, N)
    for r, (out, grad) in enumerate(ranks):
        np.testing.assert_array_equal(out, table[idx][:, np.split(np.arange(T), N)[r]] if sequence_parallel
                                      else table[idx])
    grad = unshard("transformer.wte.weight", [g for _, g in ranks], V)
    # under sequence parallelism each rank's tokens are summed only once: all-gather in backward
    np.testing.assert_array_equal(grad, counts)


@pytest.mark.parametrize("V, tp", [(11, 3), (5, 4), (8, 2)])
def test_vocab_parallel_cross_entropy_equals_cross_entropy_in_3_small_all_reduces(V, tp):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((B, T, V)) * 3
    targets = rng.integers(0, V, (B, T))
    full = Tensor(logits, requires_grad=True)
    ref = cross_entropy(full, targets)
    ref.backward()

    def rank(group):
        start, end = vocab_range(V, group.rank, tp)
        padded = np.concatenate([logits, np.full((B, T, end - V if end > V else 0), 1e6)], axis=-1)
        mine = Tensor(np.ascontiguousarray(padded[..., start:end]), requires_grad=True)  # huge padded logits...
        group.trace.clear()
        loss = vocab_parallel_cross_entropy(mine, targets, group, V)
        forward = [(e.op, e.nbytes) for e in group.trace.events]
        group.trace.clear()
        loss.backward()
        return loss.item(), mine.grad, forward, len(group.trace.events)

    ranks = minidist.run_local(rank, tp)
    for loss, _, forward, backward in ranks:
        assert abs(loss - ref.item()) <= 1e-12 * ref.item()  # ...are masked out, not counted
        assert forward == [("all_reduce", B * T * 8)] * 3  # max, sum of exps, target logit: N numbers each
        assert backward == 0
    grad = np.concatenate([g for _, g, _, _ in ranks], axis=-1)
    np.testing.assert_allclose(grad[..., :V], full.grad, rtol=0, atol=1e-15)
    np.testing.assert_array_equal(grad[..., V:], 0.0)  # padded columns get no gradient
