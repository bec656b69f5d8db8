"""Global-norm gradient clipping and the warmup + cosine learning-rate schedule."""
import math
from types import SimpleNamespace

import numpy as np
import pytest

from minidist.optim import clip_coef, clip_grad_norm, grad_norm_sq, lr_at
from minidist.optim.clip import LEAF, square_sum


def params_with_grads(*grads):
    return [SimpleNamespace(grad=None if g is None else np.array(g, dtype=np.float64)) for g in grads]


def test_clipping_scales_all_gradients_by_one_factor_to_max_norm():
    ps = params_with_grads([3.0], [[0.0, 4.0]], None)     # global norm sqrt(9 + 16) = 5
    total = clip_grad_norm(ps, max_norm=1.0)
    assert total == pytest.approx(5.0)                    # the norm BEFORE clipping
    np.testing.assert_allclose(ps[0].grad, [0.6], rtol=1e-6)
    np.testing.assert_allclose(ps[1].grad, [[0.0, 0.8]], rtol=1e-6)
    assert ps[2].grad is None


def test_gradients_below_max_norm_are_untouched():
    ps = params_with_grads([3.0], [4.0])
    assert clip_grad_norm(ps, max_norm=10.0) == pytest.approx(5.0)
    assert ps[0].grad[0] == 3.0 and ps[1].grad[0] == 4.0


def test_norm_pieces_combine_like_an_all_reduce():
    # Parallel ranks each sum squares of their own shard; adding the sums gives the global norm.
    g = np.arange(10.0)
    shards = np.array_split(g, 3)
    assert sum(grad_norm_sq([s]) for s in shards) == pytest.approx(float(g @ g))
    assert clip_coef(total_norm=2.0, max_norm=1.0) == pytest.approx(0.5, rel=1e-6)
    assert clip_coef(total_norm=0.5, max_norm=1.0) == 1.0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 7, 9, 129, LEAF, LEAF + 1, 2 * LEAF + 3, 5 * LEAF + 17, 768 * 2304 + 5])
def test_square_sum_in_chunks_is_bitwise_numpys_whole_array_sum(n, dtype):
    # The chunks follow NumPy's own pairwise split, so the float is the same to the last bit.
    g = np.random.default_rng(n).standard_normal(n).astype(dtype)
    assert square_sum(g).tobytes() == (g * g).sum().tobytes()
    assert square_sum(g.reshape(1, -1)).tobytes() == (g * g).sum().tobytes()       # any contiguous shape
    strided = g[::2]
    assert square_sum(strided).tobytes() == (strided * strided).sum().tobytes()  # the one-line path


def test_schedule_warms_up_linearly_then_follows_a_half_cosine_to_min_lr():
    base, floor, warmup, total = 1e-3, 1e-4, 10, 110
    lrs = [lr_at(s, base, warmup, total, floor) for s in range(total + 5)]
    assert lrs[0] == pytest.approx(base / warmup)                         # first step: base / warmup
    np.testing.assert_allclose(lrs[:warmup], base * np.arange(1, warmup + 1) / warmup)
    assert lrs[warmup] == pytest.approx(base)                             # peak
    assert lrs[warmup + 50] == pytest.approx((base + floor) / 2)          # half way down the cosine
    assert lrs[warmup + 25] == pytest.approx(floor + (base - floor) * (1 + math.cos(math.pi / 4)) / 2)
    assert all(a > b for a, b in zip(lrs[warmup:total], lrs[warmup + 1:total + 1]))   # strictly falling
    assert lrs[total:] == [floor] * 5                                     # floor after the end


def test_schedule_without_warmup_starts_at_base_lr():
    assert lr_at(0, 0.5, 0, 100, 0.0) == 0.5
