"""Mixed precision: the model computes in a 16-bit dtype, the optimizer keeps float32 master weights,
and a loss scaler keeps float16 gradients out of the underflow zone. Read loss_scaler.py, then
master_weights.py; bfloat16.py is the rounding that emulates bfloat16 storage on NumPy.

    model = GPT(config, seed, dtype="float16")               # compute dtype
    dp = DataParallel(model, dp_group)                      # float16 buckets: half the bytes
    amp = MixedPrecision(model, "float16", DynamicLossScaler(group=world))
    opt = AdamW(amp.master_parameters(), lr=3e-3)           # state and masters in float32
    dp.zero_grad(); amp.backward(loss)
    apply_gradients(WholeGradients(model, opt, dp, amp), lr, 1.0, amp.scaler)  # None: skipped on overflow
                                                            # (minidist/parallel/compose/gradients.py)
"""
from minidist.amp.bfloat16 import round_to_bfloat16
from minidist.amp.loss_scaler import DynamicLossScaler
from minidist.amp.master_weights import COMPUTE_DTYPES, MixedPrecision, to_compute, unscale

__all__ = ["round_to_bfloat16", "DynamicLossScaler", "MixedPrecision", "COMPUTE_DTYPES", "to_compute",
           "unscale"]
