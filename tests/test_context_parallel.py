"""Context-parallel attention on its own: the online softmax, ring attention (contiguous and zig-zag)
and Ulysses each equal one process's causal attention, forward and backward, to 1e-10 in float64;
zig-zag balances the causal work; what each sends is what its docstring says."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minidist
from minidist.autograd import Tensor, scaled_dot_product_attention
from minidist.parallel.context.context_parallel import ContextParallel
from minidist.parallel.context.ring_attention import (attention_block, block_plan, causal_work, merge_partial, ring_attention,
                                              sequence_chunks)
from minidist.parallel.context.ulysses import ulysses_attention


def softmax_attention(q, k, v, mask):
    """The reference: softmax(q k^T / sqrt(hs) with -inf where ``mask``) v, in one piece."""
    s = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    s = np.where(mask, -np.inf, s)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 5), st.integers(1, 6), st.integers(1, 5), st.randoms(use_true_random=False))
def test_online_softmax_over_key_blocks_equals_one_softmax(n_blocks, block, queries, random):
    """Keys cut into blocks, each block's (o, lse) merged in any order: the full softmax. A block
    whose keys are all masked for these queries is skipped, which is the same as merging nothing."""
    rng = np.random.default_rng(random.randrange(2**32))
    q = rng.standard_normal((2, queries, 3))
    k, v = rng.standard_normal((2, n_blocks * block, 3)), rng.standard_normal((2, n_blocks * block, 3))
    q_range = (n_blocks * block, n_blocks * block + queries)  # queries come after every key ...
    masked = random.randrange(n_blocks)  # ... except one block, placed after them: fully masked
    kpos = [(b if b != masked else n_blocks + 10) for b in range(n_blocks)]
    mask = np.repeat(np.array(kpos) > n_blocks, block)[None, :].repeat(queries, 0)
    expected = softmax_attention(q, k, v, mask)
    out, lse = np.zeros_like(q), np.full(q.shape[:-1], -np.inf)
    order = list(range(n_blocks))
    random.shuffle(order)
    for b in order:
        k_range = (kpos[b] * block, (kpos[b] + 1) * block)
        plan = block_plan([q_range], [k_range])
        if b == masked:
            assert plan == []  # the causal mask skips it whole
            continue
        assert plan == [(0, 0, "full")]
        o, block_lse = attention_block(q, k[:, b * block:(b + 1) * block], v[:, b * block:(b + 1) * block],
                                       1 / np.sqrt(3), q_range, k_range, "full")
        merge_partial(out, lse, o, block_lse)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


def test_a_block_against_itself_is_cut_by_the_causal_triangle():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))
    o, lse = attention_block(q, k, v, 0.5, (3, 8), (3, 8), "causal")
    assert block_plan([(3, 8)], [(3, 8)]) == [(0, 0, "causal")]
    np.testing.assert_allclose(o, softmax_attention(q * np.sqrt(4) * 0.5, k, v, np.triu(np.ones((5, 5)), 1) > 0),
                               rtol=1e-12)


def _reference(B=2, nh=4, T=16, hs=3, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, dy = (rng.standard_normal((B, nh, T, hs)) for _ in range(4))
    Q, K, V = (Tensor(a.copy(), requires_grad=True) for a in (q, k, v))
    y = scaled_dot_product_attention(Q, K, V, is_causal=True)
    y.backward(dy)
    return (q, k, v, dy), (y.data, Q.grad, K.grad, V.grad)


def _merged(*heads):
    """Arrays (B, nh, T, hs) side by side as the model lays them out, (B, T, n nh hs): one is
    attention's output, q, k and v the fused projection (q | k | v)."""
    return np.concatenate([a.transpose(0, 2, 1, 3).reshape(a.shape[0], a.shape[2], -1) for a in heads], axis=2)


def _heads(x, nh, n=1):
    """(B, T, n nh hs) -> n arrays (B, nh, T, hs): :func:`_merged` undone."""
    return [a.reshape(a.shape[0], a.shape[1], nh, -1).transpose(0, 2, 1, 3) for a in np.split(x, n, axis=2)]


