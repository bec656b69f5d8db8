"""A stand-in for CuPy on machines without a GPU, so the device code paths run in a plain pytest run.

Its "device" arrays live in host memory, but they behave like CuPy's where it matters to our code:

- they refuse to mix with NumPy arrays: a ufunc, a NumPy function or an assignment that combines a
  device array with a host array raises ``TypeError``, as CuPy does ("Unsupported type ..."), so a
  host buffer that leaks into device code fails here as it would on a GPU;
- they have no ``__array_interface__`` and no buffer an MPI library could read: code must stage them
  through host memory (``get``/``set``) or hand ``__cuda_array_interface__`` to a CUDA-aware MPI;
- creation functions (``cupy.zeros``, ``cupy.asarray``, ...) return device arrays; ``.get()`` and
  ``cupy.asnumpy`` return host copies.

The arithmetic is NumPy's, so a computation on device arrays must equal the same one on NumPy arrays
bit for bit: that is what the tests using this double assert. ``install()`` puts the double in
``sys.modules`` as ``cupy``/``cupyx`` (with ``cupy.cuda`` and, when given, ``cupy.cuda.nccl``);
``uninstall()`` takes it out. A real CuPy imported before is put back by ``uninstall()``.
"""
from __future__ import annotations

import collections
import sys
import threading
import time
import types

import numpy as np

_MODULES = ("cupy", "cupy.cuda", "cupy.cuda.nccl", "cupyx")

TRANSFERS = collections.Counter()
"""Copies between host and "device" so far: ``TRANSFERS["to_host"]``, ``TRANSFERS["to_device"]``."""


