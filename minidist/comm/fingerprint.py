"""Ranks that disagree about a collective are caught before any data moves.

Every rank of a group must call the same collectives, in the same order, the same way. When they
don't, the algorithms hang or, worse, finish with mixed-up numbers and exit 0: a "sum" on one rank
against a "max" on another, 8 float32 against 4 float64 (the same 32 bytes), each rank broadcasting
from a different root. So before each collective every rank describes the call in a fingerprint of
seven int64 (collective, reduce op, dtype, count, root, sequence number, and how an all-to-all
knows its receive counts) and checks it. (For ``all_to_all``, whose ranks may send and receive
different numbers of rows, the count is the elements per row, which they must share. They must also
agree on how the counts are known: given, learned from the peers by a first exchange (a rank that
skipped it would leave the others waiting), or equal chunks, where every rank must have as many
rows, so the fingerprint carries them. ``ProcessGroup.all_to_all`` says how given counts are checked.)

- :func:`check_neighbours`, the default: swap fingerprints with the two ring neighbours, rank - 1
  and rank + 1 (four 56-byte messages per rank, all posted at once: one message latency). If every
  rank agrees with both neighbours, all ranks agree (agreement is transitive around the ring); where
  two neighbours differ, both raise :class:`CollectiveMismatchError` before the collective sends a
  byte, and the ranks further away stop at their next wait on them.
- :func:`check_everyone`, the group's ``debug=True``: all-gather every rank's fingerprint (a ring
  all-gather, 2(n-1) latencies), so every rank raises, each naming every rank that differs from rank 0.

Both go over the group's host transport on the reserved tags of ``tags.py``, so they cover the
hand-written algorithms and backends "mpi" and "nccl" alike.
"""
from __future__ import annotations

import numpy as np

from minidist.comm import ring
from minidist.comm.ops import DTYPES, GROUP_OPS
from minidist.comm.tags import TAG_FINGERPRINT
from minidist.comm.transport import CollectiveMismatchError

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "barrier", "split",
               "gather_bytes", "all_to_all")
FIELDS = ("op", "reduce op", "dtype", "count", "recv counts", "root", "seq")
RECV_COUNTS = {"given": -2, "learned": -3}
"""How an all-to-all knows what it receives, as its fingerprint's last field: given, learned from the
peers, or (a number >= 0) equal chunks of x's rows, that many; -1 for other collectives."""


def fingerprint(name: str, op, dtype, count: int, root: int, seq: int, recv_counts: str | int | None = None
                ) -> np.ndarray:
    """The call as seven int64: collective, reduce op, dtype (indices, -1 for none), count, root (-1 for
    none), the group's sequence number and, for all_to_all, ``recv_counts`` ("given", "learned", or
    the rows of x when the chunks are equal; see ``RECV_COUNTS``)."""
    how = -1 if recv_counts is None else RECV_COUNTS[recv_counts] if isinstance(recv_counts, str) else recv_counts
    return np.array([COLLECTIVES.index(name), GROUP_OPS.index(op) if op else -1,
                     DTYPES.index(np.dtype(dtype)) if dtype is not None else -1, count, root, seq, how],
                    dtype=np.int64)


def check_call(transport, group: str, name: str, op, dtype, count: int, root: int, seq: int, *,
               everyone: bool, recv_counts: str | int | None = None) -> None:
    """Fingerprint collective ``name`` #``seq`` of ``group`` and compare it with the ring neighbours
    (:func:`check_neighbours`) or, with ``everyone`` (the group's debug mode), with every rank
    (:func:`check_everyone`); raise CollectiveMismatchError where ranks differ.

    Sends: what the chosen check sends, over ``transport`` on ``TAG_FINGERPRINT``."""
    check = check_everyone if everyone else check_neighbours
    check(transport, fingerprint(name, op, dtype, count, root, seq, recv_counts), group)


def check_neighbours(transport, mine: np.ndarray, group: str) -> None:
    """Swap ``mine`` with the ranks before and after this one in the ring and raise
    CollectiveMismatchError naming the collective, its number, ``group`` and each neighbour that
    differs, with the fields that differ.

    Sends: ``mine`` (56 bytes) to rank - 1 and to rank + 1 (once when they are the same rank);
    receives theirs. Nothing when the group has one rank."""
    n, r = transport.size, transport.rank
    if n == 1:
        return
    neighbours = sorted({(r - 1) % n, (r + 1) % n})
    theirs = np.empty((len(neighbours), mine.size), np.int64)  # (neighbours, 7)
    requests = [transport.irecv(theirs[i], q, TAG_FINGERPRINT) for i, q in enumerate(neighbours)]
    requests += [transport.isend(mine, q, TAG_FINGERPRINT) for q in neighbours]
    for request in requests:
        request.wait()
    if (theirs == mine).all():
        return
    me = describe(mine)
    lines = [differ_text(q, describe(call), r, me) for q, call in zip(neighbours, theirs) if (call != mine).any()]
    raise CollectiveMismatchError(f"{me['op']} #{me['seq']} on group '{group}': " + "; ".join(lines))


def check_everyone(transport, mine: np.ndarray, group: str) -> None:
    """Debug mode: all-gather every rank's ``mine`` and raise CollectiveMismatchError on every rank
    when any differs from rank 0's, naming each such rank and the fields that differ.

    Sends: a ring all-gather of the 7-int fingerprints (n - 1 messages of 56 bytes per rank)."""
    everyone = np.empty(mine.size * transport.size, dtype=np.int64)
    ring.all_gather(transport, mine, [mine.size] * transport.size, everyone)
    calls = [describe(c) for c in everyone.reshape(transport.size, mine.size)]  # (size, 7) -> dicts
    differ = [r for r in range(transport.size) if calls[r] != calls[0]]
    if differ:
        first = calls[0]
        lines = [differ_text(r, calls[r], 0, first) for r in differ]
        raise CollectiveMismatchError(f"{first['op']} #{first['seq']} on group '{group}': " + "; ".join(lines))


def describe(call) -> dict:
    """A fingerprint (7 ints) as readable fields."""
    name, op, dtype, count, root, seq, recv_counts = (int(v) for v in call)
    return {"op": COLLECTIVES[name] if 0 <= name < len(COLLECTIVES) else f"collective {name}",
            "reduce op": GROUP_OPS[op] if 0 <= op < len(GROUP_OPS) else None,
            "dtype": str(DTYPES[dtype]) if 0 <= dtype < len(DTYPES) else None, "count": count,
            "root": root if root >= 0 else None, "seq": seq,
            "recv counts": _recv_counts_text(recv_counts)}


def _recv_counts_text(how: int) -> str | None:
    """'given', 'learned', 'equal (x has 8 rows)' or None: the last field of a fingerprint."""
    if how >= 0:
        return f"equal (x has {how} rows)"
    return next((text for text, code in RECV_COUNTS.items() if code == how), None)


def differ_text(rank: int, call: dict, other_rank: int, other: dict) -> str:
    """'rank 1 called reduce_scatter with count 10 while rank 0 called all_reduce with count 12'."""
    fields = [f for f in FIELDS[1:] if call[f] != other[f]]
    return f"rank {rank} called {_call_text(call, fields)} while rank {other_rank} called {_call_text(other, fields)}"


def _call_text(call: dict, fields: list[str]) -> str:
    """'reduce_scatter with count 10' for the fields that differ."""
    return call["op"] + (" with " + ", ".join(f"{f} {call[f]}" for f in fields) if fields else "")
