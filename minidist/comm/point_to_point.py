"""Point-to-point messages on a ProcessGroup: send, receive, exchange, and a batch posted as one.

The methods live here and :class:`~minidist.comm.group.ProcessGroup` inherits them: each checks its
arguments, numbers the call (``p2p_seq``), records it in the trace with its call site's ``label`` and
hands it to the transport, or, for GPU buffers on backend "nccl", to NCCL. A peer that never answers
surfaces as CommTimeoutError naming the call, as for a collective (the group's ``_timeouts``).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from minidist.comm import checks
from minidist.comm.transport import Request
from minidist.device import is_cupy


class PointToPoint:
    """The point-to-point half of a ProcessGroup (a mixin: it reads the group's ``transport``,
    ``backend``, ``_native``, ``trace``, ``name`` and ``_timeouts``)."""

    def send(self, x, dst: int, tag: int = 0, *, label: str = "") -> None:
        """Send ``x`` to rank ``dst``; returns once ``x`` may be reused."""
        checks.check_p2p(self, x, dst, tag, writeable=False)
        with self._p2p("send", dst, x.nbytes, label):
            self._links_for(x).send(x, dst, tag)

    def recv(self, x, src: int, tag: int = 0, *, label: str = ""):
        """Receive ``src``'s message (same dtype and size as ``x``) into ``x``; returns ``x``."""
        checks.check_p2p(self, x, src, tag)
        with self._p2p("recv", src, x.nbytes, label):
            self._links_for(x).recv(x, src, tag)
        return x

    def isend(self, x, dst: int, tag: int = 0, *, label: str = "") -> Request:
        """Start sending ``x`` to ``dst``; don't touch ``x`` until the request's ``wait()`` returns.
        (The trace times the posting; the transfer overlaps whatever runs until ``wait``.)"""
        checks.check_p2p(self, x, dst, tag, writeable=False)
        with self._p2p("isend", dst, x.nbytes, label) as seq:
            return _GroupRequest(self._links_for(x).isend(x, dst, tag), self, "isend", seq)

    def irecv(self, x, src: int, tag: int = 0, *, label: str = "") -> Request:
        """Start receiving ``src``'s message into ``x``; it is there once ``wait()`` returns."""
        checks.check_p2p(self, x, src, tag)
        with self._p2p("irecv", src, x.nbytes, label) as seq:
            return _GroupRequest(self._links_for(x).irecv(x, src, tag), self, "irecv", seq)

    def sendrecv(self, sendbuf, dst: int, recvbuf, src: int, tag: int = 0, *, label: str = ""):
        """Send ``sendbuf`` to ``dst`` while receiving ``recvbuf`` from ``src`` (deadlock-free even
        when two ranks exchange with each other). Returns ``recvbuf``."""
        checks.check_p2p(self, sendbuf, dst, tag, writeable=False)
        checks.check_p2p(self, recvbuf, src, tag, like=sendbuf)
        with self._p2p("sendrecv", dst, sendbuf.nbytes + recvbuf.nbytes, label):
            self._links_for(sendbuf).sendrecv(sendbuf, dst, recvbuf, src, tag)
        return recvbuf

    def batch_isend_irecv(self, ops: list["P2POp"]) -> list[Request]:
        """Post the point-to-point ops ``ops`` (:class:`P2POp`) together and return their requests,
        in order (torch.distributed's ``batch_isend_irecv``); touch no buffer before its request's
        ``wait()``. What it sends: each "isend" op's buffer to its peer. On backend "nccl" the ops on GPU
        buffers are one NCCL group (``ncclGroupStart``/``ncclGroupEnd``), launched now, whose sends
        and receives progress together and complete together; elsewhere each op is posted as
        ``isend`` / ``irecv`` posts it. Every op is checked before any is posted."""
        for op in ops:
            if op.op not in ("isend", "irecv"):
                raise ValueError(f"rank {self.rank}: a P2POp is 'isend' or 'irecv', got {op.op!r}")
            checks.check_p2p(self, op.buffer, op.peer, op.tag, writeable=op.op == "irecv")
        requests = [getattr(self, op.op)(op.buffer, op.peer, op.tag, label=op.label) for op in ops]
        if self.backend == "nccl":
            self._native.p2p.flush()  # what the GPU ops queued: one NCCL group
        return requests

    def _links_for(self, x):
        """Where a point-to-point message with buffer ``x`` goes: NCCL for a GPU buffer on backend
        "nccl", else the transport."""
        return self._native.p2p if self.backend == "nccl" and is_cupy(x) else self.transport

    @contextmanager
    def _p2p(self, name, peer, nbytes, label=""):
        """Number and record a point-to-point call (with the call site's ``label``); yields its number."""
        self.p2p_seq += 1
        with self._timeouts(name, self.p2p_seq), self.trace.record(
                name, group=self.name, nbytes=nbytes, seq=self.p2p_seq, peer=peer, kind="p2p", label=label):
            yield self.p2p_seq


class _GroupRequest(Request):
    """A transport request whose ``wait`` reports a lost peer as CommTimeoutError, like the group."""

    def __init__(self, request: Request, group, op: str, seq: int):
        self.request, self.group, self.op, self.seq = request, group, op, seq

    def test(self) -> bool:
        return self.request.test()

    def wait(self) -> None:
        with self.group._timeouts(self.op, self.seq):
            self.request.wait()


@dataclass(frozen=True)
class P2POp:
    """One op of :meth:`ProcessGroup.batch_isend_irecv` (torch.distributed's ``P2POp``): "isend"
    ``buffer`` to rank ``peer``, or "irecv" into ``buffer`` from it, with ``tag`` and the call site's
    ``label`` ("<purpose>: <what>", recorded in the trace)."""
    op: str
    buffer: object
    peer: int
    tag: int = 0
    label: str = ""
