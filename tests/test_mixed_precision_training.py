"""Mixed precision with data parallelism (dp = 2 ranks as threads): float16 gradients cross the wire
(half the bytes of float32, measured from the trace), an overflow on one rank skips the step on
every rank, and the float16 loss curve tracks float32's."""
import math
from types import SimpleNamespace

import numpy as np
import pytest

from minidist import run_local
from minidist.amp import DynamicLossScaler, MixedPrecision
from minidist.data import ByteTokenizer, get_batch, grammar_text, inputs_and_targets
from minidist.model import GPT, GPTConfig
from minidist.optim import AdamW, clip_grad_norm, lr_at
from minidist.parallel.data.data_parallel import DataParallel
from minidist.parallel.data.sampler import dp_rows
from minidist.parallel.compose.gradients import WholeGradients, apply_gradients

MODEL = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)  # train.py's default
# NumPy float16 arithmetic is scalar code (~50x slower than float32), so the 150-step curves use a
# narrower model; benchmarks/mixed_precision.py measures the same gap on MODEL.
CURVE_MODEL = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32)
B, STEPS = 16, 150
TOKENS = ByteTokenizer().encode(grammar_text(200_000))

def amp_step(model, amp, optimizer, max_norm=math.inf):
    """The gradient pipeline on whole tensors (gradients.py) with ``amp``'s masters: (skipped, grad
    norm (NaN when skipped), the loss scale the step used)."""
    scale = amp.scaler.scale
    norm = apply_gradients(WholeGradients(model, optimizer, amp=amp), optimizer.lr, max_norm, amp.scaler)
    return SimpleNamespace(skipped=norm is None, grad_norm=math.nan if norm is None else norm, loss_scale=scale)



def train_dp2(dtype, steps, inject_inf_at=None, growth_interval=2000, config=MODEL):
    """``steps`` AdamW steps (train.py's schedule and clipping) of MODEL on dp = 2 ranks in
    ``dtype`` ("float32": no mixed precision). Per rank: losses, loss scales, skipped flags, the
    bytes of each step's data-parallel all-reduces, and the final weights as float32.
    ``inject_inf_at``: at that step rank 1 alone (after the all-reduce) finds an inf in a gradient."""
    def fn(group):
        model = GPT(config, seed=0, dtype="float16" if dtype == "float16" else "float32")
        dp = DataParallel(model, group)
        amp = None
        if dtype != "float32":
            scaler = DynamicLossScaler(growth_interval=growth_interval, group=group) if dtype == "float16" \
                else DynamicLossScaler.static(1.0, group=group)
            amp = MixedPrecision(model, dtype, scaler)
        optimizer = AdamW(amp.master_parameters() if amp else model.named_parameters(), lr=3e-3,
                          betas=(0.9, 0.95), weight_decay=0.1)
        out = {"loss": [], "scale": [], "skipped": [], "dp_bytes": []}
        for step in range(steps):
            idx, targets = inputs_and_targets(get_batch(TOKENS, step, B, config.block_size, 0)
                                              [dp_rows(B, group.rank, group.size)])  # (B/2, T) each
            group.trace.clear()
            dp.zero_grad()
            _, loss = model(idx, targets)
            amp.backward(loss) if amp else loss.backward(np.ones_like(loss.data))
            dp.finish()
            out["dp_bytes"].append(sum(e.nbytes for e in group.trace.events if e.op == "all_reduce"))
            if step == inject_inf_at and group.rank == 1:
                model.transformer.h[1].mlp.c_proj.weight.grad[0, 0] = np.inf
            optimizer.lr = lr_at(step, 3e-3, 20, steps, 3e-4)
            if amp:
                result = amp_step(model, amp, optimizer, 1.0)
                out["scale"].append(result.loss_scale)
                out["skipped"].append(result.skipped)
            else:
                clip_grad_norm(model.parameters(), 1.0)
                optimizer.step()
            out["loss"].append(loss.item())
        out["weights"] = {name: p.data.astype(np.float32) for name, p in model.named_parameters()}
        return out

    return run_local(fn, world_size=2, timeout=600.0)


def test_float16_gradients_cross_the_wire_in_half_the_bytes():
    fp32, fp16 = train_dp2("float32", 1)[0], train_dp2("float16", 1)[0]
    n_params = sum(p.data.size for p in GPT(MODEL, seed=0).parameters())
    assert fp32["dp_bytes"] == [4 * n_params] and fp16["dp_bytes"] == [2 * n_params]


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    ranks = train_dp2("float16", 3, inject_inf_at=1)
    for r in ranks:
        assert r["skipped"] == [False, True, False]
        assert r["scale"] == [2.0 ** 16, 2.0 ** 16, 2.0 ** 15]
    for name, w in ranks[0]["weights"].items():  # no rank updated alone: the replicas still agree
        np.testing.assert_array_equal(w, ranks[1]["weights"][name])


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_the_scale_grows_after_a_clean_window_and_backs_off_when_it_overflows():
    # Window of 2: after 2 clean steps the scale tries 2**17, after 2 more 2**18, where this model's
    # float16 gradients overflow: that step is skipped on both ranks and the scale halves, then grows
    # again after its next clean window. (The all-reduce's sum does not overflow first: a float16
    # average divides before it sums.)
    for r in train_dp2("float16", 8, growth_interval=2):
        assert r["scale"] == [2.0 ** 16, 2.0 ** 16, 2.0 ** 17, 2.0 ** 17, 2.0 ** 18, 2.0 ** 17, 2.0 ** 17, 2.0 ** 18]
        assert r["skipped"] == [False, False, False, False, True, False, False, True]


@pytest.fixture(scope="module")
def float32_curve():
    ranks = train_dp2("float32", STEPS, config=CURVE_MODEL)
    return np.mean([r["loss"] for r in ranks], axis=0)


# Measured (CURVE_MODEL, 150 steps, dp 2, AdamW; the loss falls from 5.55 to 2.12): float16 max gap
# 0.038 nats, at step 39, right after its one skipped step (38: the scale backed off from 2**16),
# i.e. one step of progress in the steep phase, where the loss falls by up to ~0.05 a step; mean gap
# over the last 50 steps 0.008. bfloat16: max gap 0.006. (Default MODEL, benchmarks/mixed_precision.py:
# float16 0.024, bfloat16 0.016.) Stated tolerances: one steep step for the max, a third of that late.
GAP = {"float16": 0.06, "bfloat16": 0.03}
LATE_GAP = 0.02


@pytest.mark.slow  # 3 x 150 steps (27 s): the default suite's 16-bit runs are tests/test_train_amp.py's
@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_16_bit_loss_curve_tracks_float32(dtype, float32_curve):
    ranks = train_dp2(dtype, STEPS, config=CURVE_MODEL)
    curve = np.mean([r["loss"] for r in ranks], axis=0)
    gap = np.abs(curve - float32_curve)
    print(f"{dtype}: max gap {gap.max():.4f}, final loss {curve[-1]:.4f} vs float32 {float32_curve[-1]:.4f}, "
          f"skipped {sum(ranks[0]['skipped'])}, final scale {ranks[0]['scale'][-1]}")
    assert float32_curve[-1] < float32_curve[0] - 3.0  # it did learn, so tracking means something
    assert gap.max() < GAP[dtype]
    assert gap[-50:].mean() < LATE_GAP