class ndarray(np.ndarray):  # noqa: N801 -- CuPy's name
    """A pretend device array: NumPy storage, CuPy's refusal to mix with host arrays."""

    def __array_finalize__(self, obj):
        """A new array lives on the current device of the thread that made it; a view, on its base's."""
        self._device_id = getattr(obj, "_device_id", None)
        if self._device_id is None:
            self._device_id = _current_device()

    @property
    def device(self):
        return _Device(self._device_id)

    def get(self, stream=None, order="C", out=None, blocking=True):
        """A host copy (into ``out``, of the same shape, when given), like ``cupy.ndarray.get``."""
        host = self.view(np.ndarray)
        TRANSFERS["to_host"] += 1
        if out is None:
            return host.copy()
        if out.shape != self.shape:  # CuPy checks this too
            raise ValueError(f"Shape mismatch: out has shape {out.shape}, the array {self.shape}")
        _host_view(out)[...] = host
        return out

    def set(self, arr, stream=None):
        """Copy the host array ``arr`` (of the same shape) in, like ``cupy.ndarray.set``."""
        if isinstance(arr, ndarray):
            raise TypeError("set() takes a host (NumPy) array")
        if arr.shape != self.shape:  # CuPy checks this too
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        TRANSFERS["to_device"] += 1
        self.view(np.ndarray)[...] = arr

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.view(np.ndarray).__array_interface__["data"][0])

    @property
    def __array_interface__(self):
        raise AttributeError("a device array has no host __array_interface__")

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.data.ptr, False), "version": 3}

    def __setitem__(self, key, value):
        _refuse_host((value,))
        _refuse_other_device((self, value))
        super().__setitem__(key, _unwrap(value))

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        _refuse_host(inputs + (out or ()))
        _refuse_other_device(inputs + (out or ()))
        args = [_unwrap(a) for a in inputs]
        if out is not None:
            kwargs["out"] = tuple(_unwrap(o) for o in out)
        result = getattr(ufunc, method)(*args, **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _wrap(result)

    def __array_function__(self, func, types_, args, kwargs):
        _refuse_host(_flatten(args) + _flatten(tuple(kwargs.values())))
        _refuse_other_device(_flatten(args) + _flatten(tuple(kwargs.values())))
        return _wrap_result(func(*_unwrap_tree(args), **{k: _unwrap_tree(v) for k, v in kwargs.items()}))

    def __reduce__(self):
        raise TypeError("a device array cannot be pickled; copy it to the host first")


ndarray.__module__ = "cupy"  # what minidist.device.is_cupy looks at


def _is_host_array(a) -> bool:
    return type(a) is np.ndarray


def _refuse_host(values) -> None:
    for v in values:
        if _is_host_array(v):
            raise TypeError(f"Unsupported type {type(v)}: a NumPy (host) array mixed with a device array")


def _refuse_other_device(values) -> None:
    """A kernel runs on the current device; like CuPy, refuse arrays that live on another one."""
    current = _current_device()
    for v in values:
        if isinstance(v, ndarray) and v._device_id != current:
            raise ValueError(f"Array device must be same as the current device: array device = "
                             f"{v._device_id} while current = {current}")


def _flatten(values) -> tuple:
    flat = []
    for v in values:
        if isinstance(v, (list, tuple)):
            flat.extend(_flatten(v))
        else:
            flat.append(v)
    return tuple(flat)


def _unwrap(a):
    return a.view(np.ndarray) if isinstance(a, ndarray) else a


def _unwrap_tree(a):
    if isinstance(a, (list, tuple)):
        return type(a)(_unwrap_tree(v) for v in a)
    return _unwrap(a)


def _wrap(a):
    if type(a) is np.ndarray:
        return a.view(ndarray)
    return a


def _wrap_result(result):
    """A function's result on the device: an array, or each array of a returned tuple or list
    (``split``, ``nonzero``, ...), as CuPy returns them."""
    if isinstance(result, tuple):
        return tuple(_wrap(r) for r in result)
    if isinstance(result, list):
        return [_wrap(r) for r in result]
    return _wrap(result)


def _host_view(a):
    if isinstance(a, ndarray):
        raise TypeError("expected a host array")
    return a


# ---- the module ------------------------------------------------------------------------------------

def asarray(a, dtype=None):
    """To the pretend device (a copy for host input, as CuPy's asarray makes)."""
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    return np.array(a, dtype=dtype, copy=True).view(ndarray)


def array(a, dtype=None, copy=True):
    return asarray(a, dtype) if not isinstance(a, ndarray) or not copy else a.astype(dtype or a.dtype)


def asnumpy(a, stream=None, out=None):
    return a.get(out=out) if isinstance(a, ndarray) else np.asarray(a)


def get_array_module(*args):
    return sys.modules["cupy"] if any(isinstance(a, ndarray) for a in args) else np


def _creation(name):
    numpy_fn = getattr(np, name)

    def make(*args, **kwargs):
        return _wrap_result(numpy_fn(*_unwrap_tree(args), **kwargs))
    make.__name__ = name
    return make


class _Stream:
    """``cupy.cuda.Stream``: this double's kernels run at once, but a fake library (``fake_nccl``)
    may queue work that finishes later (see :func:`enqueue`); ``synchronize`` waits for it, as a real
    stream does, without a deadline."""

    null = None
    ptr = 0

    def __init__(self, null=False, non_blocking=False, priority=0):
        pass

    def wait_event(self, event):
        """Later work on this stream waits for ``event``: here, the work it recorded is waited for now."""
        event.synchronize()

    def synchronize(self):
        _wait_for(_pending())

    def record(self, event=None):
        event = event if event is not None else _Event()
        event.record(self)
        return event

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event:
    """``cupy.cuda.Event``: ``done`` (cudaEventQuery) is True once the work queued on the stream
    before ``record`` has finished."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self._work = []

    @property
    def done(self):
        return all(w.done for w in self._work)

    def synchronize(self):
        _wait_for(self._work)

    def record(self, stream=None):
        self._work = list(_pending())


_thread = threading.local()  # per host thread, as in CUDA: the current device and the queued work


def _pending() -> list:
    """The work queued on this thread's stream and not yet seen done."""
    if not hasattr(_thread, "pending"):
        _thread.pending = []
    _thread.pending = [w for w in _thread.pending if not w.done]
    return _thread.pending


def enqueue(work) -> None:
    """Queue ``work`` (anything with a ``done`` attribute) on this thread's current stream: what a
    real library's asynchronous launch does. Events recorded after it are done only once it is. For
    other doubles (``fake_nccl``); not CuPy API."""
    _pending().append(work)


def _wait_for(work) -> None:
    while not all(w.done for w in work):
        time.sleep(0.001)


class _Device:
    """``cupy.cuda.Device(i)``; ``Device()`` is this thread's current device. ``use()`` makes it
    current for this thread; ``with Device(i):`` does so until the block ends."""

    def __init__(self, device_id=None):
        self.id = _current_device() if device_id is None else device_id

    def use(self):
        _thread.device = self.id

    def __enter__(self):
        self._previous = _current_device()
        self.use()
        return self

    def __exit__(self, *exc):
        _thread.device = self._previous
        return False


def _current_device() -> int:
    return getattr(_thread, "device", 0)


def _make_cuda(device_count: int, nccl) -> types.ModuleType:
    cuda = types.ModuleType("cupy.cuda")
    cuda.Stream, cuda.Event, cuda.Device = _Stream, _Event, _Device
    cuda.get_current_stream = lambda: _Stream()
    cuda.runtime = types.SimpleNamespace(getDeviceCount=lambda: device_count, getDevice=_current_device,
                                         getDeviceProperties=lambda i: {"name": b"fake GPU (host memory)"})
    if nccl is not None:
        cuda.nccl = nccl
    return cuda


def _make_cupy(device_count: int, nccl) -> types.ModuleType:
    cupy = types.ModuleType("cupy")
    cupy.__doc__ = "A stand-in for CuPy (tests/doubles/fake_cupy.py): host memory, CuPy's rules."
    cupy.ndarray, cupy.asarray, cupy.array, cupy.asnumpy = ndarray, asarray, array, asnumpy
    cupy.get_array_module = get_array_module
    cupy.cuda = _make_cuda(device_count, nccl)
    cupy.is_fake = True
    for name in ("empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like", "ones_like",
                 "full_like", "eye", "linspace", "tri", "triu", "tril"):
        setattr(cupy, name, _creation(name))

    def __getattr__(name):  # everything else: NumPy's, which device arrays dispatch back to us
        value = getattr(np, name)
        if callable(value) and not isinstance(value, (type, np.ufunc)):
            return _creation(name)
        return value
    cupy.__getattr__ = __getattr__
    return cupy


_saved: dict = {}


def install(device_count: int = 8, nccl=None) -> types.ModuleType:
    """Put the double in ``sys.modules`` as ``cupy`` (and ``cupyx``, ``cupy.cuda``, and
    ``cupy.cuda.nccl`` when ``nccl`` is given); returns the fake ``cupy``. A real CuPy already
    imported (on a GPU machine) is set aside and comes back with :func:`uninstall`; code that imports
    ``cupy`` in between gets the double."""
    if not _saved:
        _saved.update({name: sys.modules.get(name) for name in _MODULES})
    cupy = _make_cupy(device_count, nccl)
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = lambda shape, dtype=np.float64: np.empty(shape, dtype)
    sys.modules.update({"cupy": cupy, "cupy.cuda": cupy.cuda, "cupyx": cupyx})
    if nccl is not None:
        sys.modules["cupy.cuda.nccl"] = nccl
    else:
        sys.modules.pop("cupy.cuda.nccl", None)
    return cupy


def uninstall() -> None:
    """Take the double out of ``sys.modules`` and put back whatever was there before."""
    for name, module in _saved.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module
    _saved.clear()
