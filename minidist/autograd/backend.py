"""Which array module (NumPy or CuPy) holds an array, the one op that differs between them, and fast sums.

Autograd code never imports CuPy itself: it asks the data (``get_array_module``, from
``minidist.device``), so the same code runs on NumPy and on CuPy arrays.
"""
import numpy as np

from minidist.device import get_array_module, is_cupy, to_numpy

__all__ = ["get_array_module", "is_cupy", "to_numpy", "matmul", "matmul_into", "sum_last", "sum_rows"]


def matmul(a, b):
    """``a @ b``; two float16 NumPy operands are multiplied the way GPU tensor cores do it: float16
    inputs, float32 accumulation, the product rounded to float16. (NumPy's own float16 matmul also
    accumulates in float32, but has no BLAS kernel: about 80x slower. This takes float32 BLAS.)"""
    if a.dtype == b.dtype == np.float16 and not is_cupy(a):
        return (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16)
    return a @ b


def matmul_into(a, b, out):
    """``out[...] = a @ b`` for ``out`` a view (a block of a larger array): NumPy's float32 and
    float64 products are written there by BLAS, no temporary; float16 and CuPy go through one."""
    if is_cupy(a) or a.dtype == np.float16 or out.dtype != np.result_type(a, b):
        out[...] = matmul(a, b)
    else:
        np.matmul(a, b, out=out)


def sum_last(x):
    """The sum over the last axis, kept as an axis of length 1: (..., n) -> (..., 1). Computed as
    ``x @ ones(n)``, a matrix-vector product: NumPy's own reduction over a short last axis (a row of
    LayerNorm, of the attention scores) loops row by row and takes about 7x longer."""
    ones = get_array_module(x).ones(x.shape[-1], dtype=x.dtype)
    return matmul(x, ones)[..., None]


def sum_rows(x):
    """The sum of the rows of a matrix: (N, n) -> (n,), as ``ones(N) @ x`` (bias and LayerNorm
    gradients; 2-3x faster than ``x.sum(axis=0)``)."""
    return matmul(get_array_module(x).ones(x.shape[0], dtype=x.dtype), x)
