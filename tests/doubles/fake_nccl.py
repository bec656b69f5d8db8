"""A stand-in for ``cupy.cuda.nccl`` whose ranks are threads of one process, for CPU tests.

Install it with ``fake_cupy.install(nccl=fake_nccl)``. It has the API minidist uses (``get_unique_id``,
``NcclCommunicator`` with ``allReduce``, ``reduce``, ``broadcast``, ``reduceScatter``, ``allGather``,
``send``, ``recv``, ``abort``, ``destroy``, ``rank_id``, ``size``; ``groupStart``/``groupEnd``;
the ``NCCL_*`` constants with NCCL's values) and really moves data between the threads:

- every communicator made with one unique id joins one process-wide clique; ``NcclCommunicator``
  returns once all ``ndev`` ranks have joined, and refuses two ranks on one (fake) GPU, as NCCL does;
- a call is asynchronous, as a kernel launch is: it queues its work on the thread's stream
  (``fake_cupy.enqueue``) and returns. A collective runs when the last rank has called it (the n-th
  collective of every rank meets the n-th of the others); it reads every rank's buffer through its
  address (``ctypes``), reduces in rank order with NumPy and writes the results. An event recorded
  after the call is ``done`` once that has happened, so a rank whose peer skips the call waits forever,
  as on a GPU;
- a stream runs its work in order, as a GPU does: each host thread has one stream, and a launch (a
  lone call, or every call between ``groupStart`` and ``groupEnd``, which NCCL fuses into one)
  reaches its peers only once every launch before it on that stream has finished. So a call waits
  behind an unfinished one, whatever it is;
- ``send``/``recv`` match per (sender, receiver) in posting order (NCCL has no tags), and only
  between launches that have reached their peers: a send (lone, or in a group) finishes when its
  receiver's launch has reached the receive, and its stream waits for it meanwhile. Two ranks whose
  next launches each wait for the other's later launch wait for ever, as on GPUs;
- ``abort`` withdraws this rank's pending calls and marks their work done (a real abort ends the
  kernels); the communicator can't be used afterwards.
"""
from __future__ import annotations

import ctypes
import os
import threading
from collections import deque

import numpy as np

from tests.doubles import fake_cupy

NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_INT64 = 0, 1, 2, 4
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 6, 7, 8
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4

_DTYPES = {NCCL_INT8: np.int8, NCCL_UINT8: np.uint8, NCCL_INT32: np.int32, NCCL_INT64: np.int64,
           NCCL_FLOAT16: np.float16, NCCL_FLOAT32: np.float32, NCCL_FLOAT64: np.float64}
_UFUNCS = {NCCL_SUM: np.add, NCCL_PROD: np.multiply, NCCL_MAX: np.maximum, NCCL_MIN: np.minimum}
INIT_TIMEOUT = 60.0  # seconds a communicator waits for its peers to join (real NCCL waits forever)

available = True


class NcclError(RuntimeError):
    """``cupy.cuda.nccl.NcclError``."""


def get_version() -> int:
    return 22105  # "2.21.5"


def get_unique_id() -> tuple:
    """128 random ints in -128..127, as CuPy returns ncclUniqueId."""
    return tuple(int(b) for b in np.frombuffer(os.urandom(128), dtype=np.int8))


class _Work:
    """One rank's share of one call: ``done`` once it has run (or been aborted)."""

    def __init__(self, comm, kind, send, recv, count, datatype, op=None, root=None, peer=None):
        self.comm, self.kind, self.send, self.recv = comm, kind, send, recv
        self.count, self.op, self.root, self.peer = count, op, root, peer
        if datatype not in _DTYPES:
            raise NcclError(f"fake_nccl: unknown datatype {datatype!r}")
        if op is not None and op not in _UFUNCS:
            raise NcclError(f"fake_nccl: reduction op {op!r} is not modelled")
        self.dtype = np.dtype(_DTYPES[datatype])
        self.done = False
        self.stream = None  # set when launched

    def signature(self):
        return self.kind, self.count, self.dtype, self.op, self.root


class _Clique:
    """The shared state of the communicators made with one unique id."""

    def __init__(self, size: int):
        self.size = size
        self.lock = threading.Condition()
        self.members: dict[int, "NcclCommunicator"] = {}
        self.collectives: dict[int, dict[int, _Work]] = {}  # collective number -> rank -> work
        self.channels: dict[tuple[int, int, str], deque] = {}  # (src, dst, "send"/"recv") -> works


class _Stream:
    """One host thread's stream: its launches (lists of works), run in order."""

    def __init__(self):
        self.launches: deque[list[_Work]] = deque()
        self.started = False  # whether the first launch has reached its peers
        _streams.append(self)


