"""The cache-blocked updates: ``adamw_update`` and ``sgd_update`` walk NumPy arrays in blocks of
``minidist.optim.blocks.BLOCK`` elements, and must give bitwise what the whole-array code gave (kept
here as the reference) for every size (0, 1, odd, not a multiple of the block, several blocks), dtype,
weight-decay form and step; and the optimizers' flat buffers (``flatten`` / ``step_flat``) must give
bitwise the per-tensor update."""
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidist.optim import SGD, AdamW, adamw_update, sgd_update
from minidist.optim import blocks


def adamw_unblocked(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.0):
    """The update as it was before blocking: whole-array operations."""
    param *= 1 - lr * weight_decay
    exp_avg *= beta1
    exp_avg += (1 - beta1) * grad
    exp_avg_sq *= beta2
    work = grad * grad
    work *= 1 - beta2
    exp_avg_sq += work
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    np.sqrt(exp_avg_sq, out=work)
    work /= bias_correction2 ** 0.5
    work += eps
    np.divide(exp_avg, work, out=work)
    work *= lr / bias_correction1
    param -= work


def sgd_unblocked(param, grad, momentum_buf, *, lr, momentum=0.0, weight_decay=0.0):
    """SGD as it was before blocking: whole-array operations."""
    zero = isinstance(weight_decay, (int, float)) and weight_decay == 0
    g = grad if zero else grad + weight_decay * param
    if momentum:
        momentum_buf *= momentum
        momentum_buf += g
        g = momentum_buf
    param -= lr * g


@pytest.fixture
def small_block(monkeypatch):
    """Blocks of 64 elements, so small arrays cross many block boundaries."""
    monkeypatch.setattr(blocks, "BLOCK", 64)
    return 64


def arrays(n, dtype, seed, shape=None):
    """Parameters, gradients per step, and AdamW state of ``n`` elements (state from earlier steps)."""
    rng = np.random.default_rng(seed)
    shape = shape or (n,)
    p = rng.standard_normal(shape).astype(dtype)
    m = (0.1 * rng.standard_normal(shape)).astype(dtype)
    v = (0.01 * rng.random(shape)).astype(dtype)
    grads = [rng.standard_normal(shape).astype(dtype) for _ in range(5)]
    return p, m, v, grads


def decay_forms(n, dtype, seed):
    """Every form of weight decay on ``n`` elements: numbers, 0/1 masks times a rate, rates."""
    rng = np.random.default_rng(seed)
    mask = (rng.random(n) < 0.6).astype(dtype)
    return {"zero": 0.0, "number": 0.1, "numpy scalar": np.float64(0.05), "mask": 0.1 * mask,
            "float64 mask with float32 data": 0.1 * mask.astype(np.float64),
            "rates": rng.random(n).astype(dtype) * 0.2}


def run_adamw(update, p, m, v, grads, decay, lr=3e-3):
    p, m, v = p.copy(), m.copy(), v.copy()
    for t, g in enumerate(grads, start=1):
        update(p, g, m, v, step=t, lr=lr * (1 + 0.1 * t), beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=decay)
    return p, m, v


def run_sgd(update, p, buf, grads, decay, momentum):
    p, buf = p.copy(), buf.copy()
    for t, g in enumerate(grads, start=1):
        update(p, g, buf, lr=0.05 / t, momentum=momentum, weight_decay=decay)
    return p, buf


def assert_bitwise(got, want):
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))


SIZES = [0, 1, 7, 63, 64, 65, 128, 129, 64 * 5 + 17]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_blocked_adamw_is_bitwise_the_whole_array_update(small_block, n, dtype):
    p, m, v, grads = arrays(n, dtype, seed=n)
    for name, decay in decay_forms(n, dtype, seed=n + 1).items():
        assert_bitwise(run_adamw(adamw_update, p, m, v, grads, decay),
                       run_adamw(adamw_unblocked, p, m, v, grads, decay))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_blocked_sgd_is_bitwise_the_whole_array_update(small_block, n, dtype, momentum):
    p, m, _, grads = arrays(n, dtype, seed=n)
    for name, decay in decay_forms(n, dtype, seed=n + 1).items():
        assert_bitwise(run_sgd(sgd_update, p, m, grads, decay, momentum),
                       run_sgd(sgd_unblocked, p, m, grads, decay, momentum))


