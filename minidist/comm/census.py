"""Who is here? After a collective timed out, find the rank that never arrived.

A timed-out wait knows only the peer it waited for, and in a chain of waits that peer is often
waiting itself: when rank 2 stops, rank 3 waits for rank 2, rank 0 for rank 3, rank 1 for rank 0.
So a rank whose collective timed out takes a census of its group before it raises: it tells every
other rank where it is (the collective's sequence number and name) and listens for a short grace
window for the others to say where they are. The ranks stuck in the same collective time out at about
the same moment and do the same, so they hear from each other; a rank that is stopped, dead, or busy
elsewhere says nothing, and one stuck in an earlier collective says which.

Bounded: the sends are never waited for beyond the window, the receives are polled until it ends and
then cancelled, so a census cannot hang. Best effort: a rank that times out more than the window
after this one counts as silent.
"""
from __future__ import annotations

import time

import numpy as np

from minidist.comm.fingerprint import COLLECTIVES
from minidist.comm.tags import TAG_CENSUS

GRACE_SECONDS = 2.0
"""The longest a census listens (shorter when the group's timeout is): ranks that time out within
this long of each other hear each other."""
POLL_SECONDS = 1e-3


def explain(transport, seq: int, name: str) -> tuple[str, list[int], list]:
    """After collective ``name`` #``seq`` timed out: take a census (at most ``GRACE_SECONDS``, or the
    transport's timeout when shorter) and return its :func:`summary` sentence, the ranks that never
    arrived, and the census's send requests still pending (see :func:`take`).

    Sends: what :func:`take` sends."""
    grace = min(GRACE_SECONDS, transport.timeout)
    heard, pending = take(transport, seq, name, grace)
    found, missing = summary(transport.rank, transport.size, seq, name, heard, grace)
    return found, missing, pending


def take(transport, seq: int, name: str, grace: float) -> tuple[dict, list]:
    """Tell every other rank of ``transport`` this rank's place (collective ``name`` #``seq``) and
    listen up to ``grace`` seconds for theirs.

    Sends: 2 int64 (seq, collective) to every other rank, on ``TAG_CENSUS``. Returns ({rank: (seq,
    name)} for the ranks heard, {rank: why} for those known to be gone, in one dict) and the send
    requests still pending (keep them referenced until the job ends; their buffers must live)."""
    n, r = transport.size, transport.rank
    mine = np.array([seq, COLLECTIVES.index(name)], np.int64)
    peers = [q for q in range(n) if q != r]
    inbox = np.full((n, 2), -1, np.int64)  # (ranks, 2)
    receives = {q: transport.irecv(inbox[q], q, TAG_CENSUS) for q in peers}
    sends = [transport.isend(mine, q, TAG_CENSUS) for q in peers]
    heard: dict[int, object] = {}
    end = time.monotonic() + grace
    while receives:
        for q, request in list(receives.items()):
            try:
                heard[q] = _place(inbox[q]) if request.test() else transport.peer_gone(q)
            except Exception as e:  # noqa: BLE001 -- best effort: a broken message counts as gone
                heard[q] = f"sent a broken answer ({e})"
            if heard[q] is None:
                del heard[q]
            else:
                del receives[q]
        if not receives or time.monotonic() >= end:
            break
        time.sleep(POLL_SECONDS)
    for request in receives.values():
        request.cancel()
    return heard, [s for s in sends if not _finished(s)]


def _place(row) -> tuple[int, str]:
    seq, index = (int(v) for v in row)
    return seq, COLLECTIVES[index] if 0 <= index < len(COLLECTIVES) else f"collective {index}"


def _finished(request) -> bool:
    try:
        return request.test()
    except Exception:  # noqa: BLE001
        return True


def summary(rank: int, size: int, seq: int, name: str, heard: dict, grace: float) -> tuple[str, list[int]]:
    """The census as one sentence, and the ranks that never arrived at ``name`` #``seq``:
    'rank 2 never arrived at all_reduce #17 (no answer in 1.0s: stopped, hung or busy elsewhere);
    ranks 0,1,3 waited in it'."""
    waited, missing, parts = [rank], [], []
    for q in range(size):
        if q == rank:
            continue
        place = heard.get(q)
        if isinstance(place, tuple) and place[0] == seq:
            waited.append(q)
        elif isinstance(place, tuple) and place[0] < seq:
            missing.append(q)
            parts.append(f"rank {q} never arrived at {name} #{seq} (it is stuck in {place[1]} #{place[0]})")
        elif isinstance(place, tuple):
            parts.append(f"rank {q} is already at {place[1]} #{place[0]}")
        elif place is not None:
            missing.append(q)
            parts.append(f"rank {q} never arrived at {name} #{seq}: it {place}")
        else:
            missing.append(q)
            parts.append(f"rank {q} never arrived at {name} #{seq} (no answer in {grace:.1f}s: stopped, hung "
                         f"or busy elsewhere)")
    if not parts:
        parts.append(f"every rank reached {name} #{seq}")
    ranks = "rank" if len(waited) == 1 else "ranks"
    return "; ".join(parts) + f"; {ranks} {','.join(map(str, sorted(waited)))} waited in it", missing