def _relative_error(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("algorithm", ["ring", "zigzag", "ulysses"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_context_parallel_attention_equals_one_process_forward_and_backward(algorithm, cp):
    """Each rank gives its tokens' fused q | k | v (in the algorithm's order), as the model does;
    output, dq, dk and dv of its tokens equal one process's to 1e-10 relative."""
    T, nh = 24, 12
    (q, k, v, dy), expected = _reference(nh=nh, T=T)

    def fn(world):
        cp_ = ContextParallel(world, algorithm)
        idx = cp_.positions(T, np)
        qkv = Tensor(_merged(q[:, :, idx], k[:, :, idx], v[:, :, idx]), requires_grad=True)
        y = cp_.attend(qkv, nh)  # (B, T/cp, nh hs)
        y.backward(_merged(dy[:, :, idx]))
        return idx, (*_heads(y.data, nh), *_heads(qkv.grad, nh, 3))

    for idx, got in minidist.run_local(fn, cp):
        for a, b in zip(got, expected):
            assert _relative_error(a, b[:, :, idx]) < 1e-10


def test_zigzag_gives_every_rank_the_same_causal_work_and_the_contiguous_ring_does_not():
    """Work per rank in (T/cp)^2 blocks: contiguous r + 1/2 (the last rank does 2 cp - 1 times the
    first's), zig-zag cp / 2 on every rank; both add up to the causal triangle's cp^2 / 2."""
    for cp in (2, 4, 8):
        contiguous, zigzag = causal_work(64, cp, False), causal_work(64, cp, True)
        assert contiguous == [r + 0.5 for r in range(cp)]
        assert zigzag == [cp / 2] * cp
        assert sum(contiguous) == sum(zigzag) == cp * cp / 2


def test_zigzag_chunks_pair_each_early_chunk_with_a_late_one():
    assert [sequence_chunks(16, 4, r, True) for r in range(4)] == [
        [(0, 2), (14, 16)], [(2, 4), (12, 14)], [(4, 6), (10, 12)], [(6, 8), (8, 10)]]
    assert [sequence_chunks(16, 4, r, False) for r in range(4)] == [[(0, 4)], [(4, 8)], [(8, 12)], [(12, 16)]]


@pytest.mark.parametrize("dtype", ["float64", "float16"])
@pytest.mark.parametrize("zigzag", [False, True])
def test_the_ring_sends_what_its_docstring_says(zigzag, dtype):
    """Forward: cp - 1 K/V blocks to the next rank, 2 x B x nh x L x hs values in the inputs'
    dtype; backward: cp - 1 K/V blocks again and cp dK/dV sums, the sums in float32 for float16
    inputs (float64 for float64). Nothing else."""
    cp, B, nh, T, hs = 4, 1, 2, 16, 3
    values = 2 * B * nh * (T // cp) * hs
    kv, dkv = values * np.dtype(dtype).itemsize, values * (8 if dtype == "float64" else 4)

    def fn(world):
        rng = np.random.default_rng(world.rank)
        Q, K, V = (Tensor(rng.standard_normal((B, nh, T // cp, hs)).astype(dtype), requires_grad=True)
                   for _ in range(3))
        with world.trace.capture() as forward:
            y = ring_attention(Q, K, V, world, zigzag)
        with world.trace.capture() as backward:
            y.backward(np.ones_like(y.data))
        return [[(e.op, e.peer, e.nbytes) for e in events if e.op == "isend"] for events in (forward, backward)]

    for rank, (forward, backward) in enumerate(minidist.run_local(fn, cp)):
        nxt = (rank + 1) % cp
        assert forward == [("isend", nxt, kv)] * (cp - 1)
        assert sorted(backward) == sorted([("isend", nxt, kv)] * (cp - 1) + [("isend", nxt, dkv)] * cp)


def test_ulysses_sends_two_all_to_alls_each_way():
    cp, B, nh, T, hs = 2, 1, 4, 8, 3

    def fn(world):
        rng = np.random.default_rng(world.rank)
        Q, K, V = (Tensor(rng.standard_normal((B, nh, T // cp, hs)), requires_grad=True) for _ in range(3))
        with world.trace.capture() as events:
            ulysses_attention(Q, K, V, world).backward(np.ones((B, nh, T // cp, hs)))
        return [(e.op, e.nbytes) for e in events if e.kind == "collective"]

    qkv, out = 3 * B * nh * (T // cp) * hs * 8, B * nh * (T // cp) * hs * 8
    for calls in minidist.run_local(fn, cp):
        assert calls == [("all_to_all", qkv), ("all_to_all", out), ("all_to_all", out), ("all_to_all", qkv)]


def test_a_sequence_that_does_not_cut_evenly_is_refused():
    with pytest.raises(ValueError, match="cuts a sequence into 4 equal parts: T = 6"):
        minidist.run_local(lambda w: ContextParallel(w, "zigzag").positions(6, np), 2)
    with pytest.raises(ValueError, match="one of ring, zigzag, ulysses"):
        ContextParallel(None, "tree")


@pytest.mark.parametrize("algorithm", ["ring", "zigzag", "ulysses"])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_on_gpu_buffers_over_nccl(algorithm, cp):
    """Over backend "nccl" (the fake NCCL: ranks as threads, messages matched by order alone, no
    tags) on device arrays: every hop's sends and receives pair up and nothing deadlocks; the result
    is one process's attention."""
    from tests.doubles import fake_cupy, fake_nccl
    from tests.test_nccl_backend import run_nccl
    T = 16
    (q, k, v, dy), expected = _reference(nh=4, T=T)
    device = fake_cupy.install(nccl=fake_nccl)
    try:
        def fn(group):
            cp_ = ContextParallel(group, algorithm)
            idx = cp_.positions(T, np)
            qkv = Tensor(device.asarray(_merged(q[:, :, idx], k[:, :, idx], v[:, :, idx])), requires_grad=True)
            y = cp_.attend(qkv, 4)
            y.backward(device.asarray(_merged(dy[:, :, idx])))
            assert type(y.data) is device.ndarray and type(qkv.grad) is device.ndarray
            return idx, _heads(y.data.get(), 4) + _heads(qkv.grad.get(), 4, 3)
        results = run_nccl(fn, cp, timeout=10.0)
    finally:
        fake_cupy.uninstall()
    for idx, got in results:
        for a, b in zip(got, expected):
            assert _relative_error(a, b[:, :, idx]) < 1e-10
