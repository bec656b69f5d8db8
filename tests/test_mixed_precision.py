"""Mixed precision, one piece at a time: the loss scaler's state machine and its agreement across
ranks, bfloat16 rounding (bit-exact), float32 master weights under a float16 model, and the float16
behaviour of the autograd ops it relies on."""
import math

from types import SimpleNamespace

import numpy as np
import pytest

from minidist import run_local
from minidist.amp import DynamicLossScaler, MixedPrecision, round_to_bfloat16
from minidist.autograd import Tensor, cross_entropy, linear
from minidist.model import GPT, GPTConfig
from minidist.optim import SGD, AdamW
from minidist.parallel.compose.gradients import WholeGradients, apply_gradients

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)

def amp_step(model, amp, optimizer, max_norm=math.inf):
    """The gradient pipeline on whole tensors (gradients.py) with ``amp``'s masters: (skipped, grad
    norm (NaN when skipped), the loss scale the step used)."""
    scale = amp.scaler.scale
    norm = apply_gradients(WholeGradients(model, optimizer, amp=amp), optimizer.lr, max_norm, amp.scaler)
    return SimpleNamespace(skipped=norm is None, grad_norm=math.nan if norm is None else norm, loss_scale=scale)



# ---- the loss scaler -------------------------------------------------------------------------------

def test_scaler_starts_at_2_to_the_16():
    assert DynamicLossScaler().scale == 2.0 ** 16


def test_overflow_halves_the_scale_and_counts_a_skip():
    scaler = DynamicLossScaler(growth_interval=3)
    scaler.update(found_inf=True)
    scaler.update(found_inf=True)
    assert scaler.scale == 2.0 ** 14 and scaler.skipped_steps == 2


def test_a_window_of_clean_steps_doubles_the_scale_and_an_overflow_restarts_the_window():
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=3)
    history = []
    for found_inf in [False, False, True, False, False, False, False, False, False]:
        scaler.update(found_inf)
        history.append(scaler.scale)
    # two clean steps are not a window; the overflow halves and restarts it; 3 clean: x2; 3 more: x2
    assert history == [8, 8, 4, 4, 4, 8, 8, 8, 16]


def test_static_scale_never_changes_but_still_counts_skips():
    scaler = DynamicLossScaler.static(128.0)
    for found_inf in [True, False, True] + [False] * 5000:
        scaler.update(found_inf)
    assert scaler.scale == 128.0 and scaler.skipped_steps == 2


def test_scaler_state_dict_round_trip():
    a = DynamicLossScaler(growth_interval=5)
    for found_inf in [True, False, False]:
        a.update(found_inf)
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    assert (b.scale, b.clean_steps, b.skipped_steps) == (2.0 ** 15, 2, 1)


@pytest.mark.parametrize("bad", [dict(init_scale=0.0), dict(init_scale=math.inf), dict(growth_factor=0.5),
                                 dict(backoff_factor=2.0), dict(growth_interval=0)])
def test_scaler_rejects_bad_settings(bad):
    with pytest.raises(ValueError):
        DynamicLossScaler(**bad)


@pytest.mark.parametrize("poison", [np.inf, -np.inf, np.nan])
def test_found_inf_is_agreed_by_every_rank_when_only_one_rank_overflows(poison):
    def fn(group):
        grads = [np.ones(5, np.float16), np.ones((2, 3), np.float16)]
        clean = DynamicLossScaler(group=group).found_inf(grads)
        if group.rank == 1:
            grads[1][1, 2] = poison
        return clean, DynamicLossScaler(group=group).found_inf(grads)

    assert run_local(fn, world_size=3) == [(False, True)] * 3


def test_found_inf_sends_one_8_byte_all_reduce():
    def fn(group):
        group.trace.clear()
        DynamicLossScaler(group=group).found_inf([np.ones(1000, np.float16), None])
        return [(e.op, e.nbytes) for e in group.trace.events]

    assert run_local(fn, world_size=2) == [[("all_reduce", 8)]] * 2


# ---- bfloat16 rounding -----------------------------------------------------------------------------

def bits_to_f32(bits):
    return np.array(bits, dtype=np.uint32).view(np.float32)


@pytest.mark.parametrize("bits, expected", [
    (0x3F800000, 0x3F800000),  # 1.0 is a bfloat16 already
    (0x3F807FFF, 0x3F800000),  # below the halfway point: down
    (0x3F808000, 0x3F800000),  # a tie, kept part even (...0): stays
    (0x3F818000, 0x3F820000),  # a tie, kept part odd (...1): up to even
    (0x3F808001, 0x3F810000),  # just above halfway: up
    (0xBF808001, 0xBF810000),  # negative numbers round by magnitude
    (0x3FFFFFFF, 0x40000000),  # the carry runs into the exponent: 1.99999988 -> 2.0
    (0x7F7FFFFF, 0x7F800000),  # the largest float32 rounds to +inf (beyond bfloat16's max)
    (0x7F7F7FFF, 0x7F7F0000),  # ... but just below bfloat16's halfway point it stays finite
    (0x7F800000, 0x7F800000),  # +inf
    (0xFF800000, 0xFF800000),  # -inf
    (0x00000000, 0x00000000),  # +0
    (0x80000000, 0x80000000),  # -0
    (0x00018000, 0x00020000),  # a subnormal tie rounds to even as well
])
def test_round_to_bfloat16_bit_exact(bits, expected):
    assert round_to_bfloat16(bits_to_f32([bits])).view(np.uint32)[0] == expected


