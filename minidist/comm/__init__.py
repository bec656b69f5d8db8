"""The collective engine: transports, hand-written algorithms, process groups, traces.

Algorithms live in their own modules (``ring``, ``doubling``, ``halving``: Rabenseifner's, ``rooted``;
``alltoall``: the pairwise and scattered all-to-all exchanges; ``native`` wraps MPI's own, ``nccl``
NCCL's); this package re-exports the names a user needs.
"""
from minidist.comm.group import ProcessGroup
from minidist.comm.launch import init, run_local
from minidist.comm.local_transport import LocalTransport, PeerExited
from minidist.comm.ops import GROUP_OPS, split_counts
from minidist.comm.trace import Event, Trace, gather_traces, write_chrome_trace
from minidist.comm.work import Work
from minidist.comm.transport import (CollectiveMismatchError, CommTimeoutError, PeerTimeout, Request,
                                     Transport, wait_all)

__all__ = ["ProcessGroup", "init", "run_local", "LocalTransport", "PeerExited", "GROUP_OPS", "split_counts",
           "Event", "Trace", "gather_traces", "write_chrome_trace", "CollectiveMismatchError", "CommTimeoutError",
           "PeerTimeout", "Request", "Transport", "Work", "wait_all"]
