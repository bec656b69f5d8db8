"""Keep freed memory for the next step: the process-wide allocator setting the trainer starts with.

A training step allocates the same arrays every time: activations, gradients, temporaries, most
of them between 100 KiB and a few MiB. glibc's malloc hands blocks that large straight to the
kernel (``mmap``) and returns them on ``free``. The next step then maps the pages again, and the
kernel zero-fills each 4 KiB page on its first touch: one page fault per page, every step. Two
``mallopt`` settings make glibc keep the memory instead:

- ``M_MMAP_THRESHOLD`` at 32 MiB, glibc's ceiling: blocks up to that size come from the heap;
- ``M_TRIM_THRESHOLD`` at 1 GiB: the heap's freed top is not given back to the kernel.

Each step then reuses the previous step's memory, already mapped. The resident size stays at the
step's peak, which is where it was anyway, and it stays flat. Measured in benchmarks/RESULTS.md
("Training step"): about 1.5x faster steps at minidist's default size on one CPU thread. PyTorch's
CPU performance guide gets the same effect by preloading jemalloc or tcmalloc.

This is a setting of the whole process, so library code never makes it. The entry points call
:func:`keep_freed_memory`: ``python -m minidist.train`` (unless ``--system-allocator``) and the
benchmarks. Elsewhere, and on a C library that is not glibc, it changes nothing.
"""
import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers, from glibc's malloc.h
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to serve blocks up to 32 MiB from its heap and to keep the freed heap
    mapped. Returns True if both settings took, False where there is no glibc (macOS, musl)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