def test_round_to_bfloat16_keeps_nan_a_nan():
    nan_bits = [0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF]  # the carry would make some of them inf
    out = round_to_bfloat16(bits_to_f32(nan_bits))
    assert np.isnan(out).all() and (out.view(np.uint32) & 0xFFFF == 0).all()


def test_round_to_bfloat16_is_the_nearest_bfloat16_ties_to_even_on_random_bits():
    # Independent reference: the two bfloat16 neighbours by truncation, the nearer one in float64.
    bits = np.random.default_rng(0).integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32)
    bits = bits[np.isfinite(bits.view(np.float32))]
    below = (bits & 0xFFFF0000).view(np.float32).astype(np.float64)  # toward zero
    above_bits = (bits & 0xFFFF0000).astype(np.uint64) + 0x10000
    above = above_bits.astype(np.uint32).view(np.float32).astype(np.float64)  # away from zero (may be inf)
    x = bits.view(np.float32).astype(np.float64)
    d_below, d_above = np.abs(x - below), np.abs(above - x)
    below_is_even = ((bits >> 16) & 1) == 0
    take_below = (d_below < d_above) | ((d_below == d_above) & below_is_even)
    top = bits.view(np.float32)
    overflow = np.isinf(above) & (np.abs(x) >= 2.0 ** 127 * (2 - 2.0 ** -8))  # past bfloat16 max's half-ulp
    expected = np.where(take_below & ~overflow, below, above)
    got = round_to_bfloat16(top).astype(np.float64)
    np.testing.assert_array_equal(got, expected)
    assert ((round_to_bfloat16(top).view(np.uint32) & 0xFFFF) == 0).all()


# ---- master weights --------------------------------------------------------------------------------

def tiny_batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CONFIG.vocab_size, (4, CONFIG.block_size + 1))
    return tokens[:, :-1], tokens[:, 1:]


def fp16_step(model, amp, optimizer, seed=0):
    for p in model.parameters():
        p.grad = None
    idx, targets = tiny_batch(seed)
    amp.backward(model(idx, targets)[1])
    return amp_step(model, amp, optimizer, 1.0)


def test_masters_and_optimizer_state_are_float32_the_model_float16():
    model = GPT(CONFIG, seed=0, dtype="float16")
    amp = MixedPrecision(model, "float16", DynamicLossScaler())
    optimizer = AdamW(amp.master_parameters(), lr=1e-3)
    for step in range(3):
        assert not fp16_step(model, amp, optimizer, step).skipped
    assert {m.data.dtype for _, m in amp.master_parameters()} == {np.dtype(np.float32)}
    assert {a.dtype for slot in optimizer.state.values() for a in slot.values()} == {np.dtype(np.float32)}
    assert {p.data.dtype for p in model.parameters()} == {np.dtype(np.float16)}
    assert {p.grad.dtype for p in model.parameters()} == {np.dtype(np.float16)}
    for (name, p), (_, m) in zip(model.named_parameters(), amp.master_parameters()):
        np.testing.assert_array_equal(p.data, m.data.astype(np.float16))  # the model is the rounded master


def test_master_gradient_is_the_unscaled_float32_gradient():
    model = GPT(CONFIG, seed=0, dtype="float16")
    scaler = DynamicLossScaler()
    amp = MixedPrecision(model, "float16", scaler)
    idx, targets = tiny_batch()
    amp.backward(model(idx, targets)[1])
    grads16 = [p.grad.copy() for p in model.parameters()]
    amp_step(model, amp, SGD(amp.master_parameters(), lr=0.0))
    for g16, (_, m) in zip(grads16, amp.master_parameters()):
        assert m.grad.dtype == np.float32
        np.testing.assert_array_equal(m.grad, g16.astype(np.float32) / 2.0 ** 16)  # exact: power of two


def test_updates_too_small_for_float16_accumulate_in_the_master():
    # One weight of value 1.0 and updates of 1e-4: float16's spacing at 1.0 is 2**-10 ~ 1e-3, so a
    # float16 weight would never move; the float32 master collects them and the model follows.
    model = GPT(CONFIG, seed=0, dtype="float16")
    amp = MixedPrecision(model, "float16", DynamicLossScaler.static(1024.0))  # 2**16 is no float16
    optimizer = SGD(amp.master_parameters(), lr=1e-4)
    ln = model.transformer.ln_f.weight  # all ones
    for p in model.parameters():
        p.grad = np.zeros_like(p.data)
    seen = []
    for _ in range(10):
        ln.grad[...] = -1024.0  # scaled by 1024: an unscaled gradient of -1 on every element
        assert not amp_step(model, amp, optimizer).skipped
        seen.append(float(ln.data[0]))
        assert np.all(np.float16(1.0) + np.float16(1e-4) == np.float16(1.0))  # the reason for masters
    assert seen[:4] == [1.0] * 4 and seen[-1] == float(np.float16(1.001))  # moved after ~5 steps
    assert abs(float(dict(amp.master_parameters())["transformer.ln_f.weight"].data[0]) - 1.001) < 1e-6


