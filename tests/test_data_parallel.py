"""Data parallelism, in-process ranks: replicas start equal, gradients live in flat buckets that are
all-reduced while backward is still running, accumulation over micro-batches communicates once and
correctly, and the averaged gradients equal one process's gradients on the full batch."""
import numpy as np
import pytest

from minidist import run_local
from minidist.data import ByteTokenizer, get_batch, grammar_text, inputs_and_targets
from minidist.model import GPT, GPTConfig
from minidist.parallel.data.data_parallel import DataParallel
from minidist.parallel.data.sampler import DistributedSampler, dp_rows, micro_batches
from minidist.parallel.step import forward_backward

CONFIG = GPTConfig(block_size=8, n_layer=2, n_head=2, n_embd=16)
B = 8
TOKENS = ByteTokenizer().encode(grammar_text(5_000, seed=1))


def batch(step=0):
    return get_batch(TOKENS, step, B, CONFIG.block_size, seed=3)  # (B, T+1)


def reference_grads(batches):
    """One process, whole batch: {name: gradient of the mean loss}."""
    model = GPT(CONFIG, seed=0, dtype="float64")
    forward_backward(model, batches)
    return {name: p.grad.copy() for name, p in model.named_parameters()}


def assert_grads_equal(grads, expected, rtol=1e-12):
    for name, g in expected.items():
        np.testing.assert_allclose(grads[name], g, rtol=rtol, atol=1e-15, err_msg=name)


def test_construction_broadcasts_weights_from_dp_rank_0():
    def fn(group):
        model = GPT(CONFIG, seed=group.rank, dtype="float64")  # replicas start different
        DataParallel(model, group)
        return model.state_dict()

    states = run_local(fn, world_size=3)
    expected = GPT(CONFIG, seed=0, dtype="float64").state_dict()
    for state in states:
        for name, value in expected.items():
            np.testing.assert_array_equal(state[name], value, err_msg=name)


@pytest.mark.parametrize("bucket_bytes", [1, 6_000, 10**9])
def test_buckets_hold_every_parameter_once_in_reverse_order_and_grads_are_views(bucket_bytes):
    model = GPT(CONFIG, seed=0, dtype="float64")
    dp = run_local(lambda group: DataParallel(model, group, bucket_bytes=bucket_bytes), world_size=1)[0]
    names = [name for name, _ in model.named_parameters()]
    assert [name for b in dp.buckets for name in b.names] == names[::-1]
    for bucket in dp.buckets[:-1]:
        assert bucket.nbytes >= bucket_bytes  # a bucket closes once it is full ...
        assert bucket.nbytes - bucket.params[-1].data.nbytes < bucket_bytes  # ... and not later
    if bucket_bytes == 1:
        assert len(dp.buckets) == len(names)  # every parameter fills a bucket alone
    if bucket_bytes == 10**9:
        assert len(dp.buckets) == 1
    for bucket in dp.buckets:
        for p in bucket.params:
            assert np.shares_memory(p.grad, bucket.buffer) and p.grad.shape == p.data.shape


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("bucket_bytes", [1, 6_000, 10**9])
def test_averaged_gradients_equal_one_process_on_the_full_batch(world_size, bucket_bytes):
    def fn(group):
        model = GPT(CONFIG, seed=0, dtype="float64")
        dp = DataParallel(model, group, bucket_bytes=bucket_bytes)
        forward_backward(model, [batch()[dp_rows(B, group.rank, group.size)]], dp.no_sync, group.trace)
        dp.finish()
        return {name: p.grad.copy() for name, p in model.named_parameters()}, len(dp.buckets)

    expected = reference_grads([batch()])
    for grads, _ in run_local(fn, world_size=world_size):
        assert_grads_equal(grads, expected)


def test_one_all_reduce_per_bucket_each_launched_from_inside_backward():
    def fn(group):
        model = GPT(CONFIG, seed=0, dtype="float64")
        dp = DataParallel(model, group, bucket_bytes=6_000)
        group.trace.clear()
        launched_by_backward = []
        for step in range(2):
            dp.zero_grad()
            forward_backward(model, [batch(step)[dp_rows(B, group.rank, group.size)]], dp.no_sync, group.trace)
            launched_by_backward.append([b.work is not None for b in dp.buckets])  # before finish()
            dp.finish()
        return group.trace.events, [b.nbytes for b in dp.buckets], launched_by_backward

    events, bucket_bytes, launched_by_backward = run_local(fn, world_size=2)[0]
    reduces = [e for e in events if e.op == "all_reduce"]
    assert len(bucket_bytes) > 2
    assert [e.nbytes for e in reduces] == bucket_bytes * 2  # one per bucket per step, in bucket order
    assert launched_by_backward == [[True] * len(bucket_bytes)] * 2  # the hooks queued every bucket


