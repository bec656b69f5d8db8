"""ZeRO-Offload and ZeRO-Infinity: ZeRO's shards kept off the device, and the step run where they live.

ZeRO (zero/optimizer.py) cuts the model states over the dp ranks, but each rank still keeps its shards in
device memory. The largest is the optimizer's (mixed-precision AdamW: float32 masters and two
moments, 12 of the 16 bytes per parameter), and it is touched once per step by an element-wise
update that needs no GPU. ZeRO-Offload (Ren et al., 2021) keeps it in host memory and runs the
update there; ZeRO-Infinity (Rajbhandari et al., 2021) goes on to the disk, and under ZeRO-3 moves
the parameter shards too. Per rank, with N dp ranks and P, G, O as in zero/optimizer.py:

    --offload                 device                 host                    disk (--offload-dir DIR)
    optimizer                 P, G as the stage says O/N, gradient shard     -
      with --offload-dir      P, G                   gradient shard          O/N
    optimizer,params (ZeRO-3) units while in use, G  O/N, P/N, gradient      - (or O/N, P/N with DIR)

Without mixed precision the master IS the parameter shard, so the host keeps a copy of it (P/N)
beside O/N; with it the masters are part of O (K = 12 for Adam).

What moves in one step (zero/optimizer.py calls this class; the bytes are counted in :attr:`Offload.moved`):

    down    each reduced gradient shard, device -> host, once it is final (during backward
            under ZeRO-2/3, where nothing else adds to it)                     G/N, the model's dtype
    step    per unit, in order: the next unit's files are read ahead (disk), the master and moments
            are updated on the host, the new parameter shard goes
    up      host -> device (P/N, the model's dtype), then the unit's files are written back and
            leave this process's memory
    ZeRO-3 parameters offloaded: a unit's parameter shard goes up before each all-gather (read
            ahead from disk two module calls before its use); the step writes the new shard where
            it lives, on the host, and nothing goes up then

On a GPU the device is CuPy's and the host is NumPy in pinned memory; the copies run on a side
stream, so a gradient shard's download overlaps the rest of backward. On the CPU the same code runs
with both sides in host memory: the copies happen and their bytes are counted, as what would cross
PCIe. The disk is one memory-mapped file per array under ``DIR/rank<r>/``: the kernel reads a
unit's files ahead of use (``madvise(WILLNEED)``) and, once the unit is written back (``msync``),
drops its pages from the process (``madvise(DONTNEED)``), so at most a unit or two of the offloaded
state is resident at once. The kernel's page cache may keep the pages afterwards, outside the
process, as it does for any file.
"""
from __future__ import annotations

import mmap
from collections import Counter
from pathlib import Path

import numpy as np

from minidist.device import is_cupy, pinned_empty, to_numpy
from minidist.files import create, real_folder, reserve

CHOICES = ("none", "optimizer", "optimizer,params")


class HostMemory:
    """Offloaded arrays in host memory (pinned when a GPU copies them)."""
    where = "host"

    def __init__(self, pinned: bool = False):
        self.pinned = pinned

    def array(self, name: str, n: int, dtype) -> np.ndarray:
        """A zeroed host array (n,)."""
        a = pinned_empty((n,), dtype) if self.pinned else np.empty(n, dtype)
        a[...] = 0
        return a

    def read_ahead(self, arrays) -> None:
        """Nothing to do: host memory is already there."""

    def write_back(self, arrays, changed: bool = True) -> None:
        """Nothing to do: the arrays are their own truth."""

    def close(self) -> None:
        """Nothing to remove."""


def rank_folder(directory, rank: int) -> Path:
    """The folder of ``rank``'s files under ``--offload-dir`` ``directory``."""
    return Path(directory) / f"rank{rank}"


