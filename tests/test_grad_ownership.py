"""Who owns which gradient element (minidist/parallel/compose/grad_ownership.py): the tags declared on
Parameter, the one rule, and the two ways the global gradient norm applies it: per parameter
(clip.py: each tp rank adds what it counts) and per flat element (ZeRO: a "sharded" sum all-reduced
over tp plus a "replicated" sum taken once) giving the same number."""
import numpy as np
import pytest

from minidist.nn import Parameter
from minidist.parallel.compose.clip import local_grad_norm_sq
from minidist.parallel.zero.flat_buffer import FlatUnit
from minidist.parallel.compose.grad_ownership import counted_in_norm, norm_bucket, summed_over_tp

TAGS = ("tensor_parallel", "sequence_parallel", "tied_copy")


def param(size, **tags):
    p = Parameter(np.zeros(size))
    for tag, value in tags.items():
        setattr(p, tag, value)
    return p


def test_tags_are_declared_false_and_set_per_instance():
    a, b = param(2), param(2, tied_copy=True)
    assert all(getattr(Parameter, tag) is False and getattr(a, tag) is False for tag in TAGS)
    assert b.tied_copy is True and Parameter.tied_copy is False and a.tied_copy is False


@pytest.mark.parametrize("tags, bucket, counted_on_tp_ranks", [
    ({}, "replicated", (True, False, False)),
    ({"sequence_parallel": True}, "replicated", (True, False, False)),  # once summed over tp: replicated
    ({"tensor_parallel": True}, "sharded", (True, True, True)),
    ({"tied_copy": True}, None, (False, False, False)),
    ({"tied_copy": True, "tensor_parallel": True}, None, (False, False, False)),
])
def test_the_rule(tags, bucket, counted_on_tp_ranks):
    p = param(1, **tags)
    assert norm_bucket(p) == bucket
    assert tuple(counted_in_norm(p, r) for r in range(3)) == counted_on_tp_ranks
    assert summed_over_tp(p) == tags.get("sequence_parallel", False)


def _model(tp_rank):
    """One tp rank's parameters: a shard, a replicated one, a sequence-parallel one, a tied copy of a
    shard; gradients are integers so every sum is exact."""
    rng = np.random.default_rng(tp_rank)
    params = [param(5, tensor_parallel=True), param(3), param(4, sequence_parallel=True),
              param(6, tensor_parallel=True, tied_copy=True)]
    for p in params:
        p.grad = rng.integers(-5, 6, p.data.shape).astype(float)
    replicated = np.random.default_rng(99)  # replicated gradients are the same on every tp rank
    for p in params[1:3]:
        p.grad = replicated.integers(-5, 6, p.data.shape).astype(float)
    return params


@pytest.mark.parametrize("dp", [1, 2, 3, 7])
def test_flat_masks_follow_the_rule(dp):
    params = _model(0)
    for dp_rank in range(dp):
        unit = FlatUnit("u", [(f"p{i}", p) for i, p in enumerate(params)], dp_rank, dp)
        per_element = unit.flatten([np.full(p.data.shape, i) for i, p in enumerate(params)])[unit.lo:unit.hi]
        which = [params[int(i)] for i in per_element]  # the parameter of each shard element
        np.testing.assert_array_equal(unit.tensor_parallel_mask(), [p.tensor_parallel for p in which])
        np.testing.assert_array_equal(unit.counted_mask(), [norm_bucket(p) is not None for p in which])
        np.testing.assert_array_equal(unit.sequence_parallel_mask(), [summed_over_tp(p) for p in which])


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_clip_and_zero_count_the_same_elements(tp):
    ranks = [_model(r) for r in range(tp)]
    clip = sum(local_grad_norm_sq(params, r) for r, params in enumerate(ranks))  # then all-reduced over tp
    sums = np.zeros((tp, 2))  # ZeRO: per tp rank [sharded, replicated] over its flat shard (dp = 1)
    for r, params in enumerate(ranks):
        unit = FlatUnit("u", [(f"p{i}", p) for i, p in enumerate(params)], 0, 1)
        g, tensor_parallel = unit.flatten([p.grad for p in params]), unit.tensor_parallel_mask().astype(bool)
        counted = unit.counted_mask().astype(bool)
        sums[r] = (g[tensor_parallel & counted] ** 2).sum(), (g[~tensor_parallel & counted] ** 2).sum()
    assert np.all(sums[:, 1] == sums[0, 1])  # replicated: the same on every tp rank, so taken once
    assert clip == sums[:, 0].sum() + sums[0, 1]
    expected = sum((p.grad ** 2).sum() for params in ranks for p in params if p.tensor_parallel and not p.tied_copy)
    assert clip == expected + (ranks[0][1].grad ** 2).sum() + (ranks[0][2].grad ** 2).sum()
