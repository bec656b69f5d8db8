"""Where an array lives, host memory (NumPy) or a GPU (CuPy), and moving bytes between the two.

Library code never imports CuPy to ask: an array tells. ``get_array_module(a)`` is ``cupy`` only when
``a`` already is a CuPy array (so CuPy is installed and imported), else ``numpy``. Everything that
touches CuPy itself (streams, pinned memory, choosing the GPU) imports it inside the function, so
``import minidist`` works without CuPy.

A GPU runs kernels asynchronously, in stream order. Before anything outside that stream (MPI, another
thread) reads or writes a device buffer, :func:`synchronize` waits for the work queued on the current
stream; that is the rule the collectives follow.
"""
from __future__ import annotations

import contextlib

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


def data_pointer(a) -> int:
    """The address of ``a``'s first element (device memory for CuPy, host memory for NumPy)."""
    if is_cupy(a):
        return a.data.ptr
    return a.__array_interface__["data"][0]


def synchronize(a) -> None:
    """For a CuPy array: wait until the work queued on the current stream is done, so ``a`` may be
    read or written from outside the stream. Nothing for NumPy arrays."""
    if is_cupy(a):
        import cupy
        cupy.cuda.get_current_stream().synchronize()


def pinned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised host array of ``shape`` in page-locked ("pinned") memory: the GPU
    copies to and from it by DMA, without a bounce through pageable memory. CuPy's pinned-memory pool
    keeps freed blocks, so asking again for the same size is cheap."""
    import cupyx
    return cupyx.empty_pinned(shape, dtype=dtype)


def copy_to_host(device_array, host: np.ndarray) -> None:
    """Copy ``device_array`` into the host array ``host`` (same shape and dtype); returns once done."""
    device_array.get(out=host)


def copy_to_device(host: np.ndarray, device_array) -> None:
    """Copy the host array ``host`` into ``device_array`` (same shape and dtype); returns once done,
    so ``host`` may be reused at once."""
    device_array.set(host)
    synchronize(device_array)


def copy_array(src, dst) -> None:
    """``dst[...] = src`` for two arrays of the same size, wherever they live. On one GPU the copy
    is a kernel of that GPU (made current for it); between two GPUs it goes through host memory,
    which works whether or not the GPUs can reach each other's memory; host to GPU or back is
    refused, as CuPy refuses it."""
    if is_cupy(src) and is_cupy(dst) and src.device.id != dst.device.id:
        copy_to_device(to_numpy(src).reshape(dst.shape), dst)
        return
    with device_of(dst):
        dst[...] = src.reshape(dst.shape)


def device_of(a):
    """A context in which ``a``'s GPU is the current one (CuPy's ``with a.device:``); nothing for a
    NumPy array."""
    return a.device if is_cupy(a) else contextlib.nullcontext()


def gpu_count() -> int:
    """How many GPUs CuPy sees on this machine (0 when CuPy or the driver is missing)."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 -- no CuPy, no driver, no device: all mean "none"
        return 0


def require_cupy(what: str):
    """The ``cupy`` module, or an ImportError saying what needed it and how to get it."""
    try:
        import cupy
    except ImportError as e:
        raise ImportError(f"{what} needs CuPy and an NVIDIA GPU: pip install -e \".[gpu]\" "
                          f"(cupy-cuda12x) on a machine with a CUDA driver") from e
    if gpu_count() == 0:
        raise RuntimeError(f"{what} needs an NVIDIA GPU, and CuPy sees none on this machine")
    return cupy


DEVICES = ("cpu", "cuda")
"""Where a model and its batches live: ``"cpu"`` (NumPy arrays) or ``"cuda"`` (CuPy arrays)."""


def to_device(a, device: str):
    """``a`` in the memory of ``device``: for ``"cpu"`` a NumPy array (copied off the GPU if it is a
    CuPy array), for ``"cuda"`` a CuPy array on the current GPU (copied from the host if it is not
    one already). An array already in the right place is returned as it is."""
    if device == "cpu":
        return to_numpy(a)
    if device == "cuda":
        if is_cupy(a):
            return a
        try:  # once per batch: no driver query here (the trainer checked for a GPU at start)
            import cupy
        except ImportError:
            cupy = require_cupy("device 'cuda'")  # raises, saying how to get CuPy
        return cupy.asarray(a)
    raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")


def use_gpu(local_rank: int) -> int:
    """Make GPU ``local_rank % gpu_count()`` the current device of this thread (the ranks of one
    machine spread over its GPUs, several per GPU when there are more ranks than GPUs); returns its
    index. Call it before any CuPy array is made: arrays live on the device current at creation."""
    cupy = require_cupy("choosing a GPU")
    device = local_rank % gpu_count()
    cupy.cuda.Device(device).use()
    return device