_cliques: dict[tuple, _Clique] = {}
_registry_lock = threading.Lock()
_streams: list[_Stream] = []  # every thread's
_gpus = threading.RLock()  # every clique's matching and every stream's progress, as the GPUs run them
_thread = threading.local()  # this thread's open group (depth, held calls) and its stream


def _launch(works: list) -> None:
    """Queue ``works`` as one launch on this thread's stream; it starts once the launches before it end."""
    if not hasattr(_thread, "stream"):
        _thread.stream = _Stream()
    for work in works:
        work.stream = _thread.stream
    with _gpus:
        _thread.stream.launches.append(works)
        _run({_thread.stream})


def _run(streams: set) -> None:
    """Move ``streams`` on: a stream's first launch reaches its peers (its works are posted); once all
    of its works are done the next one does. Work finished on the way moves its own stream on."""
    while streams:
        stream = streams.pop()
        while stream.launches:
            if not stream.started:
                stream.started = True
                for work in stream.launches[0]:
                    streams |= work.comm._post(work)
            if not all(w.done for w in stream.launches[0]):
                break
            stream.launches.popleft()
            stream.started = False


def groupStart() -> None:  # noqa: N802 -- CuPy's name
    _thread.depth = getattr(_thread, "depth", 0) + 1
    if _thread.depth == 1:
        _thread.held = []


def groupEnd() -> None:  # noqa: N802 -- CuPy's name
    if getattr(_thread, "depth", 0) == 0:
        raise NcclError("fake_nccl: groupEnd without groupStart (ncclInvalidUsage)")
    _thread.depth -= 1
    if _thread.depth == 0:
        held, _thread.held = _thread.held, []
        if held:
            _launch(held)


