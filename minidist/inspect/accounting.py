"""Bytes held and bytes sent: what ZeRO saves, measured rather than claimed.

Memory is measured from the live arrays: an array that is a view of another counts as the memory of
the buffer it views, and a buffer is counted once however many views point at it. Activations are
the arrays saved for backward by the nodes of a live autograd graph (parameters they reference are
not activations). Communication is read from a rank's trace with nccl-tests' bus-bandwidth factors:
of an N-byte all-reduce each rank sends 2 (N-1)/n bytes; of a reduce-scatter of N bytes (its input)
or an all-gather of N bytes (its output), (N-1)/n.
"""
from __future__ import annotations

import numpy as np

from minidist.comm.ops import bus_factor
from minidist.device import is_cupy
from minidist.optim.zero_stages import STAGES

SHARDING_OPS = ("all_reduce", "reduce_scatter", "all_gather")  # what data parallelism and ZeRO send


def _is_array(a) -> bool:
    return isinstance(a, np.ndarray) or is_cupy(a)


def _buffer(a: np.ndarray) -> np.ndarray:
    """The array that owns the memory ``a`` views (NumPy or CuPy: a view's ``base`` is its owner)."""
    while _is_array(a.base):
        a = a.base
    return a


def unique_nbytes(arrays) -> int:
    """Bytes of the distinct memory buffers behind ``arrays`` (None entries skipped)."""
    buffers = {id(b): b for b in (_buffer(a) for a in arrays if a is not None)}
    return sum(b.nbytes for b in buffers.values())


def buffer_ids(arrays) -> set[int]:
    """The ids of the memory buffers behind ``arrays`` (entries that are not arrays skipped)."""
    return {id(_buffer(a)) for a in arrays if _is_array(a)}


def saved_buffers(t, excluded=frozenset(), seen=None, stop=None) -> dict[int, int]:
    """{buffer id: bytes} of the memory behind the arrays that the graph behind tensor ``t`` keeps
    for backward (saved on its Function nodes, directly or in tuples), leaving out the buffers in
    ``excluded`` (:func:`buffer_ids` of the weights) and the nodes in ``seen`` (a set it fills: a
    later walk then counts only what is new). A node for which ``stop(node)`` holds is neither
    counted nor walked past."""
    seen = set() if seen is None else seen
    found, stack = {}, [t._node] if t._node is not None else []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if stop is not None and stop(node):
            continue
        for v in vars(node).values():
            for a in v if isinstance(v, tuple) else (v,):
                if _is_array(a) and id(_buffer(a)) not in excluded:
                    found[id(_buffer(a))] = _buffer(a).nbytes
        stack.extend(i._node for i in node.inputs if i is not None and i._node is not None)
    return found


def activation_bytes(loss, exclude=()) -> int:
    """Bytes of the arrays that the graph behind ``loss`` keeps for backward (:func:`saved_buffers`),
    not counting buffers behind the arrays in ``exclude`` (weights)."""
    return sum(saved_buffers(loss, buffer_ids(exclude)).values())


def zero_formula(stage: int, param_bytes: int, optimizer_bytes: int, n: int) -> dict:
    """The ZeRO paper's model-state bytes per rank: P = G = ``param_bytes`` (the model's dtype),
    O = ``optimizer_bytes`` (K bytes per parameter: SGD's momentum, AdamW's two moments, and under
    mixed precision the float32 masters; the paper's K = 12 for mixed-precision Adam; the table is
    ``minidist.optim.optimizer_bytes_per_parameter``). Stage 0:
    P + G + O; 1: P + G + O/N; 2: P + (G + O)/N; 3: (P + G + O)/N."""
    P = G = param_bytes
    sharded = STAGES[stage]  # what the stage shards (optim/zero_stages.py)
    shard = {"parameters": sharded.parameters, "gradients": sharded.gradients, "optimizer": sharded.optimizer_states}
    full = {"parameters": P, "gradients": G, "optimizer": optimizer_bytes}
    return {k: v / n if shard[k] else v for k, v in full.items()}


def offload_formula(part: dict, shard_bytes: float, where: str, params: bool, master_copy: bool) -> dict:
    """:func:`zero_formula`'s ``part`` with offload (offload.py): the optimizer shard leaves the
    device for ``where`` ("host" or "disk"), and so does the parameter shard (``shard_bytes``: numel/N
    in the model's dtype) when ``params`` are offloaded (ZeRO-3) or ``master_copy`` (full precision:
    the master is a copy of the shard); the host keeps the gradient shard (``shard_bytes``) as well."""
    stored = part["optimizer"] + (shard_bytes if params or master_copy else 0)
    return {"parameters": 0 if params else part["parameters"], "gradients": part["gradients"], "optimizer": 0,
            "host": shard_bytes + stored * (where == "host"), "disk": stored * (where == "disk")}


def bus_bytes(events, group_name: str, group_size: int) -> dict:
    """Per op (all_reduce / reduce_scatter / all_gather) the bus bytes each rank of ``group_name``
    sends for the recorded ``events`` (the convention of :func:`sent_bytes`), plus their ``"total"``."""
    sent = {op: 0.0 for op in SHARDING_OPS}
    for e in events:
        if e.group == group_name and e.op in SHARDING_OPS:
            sent[e.op] += e.nbytes * bus_factor(e.op, group_size)
    sent["total"] = sum(sent.values())
    return sent


AXIS_OF_GROUP = {"dp_cp": "dp", "edp": "dp"}  # gradient groups over dp x cp, the experts' dp ranks: data parallelism


def axis_of(group_name: str) -> str:
    """The mesh axis a group belongs to, from its name: ``tp[dp0,pp1]`` -> "tp", ``dp_cp[pp0,tp0]``
    -> "dp", the pipeline's ``pp[dp0,tp0]/embedding`` -> "pp"."""
    prefix = group_name.split("[")[0]
    return AXIS_OF_GROUP.get(prefix, prefix)


def sent_bytes(events, group_sizes: dict[str, int]) -> dict:
    """Per mesh axis (:func:`axis_of`), the bytes this rank sent in ``events``: each collective's
    bus bytes (nccl-tests' factors, :func:`~minidist.comm.ops.bus_factor`, on the group's size from
    ``group_sizes``), each point-to-point send's bytes (half of a sendrecv's); receives, waits and
    compute send nothing. Bus bytes are what a bandwidth-optimal algorithm sends (the ring and
    Rabenseifner's send exactly that); recursive doubling, which the groups pick for all-reduces
    below 256 KiB, sends log2(n) whole buffers instead: the convention counts the data's share of
    the link, not that algorithm's messages, and the planner counts the same way."""
    sent: dict = {}
    for e in events:
        if e.kind not in ("collective", "p2p") or e.op in ("recv", "irecv"):
            continue
        factor = 0.5 if e.op == "sendrecv" else bus_factor(e.op, group_sizes[e.group])
        if factor is not None:
            sent[axis_of(e.group)] = sent.get(axis_of(e.group), 0.0) + e.nbytes * factor
    return sent


def format_memory_table(rows: list[dict]) -> str:
    """A text table, one row per dict (keys: label, then byte counts), bytes shown in KiB."""
    columns = [k for k in rows[0] if k != "label"]
    width = max(22, *(len(r["label"]) + 2 for r in rows))
    lines = [f"{'':<{width}}" + "".join(f"{c:>14}" for c in columns)]
    for r in rows:
        lines.append(f"{r['label']:<{width}}" + "".join(f"{r[c] / 1024:>11.1f} KiB" for c in columns))
    return "\n".join(lines)