def test_an_inf_gradient_skips_the_step_and_halves_the_scale():
    model = GPT(CONFIG, seed=0, dtype="float16")
    amp = MixedPrecision(model, "float16", DynamicLossScaler())
    optimizer = AdamW(amp.master_parameters(), lr=1e-2)
    fp16_step(model, amp, optimizer, 0)
    before = {name: m.data.copy() for name, m in amp.master_parameters()}
    state = {k: {n: a.copy() for n, a in v.items()} for k, v in optimizer.state.items()}
    weights = [p.data.copy() for p in model.parameters()]
    for p in model.parameters():
        p.grad = np.zeros_like(p.data)
    model.transformer.h[0].mlp.c_fc.weight.grad[3, 1] = np.inf
    result = amp_step(model, amp, optimizer, 1.0)
    assert result.skipped and result.loss_scale == 2.0 ** 16 and amp.scaler.scale == 2.0 ** 15
    assert math.isnan(result.grad_norm) and optimizer.step_count == 1
    for name, m in amp.master_parameters():
        np.testing.assert_array_equal(m.data, before[name])
    for k, v in optimizer.state.items():
        for n, a in v.items():
            np.testing.assert_array_equal(a, state[k][n])
    for p, w in zip(model.parameters(), weights):
        np.testing.assert_array_equal(p.data, w)


def test_bfloat16_model_holds_bfloat16_values_after_every_step():
    model = GPT(CONFIG, seed=0, dtype="float32")
    amp = MixedPrecision(model, "bfloat16", DynamicLossScaler.static(1.0))
    optimizer = AdamW(amp.master_parameters(), lr=1e-2)
    for step in range(3):
        fp16_step(model, amp, optimizer, step)
        for p in model.parameters():
            assert (p.data.view(np.uint32) & 0xFFFF == 0).all()
    masters = dict(amp.master_parameters())
    assert any((m.data.view(np.uint32) & 0xFFFF != 0).any() for m in masters.values())  # masters keep all bits


def test_wrong_parameter_dtype_or_compute_dtype_is_refused():
    with pytest.raises(ValueError, match="float16"):
        MixedPrecision(GPT(CONFIG, seed=0, dtype="float32"), "float16", DynamicLossScaler())
    with pytest.raises(ValueError, match="compute dtype"):
        MixedPrecision(GPT(CONFIG, seed=0, dtype="float16"), "int8", DynamicLossScaler())


def test_master_parameters_carry_the_tensor_parallel_tag():
    model = GPT(CONFIG, seed=0, dtype="float16")
    model.transformer.h[0].attn.c_attn.weight.tensor_parallel = True
    masters = dict(MixedPrecision(model, "float16", DynamicLossScaler()).master_parameters())
    assert masters["transformer.h.0.attn.c_attn.weight"].tensor_parallel is True
    assert not getattr(masters["transformer.h.0.attn.c_proj.weight"], "tensor_parallel", False)


# ---- the autograd ops in float16 -------------------------------------------------------------------

def test_cross_entropy_of_float16_logits_is_float32_with_a_float16_gradient():
    rng = np.random.default_rng(0)
    logits64 = rng.normal(size=(6, 50)) * 3
    targets = rng.integers(0, 50, 6)
    x16 = Tensor(logits64.astype(np.float16), requires_grad=True)
    loss16 = cross_entropy(x16, targets)
    x64 = Tensor(logits64.astype(np.float16).astype(np.float64), requires_grad=True)
    loss64 = cross_entropy(x64, targets)
    assert loss16.data.dtype == np.float32
    assert abs(loss16.item() - loss64.item()) < 1e-6 * abs(loss64.item())  # float32 inside, not float16
    loss16.backward(np.full_like(loss16.data, 2.0 ** 16))  # the scaled seed is a float32 number
    loss64.backward(np.full_like(loss64.data, 2.0 ** 16))
    assert x16.grad.dtype == np.float16
    np.testing.assert_allclose(x16.grad, x64.grad, rtol=2 ** -10, atol=2 ** -14 * 2 ** 16 / 6)


def test_float16_linear_accumulates_in_float32():
    # 4096 products of 1 * 1: a float16 accumulator would get stuck at 2048 (spacing 2 there)
    x = Tensor(np.ones((2, 4096), np.float16), requires_grad=True)
    w = Tensor(np.ones((3, 4096), np.float16), requires_grad=True)
    y = linear(x, w)
    assert y.data.dtype == np.float16 and (y.data == 4096).all()
    y.backward(np.ones_like(y.data))
    assert x.grad.dtype == w.grad.dtype == np.float16
