"""The one path of every collective on a ProcessGroup: choose, number, check, record, run.

After a collective has checked its arguments (``checks.py``), ``_dispatch`` runs it behind the
collectives queued before it, numbers it (``seq``, the same on every rank), checks its fingerprint
with the ring neighbours (``fingerprint.py``), records it in the trace with its call site's label,
and runs it now or on the group's communication thread. A peer that never answers becomes a
CommTimeoutError naming the operation and, from a census (``census.py``), the ranks that never arrived.
:class:`~minidist.comm.group.ProcessGroup` inherits these methods.
"""
from __future__ import annotations

from contextlib import contextmanager

from minidist.comm import census
from minidist.comm.fingerprint import check_call
from minidist.comm.transport import CommTimeoutError, PeerFailed, PeerTimeout, ProcessFailedError
from minidist.device import device_of, is_cupy

DEFAULT_THRESHOLD_BYTES = 256 * 1024
"""All-reduces smaller than this use recursive doubling. In the usual cost model (a message costs a
latency a plus its bytes times b), doubling costs log2(n) (a + N b), Rabenseifner's about
2 log2(n) a + 2(n-1)/n N b and the ring 2(n-1) a + 2(n-1)/n N b: doubling sends fewest messages,
the other two fewest bytes. Measured by ``benchmarks/collectives.py --algorithms`` on 2 cores (2 and
4 ranks): doubling is fastest up to 128 KiB, level with Rabenseifner's at 256 KiB, and slower from
512 KiB (4 ranks, 1 MiB: 522 us against 432 us). Every rank sees the same size, so all pick the same
algorithm."""

DEFAULT_RING_FROM_BYTES = 8 * 1024 * 1024
"""On a power-of-two group, all-reduces from ``threshold_bytes`` up to this use Rabenseifner's
algorithm (``halving.py``), and reduce-scatters and all-gathers below it recursive halving and
doubling (log2(n) rounds); the ring from here on, and on other groups at every size. Measured on 2
cores (``--algorithms``): Rabenseifner's all-reduce beat the ring by 18-35% from 256 KiB to 2 MiB at
4 ranks (3-4 rounds against 6), was level at 4 MiB and lost by 5-30% from 8 MiB, at 2 and 4 ranks
(probably because its unsegmented halves, up to half the buffer, no longer fit in the cache, where
the ring streams 1 MiB segments)."""


def power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


class Dispatch:
    """How a ProcessGroup runs each call (a mixin over the group's ``transport``, ``backend``,
    ``_native``, ``_stream``, ``trace``, ``seq`` and settings)."""

    def _dispatch(self, name, run, algorithm, nbytes, *, async_op=False, like=None, op=None, dtype=None, count=0,
                  root=-1, recv_counts=None, label=""):
        """The one path of every collective, once its arguments are checked: after the collectives
        queued before it, number it, check its fingerprint, record it in the trace and ``run()`` it,
        now or (``async_op``) on the group's communication thread, returning its Work. ``op``,
        ``dtype``, ``count``, ``root`` and ``recv_counts`` describe the call for the fingerprint. A GPU
        array's kernels must run on its own GPU, so the communication thread makes ``like``'s GPU
        current for the call. ``label`` is the call site's purpose, recorded in the trace."""
        def collective():
            with self._collective(name, algorithm, nbytes, op=op, dtype=dtype, count=count, root=root,
                                  recv_counts=recv_counts, label=label):
                return run()
        if async_op:
            def on_its_gpu():
                with device_of(like):
                    return collective()
            return self._stream.submit(on_its_gpu, f"{name} on group '{self.name}'")
        self._stream.synchronize()
        return collective()

    def _native_for(self, x):
        """The backend's own collectives for ``x``, or None for the hand-written ones: backend "nccl"
        takes GPU arrays only, so host arrays on an NCCL group go over the transport."""
        if self.backend == "nccl" and not is_cupy(x):
            return None
        return self._native

    def _all_reduce_algorithm(self, nbytes: int) -> str:
        """``all_reduce(algorithm="auto")``'s choice for a buffer of ``nbytes``: recursive doubling
        below ``threshold_bytes``; from there, on a power-of-two group, Rabenseifner's ("halving")
        below ``ring_from_bytes``; else the ring. It depends only on the size and the group's size,
        which every rank shares, so every rank picks the same."""
        if nbytes < self.threshold_bytes:
            return "doubling"
        if nbytes < self.ring_from_bytes and power_of_two(self.size):
            return "halving"
        return "ring"

    def _halving(self, nbytes: int) -> bool:
        """Whether reduce_scatter (recursive halving) and all_gather (recursive doubling) of a full
        buffer of ``nbytes`` take log2(n) rounds rather than the ring's n - 1: on a power-of-two group,
        below ``ring_from_bytes``. The same on every rank."""
        return self.size > 1 and power_of_two(self.size) and nbytes < self.ring_from_bytes

    def _algorithm(self, hand_written: str, x) -> str:
        """The name the trace records: the backend's ("mpi", "nccl") when it runs the call."""
        return self.backend if self._native_for(x) else hand_written

    @contextmanager
    def _collective(self, name, algorithm, nbytes, *, op=None, dtype=None, count=0, root=-1, recv_counts=None,
                    label=""):
        """Number a collective, record it in the trace, check that the ranks called the same one
        (``fingerprint.py``: with the ring neighbours, or in debug mode with everyone), and report a
        peer that never answers as CommTimeoutError naming the ranks that never arrived."""
        self.seq += 1
        with self._timeouts(name, self.seq, collective=True), self.trace.record(
                name, group=self.name, algorithm=algorithm, nbytes=nbytes, seq=self.seq, label=label):
            if self.debug or self.check_calls:
                check_call(self.transport, self.name, name, op, dtype, count, root, self.seq, everyone=self.debug,
                           recv_counts=recv_counts)
            yield

    @contextmanager
    def _timeouts(self, name, seq, collective=False):
        """Turn a transport's PeerTimeout into CommTimeoutError; for a collective, first take a census
        of the group (``census.py``, at most ``census.GRACE_SECONDS``) to name the ranks that never
        arrived. The flight recorder dumps the error, census included. A transport's PeerFailed (a
        dead peer, by MPI's fault-tolerance interface) becomes ProcessFailedError, with no census."""
        try:
            yield
        except PeerFailed as e:
            raise ProcessFailedError(name, seq, e, self.name) from e
        except PeerTimeout as e:
            found, missing = "", []
            if collective and self.size > 1:
                found, missing, pending = census.explain(self.transport, seq, name)
                self._census_sends += pending
            error = CommTimeoutError(name, seq, self.rank, e.peer, e.waited, self.name, found, missing)
            if self.flight_recorder is not None:
                self.flight_recorder.dump(self.trace, error)
            raise error from e
