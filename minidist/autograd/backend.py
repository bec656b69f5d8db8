"""Which array module (NumPy or CuPy) holds an array.

Autograd code never imports CuPy itself: it asks the data. ``get_array_module(a)`` returns ``cupy``
only when ``a`` already is a CuPy array (so CuPy is installed and imported); otherwise ``numpy``.
"""
import numpy as np


def is_cupy(a) -> bool:
    """True when ``a`` is a CuPy array (checked by its type's module, without importing CuPy)."""
    return type(a).__module__.startswith("cupy")


def get_array_module(a):
    """The module of ``a``'s array type: ``cupy`` for CuPy arrays, ``numpy`` for everything else."""
    if is_cupy(a):
        import cupy
        return cupy
    return np


def to_numpy(a) -> np.ndarray:
    """``a`` as a NumPy array: copied from the GPU for CuPy, returned as is when already NumPy."""
    if is_cupy(a):
        return a.get()
    return np.asarray(a)


def matmul(a, b):
    """``a @ b``; two float16 NumPy operands are multiplied the way GPU tensor cores do it: float16
    inputs, float32 accumulation, the product rounded to float16. (NumPy's own float16 matmul also
    accumulates in float32, but has no BLAS kernel: about 80x slower. This takes float32 BLAS.)"""
    if a.dtype == b.dtype == np.float16 and not is_cupy(a):
        return (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16)
    return a @ b