class NcclCommunicator:
    """One rank of a clique. Every method that moves data returns at once; see the module doc."""

    def __init__(self, ndev: int, commId: tuple, rank: int):  # noqa: N803 -- CuPy's names
        if not isinstance(commId, tuple) or len(commId) != 128:
            raise NcclError("fake_nccl: commId must be the 128-int tuple get_unique_id() returns")
        if not 0 <= rank < ndev:
            raise NcclError(f"fake_nccl: rank {rank} is not in 0..{ndev - 1} (ncclInvalidArgument)")
        with _registry_lock:
            clique = _cliques.setdefault(commId, _Clique(ndev))
        self._clique, self._rank, self._size = clique, rank, ndev
        self._device = fake_cupy._current_device()
        self._collectives_posted = 0
        self._state = "ok"
        with clique.lock:
            if clique.size != ndev or rank in clique.members:
                raise NcclError(f"fake_nccl: rank {rank} of {ndev} does not fit this clique (ncclInvalidUsage)")
            clique.members[rank] = self
            clique.lock.notify_all()
            if not clique.lock.wait_for(lambda: len(clique.members) == ndev, INIT_TIMEOUT):
                raise NcclError(f"fake_nccl: only {len(clique.members)} of {ndev} ranks joined")
            devices = {}
            for r, comm in sorted(clique.members.items()):
                if comm._device in devices:
                    raise NcclError(f"fake_nccl: Duplicate GPU detected: rank {devices[comm._device]} and rank "
                                    f"{r} both on CUDA device {comm._device} (ncclInvalidUsage)")
                devices[comm._device] = r

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def device_id(self) -> int:
        return self._device

    # ---- collectives (counts are elements; buffers are device addresses) ---------------------------

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):  # noqa: N802
        self._call(_Work(self, "allReduce", sendbuf, recvbuf, count, datatype, op))

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        self._call(_Work(self, "reduce", sendbuf, recvbuf, count, datatype, op, root))

    def broadcast(self, sendbuf, recvbuf, count, datatype, root, stream):
        self._call(_Work(self, "broadcast", sendbuf, recvbuf, count, datatype, root=root))

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):  # noqa: N802
        self._call(_Work(self, "reduceScatter", sendbuf, recvbuf, recvcount, datatype, op))

    def allGather(self, sendbuf, recvbuf, sendcount, datatype, stream):  # noqa: N802
        self._call(_Work(self, "allGather", sendbuf, recvbuf, sendcount, datatype))

    def send(self, sendbuf, count, datatype, peer, stream):
        self._call(_Work(self, "send", sendbuf, None, count, datatype, peer=peer))

    def recv(self, recvbuf, count, datatype, peer, stream):
        self._call(_Work(self, "recv", None, recvbuf, count, datatype, peer=peer))

    # ---- lifetime ------------------------------------------------------------------------------------

    def abort(self) -> None:
        """Withdraw this rank's pending calls (their work counts as done) and retire the communicator."""
        with _gpus:
            self._withdraw()
            self._state = "aborted"

    def destroy(self) -> None:
        with _gpus:
            self._withdraw()
            self._state = "destroyed"

    # ---- the machinery -------------------------------------------------------------------------------

    def _call(self, work: _Work) -> None:
        if self._state != "ok":
            raise NcclError(f"fake_nccl: the communicator was {self._state}")
        if work.peer is not None and not 0 <= work.peer < self._size:
            raise NcclError(f"fake_nccl: peer {work.peer} is not in 0..{self._size - 1} (ncclInvalidArgument)")
        fake_cupy.enqueue(work)
        if getattr(_thread, "depth", 0):
            _thread.held.append(work)
        else:
            _launch([work])

    def _post(self, work: _Work) -> set:
        """``work`` reaches its peers (its launch has started): run it if they are all there. Returns
        the streams of the works that finished."""
        if work.done:  # withdrawn by an abort
            return set()
        if work.kind in ("send", "recv"):
            return self._post_p2p(work)
        clique = self._clique
        number = self._collectives_posted
        self._collectives_posted += 1
        posted = clique.collectives.setdefault(number, {})
        posted[self._rank] = work
        if len(posted) < clique.size:
            return set()
        del clique.collectives[number]
        _run_collective([posted[r] for r in range(clique.size)], number)
        return {w.stream for w in posted.values()}

    def _post_p2p(self, work: _Work) -> set:
        """Match with the oldest unmatched posted call of the other kind on this (src, dst) pair, or wait."""
        src, dst = (self._rank, work.peer) if work.kind == "send" else (work.peer, self._rank)
        other = self._clique.channels.get((src, dst, "recv" if work.kind == "send" else "send"))
        if not other:
            self._clique.channels.setdefault((src, dst, work.kind), deque()).append(work)
            return set()
        send, recv = (work, other.popleft()) if work.kind == "send" else (other.popleft(), work)
        nbytes = send.count * send.dtype.itemsize
        if recv.count * recv.dtype.itemsize != nbytes:
            raise NcclError(f"fake_nccl: rank {src} sends {nbytes} bytes to rank {dst}, which receives "
                            f"{recv.count * recv.dtype.itemsize}")
        _memory(recv.recv, nbytes, np.uint8)[...] = _memory(send.send, nbytes, np.uint8)
        send.done = recv.done = True
        return {send.stream, recv.stream}

    def _withdraw(self) -> None:
        """This communicator's calls, posted or still queued on a stream, count as done."""
        clique, mine = self._clique, []
        for posted in clique.collectives.values():
            work = posted.pop(self._rank, None)
            if work is not None:
                mine.append(work)
        for works in clique.channels.values():
            for work in [w for w in works if w.comm is self]:
                works.remove(work)
                mine.append(work)
        for stream in _streams:
            mine += [w for launch in stream.launches for w in launch if w.comm is self and not w.done]
        for work in mine:
            work.done = True
        _run({w.stream for w in mine if w.stream is not None})


def _run_collective(works: list[_Work], number: int) -> None:
    """Every rank's share of collective ``number`` is posted: check they agree, then compute."""
    first = works[0]
    for r, work in enumerate(works):
        if work.signature() != first.signature():
            raise NcclError(f"fake_nccl: collective #{number}: rank 0 called {first.signature()}, "
                            f"rank {r} called {work.signature()}")
    n, count, dtype = len(works), first.count, first.dtype
    in_count = count * n if first.kind == "reduceScatter" else count
    inputs = [_memory(w.send, in_count, dtype).copy() for w in works]  # all read before any is written
    if first.kind == "broadcast":
        results = [inputs[first.root]] * n
    elif first.kind == "allGather":
        results = [np.concatenate(inputs)] * n
    else:
        total = inputs[0].copy()
        for x in inputs[1:]:
            _UFUNCS[first.op](total, x, out=total)
        if first.kind == "reduceScatter":
            results = [total[r * count:(r + 1) * count] for r in range(n)]
        elif first.kind == "reduce":
            results = [total if r == first.root else None for r in range(n)]
        else:
            results = [total] * n
    for work, result in zip(works, results):
        if result is not None:
            _memory(work.recv, result.size, dtype)[...] = result
    for work in works:
        work.done = True


def _memory(address: int, count: int, dtype) -> np.ndarray:
    """The ``count`` elements of ``dtype`` at ``address`` (a fake device array's host memory)."""
    dtype = np.dtype(dtype)
    if count == 0:
        return np.empty(0, dtype)
    return np.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(address), dtype=dtype)