@pytest.mark.parametrize("n_micro", [2, 4])
def test_accumulation_communicates_once_and_equals_the_full_batch_gradient(n_micro):
    def fn(group):
        model = GPT(CONFIG, seed=0, dtype="float64")
        dp = DataParallel(model, group, bucket_bytes=6_000)
        group.trace.clear()
        forward_backward(model, micro_batches(batch()[dp_rows(B, group.rank, group.size)], n_micro),
                         dp.no_sync, group.trace)
        dp.finish()
        n_reduces = sum(e.op == "all_reduce" for e in group.trace.events)
        return {name: p.grad.copy() for name, p in model.named_parameters()}, n_reduces, len(dp.buckets)

    expected = reference_grads([batch()])
    for grads, n_reduces, n_buckets in run_local(fn, world_size=2):
        assert n_reduces == n_buckets  # only the last micro-batch's backward communicated
        assert_grads_equal(grads, expected)


def test_naive_accumulation_that_reduces_only_the_last_micro_batch_is_caught():
    # The popular bug: earlier micro-batches accumulate locally, then only the gradient computed by
    # the LAST backward is all-reduced (a hook on the incoming gradient) and added. Its result must
    # miss the full-batch gradient by far more than our tolerance; ours (test above) does not.
    def naive(group):
        model = GPT(CONFIG, seed=0, dtype="float64")

        def half_grads(micro):  # gradients of loss(micro) / 2, as accumulation over 2 computes them
            model.zero_grad()
            idx, targets = inputs_and_targets(micro)
            loss = model(idx, targets)[1]
            loss.backward(np.full_like(loss.data, 0.5))
            return {name: p.grad.copy() for name, p in model.named_parameters()}

        first, last = micro_batches(batch()[dp_rows(B, group.rank, group.size)], 2)
        accumulated, fresh = half_grads(first), half_grads(last)
        for name in fresh:
            group.all_reduce(fresh[name], op="avg")  # only the last micro-batch is averaged
        return {name: accumulated[name] + fresh[name] for name in fresh}

    expected = reference_grads([batch()])
    grads = run_local(naive, world_size=2)[0]
    with pytest.raises(AssertionError):
        assert_grads_equal(grads, expected, rtol=1e-3)


def test_zero_grad_of_the_optimizer_breaks_the_bucket_views_and_says_so():
    def fn(group):
        model = GPT(CONFIG, seed=0, dtype="float64")
        DataParallel(model, group)
        model.zero_grad()  # drops the views: backward would write fresh arrays no bucket sees
        with pytest.raises(RuntimeError, match="DataParallel.zero_grad"):
            forward_backward(model, [batch()[:2]])

    run_local(fn, world_size=1)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_each_dp_rank_reads_its_own_rows_of_the_global_batch(dp):
    samplers = [DistributedSampler(TOKENS, B, CONFIG.block_size, seed=3, dp_rank=d, dp_size=dp) for d in range(dp)]
    for step in range(3):
        parts = [s.batch(step) for s in samplers]
        np.testing.assert_array_equal(np.concatenate(parts), batch(step))
        assert all(len(p) == B // dp for p in parts)


def test_sampler_reads_a_memmapped_token_file(tmp_path):
    path = tmp_path / "tokens.bin"
    TOKENS.tofile(path)
    tokens = np.memmap(path, dtype=np.uint8, mode="r")
    sampler = DistributedSampler(tokens, B, CONFIG.block_size, seed=3, dp_rank=1, dp_size=2)
    np.testing.assert_array_equal(sampler.batch(5), get_batch(TOKENS, 5, B, CONFIG.block_size, seed=3)[4:])


def test_sampler_and_micro_batches_reject_uneven_splits():
    with pytest.raises(ValueError, match="not divisible by dp 3"):
        DistributedSampler(TOKENS, 8, 8, seed=0, dp_rank=0, dp_size=3)
    with pytest.raises(ValueError, match="3 equal micro-batches"):
        micro_batches(batch(), 3)