@given(n=st.integers(0, 400), dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**16),
       decay=st.sampled_from(["zero", "number", "mask", "rates"]), lr=st.floats(1e-5, 1e-1))
@settings(max_examples=60, deadline=None)
def test_blocked_updates_equal_whole_array_updates_on_any_size(n, dtype, seed, decay, lr):
    blocks_before, blocks.BLOCK = blocks.BLOCK, 32
    try:
        p, m, v, grads = arrays(n, dtype, seed)
        wd = decay_forms(n, dtype, seed + 1)[decay]
        assert_bitwise(run_adamw(adamw_update, p, m, v, grads, wd, lr),
                       run_adamw(adamw_unblocked, p, m, v, grads, wd, lr))
        assert_bitwise(run_sgd(sgd_update, p, m, grads, wd, 0.9), run_sgd(sgd_unblocked, p, m, grads, wd, 0.9))
    finally:
        blocks.BLOCK = blocks_before


@pytest.mark.parametrize("n", [blocks.BLOCK - 1, blocks.BLOCK, 2 * blocks.BLOCK + 3])
def test_the_real_block_size(n):
    p, m, v, grads = arrays(n, np.float32, seed=5)
    decay = decay_forms(n, np.float32, seed=6)["mask"]
    assert_bitwise(run_adamw(adamw_update, p, m, v, grads[:2], decay),
                   run_adamw(adamw_unblocked, p, m, v, grads[:2], decay))


def test_mixed_dtypes_keep_the_whole_array_temporaries_dtypes(small_block):
    # float32 masters and state, float16 gradients and a float16 mask (ZeRO in mixed precision):
    # each temporary has the dtype the whole-array expression gave it (e.g. (1 - beta1) * grad in float16).
    p, m, v, grads = arrays(200, np.float32, seed=7)
    grads16 = [g.astype(np.float16) for g in grads]
    mask16 = 0.1 * (np.arange(200) % 3 == 0).astype(np.float16)
    for decay in (mask16, 0.1):
        assert_bitwise(run_adamw(adamw_update, p, m, v, grads16, decay),
                       run_adamw(adamw_unblocked, p, m, v, grads16, decay))
        assert_bitwise(run_sgd(sgd_update, p, m, grads16, decay, 0.9),
                       run_sgd(sgd_unblocked, p, m, grads16, decay, 0.9))


def test_numpy_scalar_hyperparameters_keep_their_dtype_rules(small_block):
    # A NumPy float64 learning rate is a "strong" scalar: float32 arrays compute those steps in float64.
    p, m, v, grads = arrays(150, np.float32, seed=8)
    mask = decay_forms(150, np.float32, seed=9)["mask"]
    for lr in (np.float64(3e-3), np.float32(3e-3)):
        assert_bitwise(run_adamw(adamw_update, p, m, v, grads, mask, lr),
                       run_adamw(adamw_unblocked, p, m, v, grads, mask, lr))


@pytest.mark.parametrize("shape", [(7, 30), (3, 5, 20)])
def test_multidimensional_and_strided_tensors(small_block, shape):
    # Contiguous tensors are blocked through a flat view; strided ones are updated whole.
    p, m, v, grads = arrays(0, np.float32, seed=10, shape=shape)
    assert_bitwise(run_adamw(adamw_update, p, m, v, grads, 0.1), run_adamw(adamw_unblocked, p, m, v, grads, 0.1))
    pt, mt, vt, gt = p.T, m.T, v.T.copy(), [g.T for g in grads]     # transposed views: not C-contiguous
    assert_bitwise(run_adamw(adamw_update, pt, mt, vt, gt, 0.1), run_adamw(adamw_unblocked, pt, mt, vt, gt, 0.1))


# --- flat buffers: Optimizer.flatten / step_flat, one call per run of one rate, bitwise per tensor -----

