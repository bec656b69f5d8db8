"""bfloat16 on NumPy, by emulation: float32 values rounded to the nearest bfloat16.

bfloat16 is the upper half of a float32: 1 sign bit, the same 8 exponent bits (same range, so no
loss scaling is needed), and 7 of the 23 mantissa bits. NumPy has no bfloat16 dtype and no bfloat16
arithmetic, so minidist stores bfloat16 VALUES in float32 arrays: every element has its low 16 bits
zero. What is emulated (see master_weights.py): the model's weights are bfloat16 values (rounded
from the float32 masters after every update) and the gradients are rounded to bfloat16 when they are
read into the masters. Activations and all arithmetic stay float32, and the bytes on the wire stay
float32's: only float16 halves them here.

Rounding is IEEE round-to-nearest, ties to even, done on the bits:

    float32 bits  s eeeeeeee mmmmmmm|mmmmmmmmmmmmmmmm       keep the upper 16 bits;
                                    ^ the cut              the lower 16 decide the rounding
    add 0x7FFF + (lowest kept bit) and clear the lower 16 bits:
      lower half  < 0x8000 -> unchanged upper half (round down)
      lower half  > 0x8000 -> carry into the upper half (round up; may carry into the exponent,
                             and the largest finite values round up to infinity, as they should)
      lower half == 0x8000 -> a tie: rounds up only if the kept part is odd (to even)
NaN is kept a (quiet) NaN: its carry could otherwise turn it into infinity.
"""
import numpy as np

from minidist.device import get_array_module


def round_to_bfloat16(x) -> np.ndarray:
    """A float32 array of ``x`` rounded to the nearest bfloat16 value (ties to even); NaN stays NaN.
    A CuPy array is rounded on the GPU (the result is a CuPy array)."""
    xp = get_array_module(x)
    x = xp.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) & np.uint32(0xFFFF0000)
    rounded = xp.where(xp.isnan(x), (bits | np.uint32(0x00400000)) & np.uint32(0xFFFF0000), rounded)
    return rounded.astype(np.uint32).view(np.float32).reshape(x.shape)