class DiskFiles:
    """Offloaded arrays as memory-mapped files under ``directory/rank<rank>/``, one per array."""
    where = "disk"

    def __init__(self, directory, rank: int):
        self.folder = real_folder(rank_folder(directory, rank))  # a link there is refused, not followed
        self._maps = {}  # id(array) -> (its mmap, its file)

    def array(self, name: str, n: int, dtype) -> np.ndarray:
        """A zero-filled file of n elements, mapped: writing the array writes the file. The file is
        created without following a link planted at its name, and its disk space is reserved before
        it is mapped (a full disk: an OSError naming the file, here, not a SIGBUS at a later store)."""
        nbytes = n * np.dtype(dtype).itemsize
        if nbytes == 0:
            return np.zeros(0, dtype)  # (an empty file cannot be mapped)
        path = self.folder / f"{name}.bin"
        with create(path, readable=True) as f:
            reserve(f, nbytes, path)
            mapping = mmap.mmap(f.fileno(), nbytes)
        a = np.frombuffer(mapping, dtype=dtype)  # (n,) writable: the mapping is
        self._maps[id(a)] = (mapping, path)
        return a

    def _mapped(self, arrays):
        return [self._maps[id(a)][0] for a in arrays if id(a) in self._maps]

    def read_ahead(self, arrays) -> None:
        """Ask the kernel to read the arrays' files in now, in the background, before their use."""
        for mapping in self._mapped(arrays):
            mapping.madvise(mmap.MADV_WILLNEED)

    def write_back(self, arrays, changed: bool = True) -> None:
        """Write the arrays' pages to their files (``changed``) and drop them from this process's
        memory: the next use reads them in again."""
        for mapping in self._mapped(arrays):
            if changed:
                mapping.flush()
            mapping.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Remove the files (the arrays stay usable until dropped: an unlinked file stays mapped)."""
        for _, path in self._maps.values():
            path.unlink(missing_ok=True)
        self._maps.clear()
        if self.folder.is_dir() and not any(self.folder.iterdir()):
            self.folder.rmdir()  # (a run's trainer keeps its lock file there: the folder stays, empty but for it)


class Offload:
    """Where a ZeroOptimizer's offloaded shards live, and the copies that move them.

    ``what``: "optimizer" (masters and moments) or "optimizer,params" (with ZeRO-3, the parameter
    shards too). ``directory``: keep them in files there (ZeRO-Infinity), else in host memory.
    ``rank`` names this rank's folder; ``gpu``: the model lives on a GPU (pinned host buffers, a
    side stream). :attr:`moved` counts the bytes: "down" and "up" between device and host, "read"
    and "write" between host and disk."""

    def __init__(self, what: str = "optimizer", directory=None, rank: int = 0, gpu: bool = False):
        if what not in CHOICES[1:]:
            raise ValueError(f"offload must be one of {CHOICES[1:]}, got {what!r}")
        self.params = what == "optimizer,params"
        self.host = HostMemory(pinned=gpu)  # the gradient shards: always on the host
        self.store = DiskFiles(directory, rank) if directory is not None else self.host
        self.moved = Counter()
        self._side = None  # the GPU's copy stream, made at first use

    @property
    def where(self) -> str:
        return self.store.where

    def _stream(self):
        if self._side is None:
            import cupy
            self._side = cupy.cuda.Stream(non_blocking=True)
        return self._side

    def place(self, name: str, master, compute, slots, mixed_precision) -> tuple:
        """Move one ZeRO shard's optimizer state into the store (and with :attr:`params` its parameter
        shard): returns (master, compute, {slot: zeroed array}, the stored arrays, a host buffer for
        the gradient shard). ``master`` and ``compute`` are the device's (hi - lo,) arrays; without
        mixed precision they are one array, and so are the stored master and parameter shard when
        both move."""
        def keep(suffix, values):  # a store array holding the device array's values
            a = self.store.array(f"{name}.{suffix}", values.size, values.dtype)
            a[...] = to_numpy(values)
            return a
        if self.params:
            compute = keep("compute", compute)
        master = compute if self.params and not mixed_precision else keep("master", master)
        state = {slot: self.store.array(f"{name}.{slot}", master.size, master.dtype) for slot in slots}
        stored = list({id(a): a for a in [master, *state.values()] + [compute] * self.params}.values())
        self.store.write_back(stored)  # initialised: to disk, out of memory (not counted: no step yet)
        return master, compute, state, stored, self.host.array(f"{name}.grad", compute.size, compute.dtype)

    def down(self, device_array, host_array) -> None:
        """Copy a device array into its host buffer (same shape and dtype). On a GPU the copy is queued
        on the side stream after the work already queued: :meth:`wait` before reading the host array."""
        if is_cupy(device_array):
            import cupy
            side = self._stream()
            side.wait_event(cupy.cuda.get_current_stream().record())
            device_array.get(out=host_array, stream=side, blocking=False)
        else:
            np.copyto(host_array, device_array)
        self.moved["down"] += device_array.nbytes

    def up(self, host_array, device_array) -> None:
        """Copy a host array into a device array (same size). On a GPU the current stream waits for
        the copy, so kernels and collectives queued after see the new values."""
        if is_cupy(device_array):
            import cupy
            side = self._stream()
            device_array.set(host_array.reshape(device_array.shape), stream=side)
            cupy.cuda.get_current_stream().wait_event(side.record())
        else:
            device_array[...] = host_array
        self.moved["up"] += host_array.nbytes

    def to_update(self, shards) -> list:
        """Each shard's reduced gradient in its host buffer, where the update runs: copied down now
        unless :meth:`reduced` already did (then waited for)."""
        for s in shards:
            if s.downloaded is not s.grad:
                self.down(s.grad, s.host_grad)
            s.downloaded = None
        self.wait()
        return [s.host_grad for s in shards]

    def reduced(self, s) -> None:
        """The shard's gradient is reduced: unless it is completed later (summed over tp, or with a
        tied copy), it is final, so its copy down starts now, during backward."""
        if not s.completed_later:
            self.down(s.grad, s.host_grad)
            s.downloaded = s.grad

    def visit(self, shards):
        """The shards in order, for their update: each unit's stored state read (and the next one's
        read ahead: the disk starts on it) before, written back (to disk, out of memory) after."""
        if shards:
            self.read_ahead(shards[0].stored)
        for i, s in enumerate(shards):
            self.read(s.stored)
            self.read_ahead(shards[i + 1].stored if i + 1 < len(shards) else [])
            yield s
            self.write_back(s.stored)

    def publish(self, value, compute) -> None:
        """The new parameter shard ``value`` where the model reads it: up to the device (waited for:
        an all-gather reads it next), or, with the parameter shards offloaded, into the store."""
        if value is compute:
            return
        if self.params:
            compute[...] = value
        else:
            self.up(value, compute)
            self.wait()

    def begin_step(self) -> None:
        """From here on :attr:`moved` counts this step's bytes."""
        self.moved.clear()

    def fetch(self, stored, xp):
        """A new device array (of ``xp``: NumPy or CuPy) holding the stored array ``stored``: read
        from disk if it lives there (then dropped from memory again), and up to the device."""
        self.moved["read"] += stored.nbytes * (self.where == "disk")
        on_device = xp.empty(stored.shape, dtype=stored.dtype)
        self.up(stored, on_device)
        self.store.write_back([stored], changed=False)
        return on_device

    def wait(self) -> None:
        """Wait until every queued copy is done (nothing on the CPU)."""
        if self._side is not None:
            self._side.synchronize()

    def read_ahead(self, arrays) -> None:
        """The stored ``arrays`` are used next: the disk starts reading them."""
        self.store.read_ahead(arrays)

    def read(self, arrays) -> None:
        """The stored ``arrays`` are about to be used (counted as read from disk)."""
        self.moved["read"] += sum(a.nbytes for a in arrays) * (self.where == "disk")

    def write_back(self, arrays) -> None:
        """The stored ``arrays`` changed: to disk, and out of memory (counted as written)."""
        self.store.write_back(arrays)
        self.moved["write"] += sum(a.nbytes for a in arrays) * (self.where == "disk")

    def story(self) -> list[str]:
        """What moved where in the step so far (``--explain``), from :attr:`moved`."""
        kib = lambda n: f"{n / 1024:.1f} KiB"  # noqa: E731
        what = "optimizer shard (masters, moments)" + (" and parameter shards" if self.params else "")
        place = f"files under {self.store.folder}" if self.where == "disk" else "host memory"
        lines = [f"offload: its {what} in {place}; the optimizer step runs on the host",
                 f"  down {kib(self.moved['down'])} (gradient shards, device -> host), "
                 f"up {kib(self.moved['up'])} (parameter shards, host -> device)"]
        if self.where == "disk":
            lines.append(f"  disk: read {kib(self.moved['read'])}, wrote {kib(self.moved['write'])}")
        return lines

    def close(self) -> None:
        """Remove the offload files, if any."""
        self.store.close()