SHAPES = [(20, 9), (9,), (9,), (5, 7), (3, 4, 2), (1,), (40, 3)]   # 180 + 9 + 9 + 35 + 24 + 1 + 120


def named(values):
    """Stand-ins for model Parameters (``.data`` updated in place, ``.grad``), one per shape of SHAPES."""
    return [(f"p{i}", SimpleNamespace(data=v.copy(), grad=None)) for i, v in enumerate(values)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("make", [lambda ps: AdamW(ps, lr=3e-3, weight_decay=0.1),
                                  lambda ps: SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.1),
                                  lambda ps: SGD(ps, lr=0.05)], ids=["adamw", "sgd-momentum", "sgd"])
def test_flat_groups_update_bitwise_as_per_tensor(small_block, dtype, make):
    rng = np.random.default_rng(11)
    values = [rng.standard_normal(s).astype(dtype) for s in SHAPES]
    per, flat = make(named(values)), make(named(values))
    names = list(per.params)
    groups = [names[:4], names[4:]]        # two data-parallel buckets, each longer than a block
    flat.flatten(groups)
    for step in range(1, 5):
        grads = {name: rng.standard_normal(p.data.shape).astype(dtype) for name, p in per.params.items()}
        per.lr = flat.lr = 3e-3 * step
        for name, p in per.params.items():
            p.grad = grads[name]
        per.step()
        flat.step_flat([np.concatenate([grads[n].reshape(-1) for n in group]) for group in groups])
    for name in names:
        assert_bitwise([flat.params[name].data], [per.params[name].data])
    for key, value in per.state_dict().items():
        assert_bitwise([flat.state_dict()[key]], [value])


def test_a_float32_mask_is_not_always_the_per_tensor_update():
    # Why step_flat updates each run of parameters with one rate as a number, not the whole buffer with
    # a mask: with a float32 mask, 1 - lr * rate is computed in float32; with a number, in Python
    # (float64) and rounded once. For some learning rates the two factors differ in the last bit.
    lr = next(lr for lr in np.linspace(1e-4, 1e-2, 20000).tolist()   # Python floats, as the trainer's
              if np.float32(1) - np.float32(lr) * np.float32(0.1) != np.float32(1 - lr * 0.1))
    zeros = np.zeros(4, np.float32)
    by_mask, by_number = np.ones(4, np.float32), np.ones(4, np.float32)
    adamw_update(by_mask, zeros, zeros.copy(), zeros.copy(), step=1, lr=lr, weight_decay=0.1 * np.ones(4, np.float32))
    adamw_update(by_number, zeros, zeros.copy(), zeros.copy(), step=1, lr=lr, weight_decay=0.1)
    assert by_number[0] == np.float32(1 - lr * 0.1) != by_mask[0]


# --- on the GPU (the fake CuPy): whole arrays, the same numbers -------------------------------------

def test_device_arrays_are_updated_whole_and_give_the_same_bits(cp, small_block):
    n = 200
    p, m, v, grads = arrays(n, np.float32, seed=13)
    for decay in (0.1, decay_forms(n, np.float32, seed=14)["mask"]):
        dev = [cp.asarray(a) for a in (p, m, v)]
        dev_decay = cp.asarray(decay) if isinstance(decay, np.ndarray) else decay
        host = [p.copy(), m.copy(), v.copy()]
        for t, g in enumerate(grads, start=1):
            adamw_update(dev[0], cp.asarray(g), dev[1], dev[2], step=t, lr=1e-2, weight_decay=dev_decay)
            adamw_update(host[0], g, host[1], host[2], step=t, lr=1e-2, weight_decay=decay)
        assert_bitwise([d.get() for d in dev], host)
        buf_dev, p_dev, buf, ph = cp.asarray(m), cp.asarray(p), m.copy(), p.copy()
        for g in grads:
            sgd_update(p_dev, cp.asarray(g), buf_dev, lr=0.05, momentum=0.9, weight_decay=dev_decay)
            sgd_update(ph, g, buf, lr=0.05, momentum=0.9, weight_decay=decay)
        assert_bitwise([p_dev.get(), buf_dev.get()], [ph, buf])
