"""Collectives with a root: broadcast, reduce, and the barrier built from them, on a binomial tree.

Number the ranks relative to the root, v = (rank - root) mod n. Rank v's parent is v with its lowest
set bit cleared; its children are v + 1, v + 2, v + 4, ... below its lowest set bit (and below n).
For n = 8 and root 0: 0 -> 4, 2, 1;  4 -> 6, 5;  2 -> 3;  6 -> 7. The tree is log2(n) deep, so a
broadcast or reduce takes log2(n) rounds, each moving the whole buffer: ideal for small messages.
"""
from __future__ import annotations

import numpy as np

from minidist.comm.ops import Workspace, reduce_ufunc
from minidist.comm.tags import TAG_BROADCAST, TAG_GATHER_BYTES, TAG_REDUCE
from minidist.comm.transport import wait_all


def broadcast(t, buf, root) -> None:
    """Copy ``root``'s ``buf`` into every rank's ``buf``, in place.

    Sends: each rank receives ``buf`` once from its parent, then sends it to each of its children.
    """
    n, r = t.size, t.rank
    v = (r - root) % n
    mask = 1
    while mask < n:  # find my lowest set bit: my parent is v - mask
        if v & mask:
            t.recv(buf, (r - mask) % n, TAG_BROADCAST)
            break
        mask <<= 1
    sends = []
    mask >>= 1
    while mask > 0:  # my children are v + mask for every smaller power of two
        if v + mask < n:
            sends.append(t.isend(buf, (r + mask) % n, TAG_BROADCAST))
        mask >>= 1
    wait_all(sends)


def reduce(t, buf, root, op, *, workspace=None) -> None:
    """The elementwise ``op`` over all ranks' ``buf`` lands in ``buf`` on ``root``; every other rank's
    ``buf`` is left unchanged (an inner tree node accumulates in the workspace instead).

    Sends: each rank receives one partial result from each child, reduces it in, and sends its own
    partial result (its subtree's) once to its parent. Operands combine in relative-rank order.
    """
    n, r = t.size, t.rank
    v = (r - root) % n
    ufunc = reduce_ufunc(op, buf)
    workspace = workspace if workspace is not None else Workspace()
    acc = buf if v == 0 else None  # a non-root rank copies buf only once it has a child to add
    mask = 1
    while mask < n:
        if v & mask:  # done with my subtree: pass it up to my parent
            t.send(buf if acc is None else acc, (r - mask) % n, TAG_REDUCE)
            return
        if v + mask < n:  # the child v + mask holds the subtree v+mask .. v+2*mask-1
            if acc is None:
                acc = workspace.get("reduce_acc", buf.dtype, buf.size, like=buf)
                acc[...] = buf
            incoming = workspace.get("reduce_in", buf.dtype, buf.size, like=buf)
            t.recv(incoming, (r + mask) % n, TAG_REDUCE)
            ufunc(acc, incoming, out=acc)
        mask <<= 1


def barrier(t) -> None:
    """Return only once every rank has called ``barrier``: an empty reduce up the tree to rank 0 (which
    so learns everyone has arrived), then an empty broadcast down it (which lets everyone go)."""
    token = np.empty(0, np.uint8)
    reduce(t, token, 0, "max")
    broadcast(t, token, 0)


def gather_bytes(t, data: bytes, dst: int) -> list[bytes] | None:
    """Every rank's ``data`` (any length, 0 included) on rank ``dst`` in rank order; None elsewhere.
    Sends: each rank other than ``dst`` sends ``dst`` its length (one int64), then, when not empty,
    the bytes as one uint8 buffer, point-to-point with the reserved tag ``TAG_GATHER_BYTES``; ``dst``
    receives them in rank order."""
    if t.rank != dst:
        t.send(np.array([len(data)], dtype=np.int64), dst, TAG_GATHER_BYTES)
        if data:
            t.send(np.frombuffer(data, dtype=np.uint8), dst, TAG_GATHER_BYTES)
        return None
    gathered = []
    for src in range(t.size):
        if src == dst:
            gathered.append(bytes(data))
            continue
        size = np.empty(1, dtype=np.int64)
        t.recv(size, src, TAG_GATHER_BYTES)
        buf = np.empty(int(size[0]), dtype=np.uint8)  # (length,)
        if buf.size:
            t.recv(buf, src, TAG_GATHER_BYTES)
        gathered.append(buf.tobytes())
    return gathered
