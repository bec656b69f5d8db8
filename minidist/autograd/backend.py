"""Which array module (NumPy or CuPy) holds an array, and the one op that differs between them.

Autograd code never imports CuPy itself: it asks the data (``get_array_module``, from
``minidist.device``), so the same code runs on NumPy and on CuPy arrays.
"""
import numpy as np

from minidist.device import get_array_module, is_cupy, to_numpy

__all__ = ["get_array_module", "is_cupy", "to_numpy", "matmul"]


def matmul(a, b):
    """``a @ b``; two float16 NumPy operands are multiplied the way GPU tensor cores do it: float16
    inputs, float32 accumulation, the product rounded to float16. (NumPy's own float16 matmul also
    accumulates in float32, but has no BLAS kernel: about 80x slower. This takes float32 BLAS.)"""
    if a.dtype == b.dtype == np.float16 and not is_cupy(a):
        return (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16)
    return a @ b
