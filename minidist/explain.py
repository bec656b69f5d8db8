"""``--explain``: what every rank holds and sends in one training step, in words.

After the first step each rank turns its own view into lines of text: its place in the mesh and
its groups, the parameters it holds (shards with their full shapes), and its trace of the step in
order (compute spans, and under them every collective and message: bytes, group, partners, shape
when it is an activation). The lines travel to rank 0 as UTF-8 bytes (``ProcessGroup.gather_bytes``,
no pickling) and rank 0 prints them grouped by rank, so 8 ranks read as 8 short stories rather than
interleaved output:

    === rank 1: DP(0)-PP(0)-TP(1)-Rank(1) ===
    groups: tp[dp0,pp0] = ranks [0, 1]; dp[pp0,tp1] = ranks [1, 3]
    holds transformer.h.{0,1}.attn.c_attn.weight   (96, 64) qkv shard of (192, 64)
    forward  3.1 ms
      2 x all_reduce 64.0 KiB (8, 64, 64) activation on tp[dp0,pp0] with rank 0 (doubling)
"""
from __future__ import annotations

import bisect
import re
import sys
from contextlib import contextmanager

import numpy as np

from minidist.parallel.ring_attention import token_ranges
from minidist.parallel.tp_layout import ep_block, is_expert, tp_layout
from minidist.parallel.tp_model import full_shape


def _bytes(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB" if n < 2**20 else f"{n / 2**20:.1f} MiB"


def group_members(mesh) -> dict[str, list[int]]:
    """{group name: its global ranks, in group-rank order} for this rank's world and axis groups."""
    s = mesh.shape
    d, p, c, t = mesh.dp_rank, mesh.pp_rank, mesh.cp_rank, mesh.tp_rank
    experts = {}
    if mesh.ep_group is not None:
        block = d - d % s.ep
        experts = {mesh.ep_group.name: [s.rank_of(block + i, p, t, c) for i in range(s.ep)],
                   mesh.expert_dp_group.name: [s.rank_of(i * s.ep + d % s.ep, p, t, j)
                                               for i in range(s.dp // s.ep) for j in range(s.cp)]}
    return experts | {mesh.world.name: list(range(s.world)),
            mesh.tp_group.name: [s.rank_of(d, p, i, c) for i in range(s.tp)],
            mesh.cp_group.name: [s.rank_of(d, p, t, i) for i in range(s.cp)],
            mesh.pp_group.name: [s.rank_of(d, i, t, c) for i in range(s.pp)],
            mesh.dp_group.name: [s.rank_of(i, p, t, c) for i in range(s.dp)],
            mesh.dp_cp_group.name: [s.rank_of(i, p, t, j) for i in range(s.dp) for j in range(s.cp)]}


def holdings(model, tp_size: int, ep_rank: int = 0, ep_size: int = 1) -> list[str]:
    """One line per parameter of ``model`` (blocks folded: ``h.{0,1}``): its shape on this rank
    and, when tensor parallelism cuts it, which shard of which full shape (tp_layout.py's table: the
    vocabulary's full shape has ``model.config.vocab_size`` rows, its padding is not part of it);
    when expert parallelism cuts it (ep rank ``ep_rank`` of ``ep_size``), which experts; a
    pipeline stage's copy of the tied embedding says so."""
    folded: dict[str, tuple[list[str], tuple]] = {}
    copies = {name for name, p in model.named_parameters() if p.tied_copy}
    for name, p in model.named_parameters():
        block = re.search(r"\.h\.(\d+)\.", name)
        key = re.sub(r"\.h\.\d+\.", ".h.{}.", name)
        blocks, _ = folded.setdefault(key, ([], p.data.shape))
        if block:
            blocks.append(block.group(1))
    lines = []
    for key, (blocks, shape) in folded.items():
        name = key.replace("{}", "{" + ",".join(blocks) + "}")
        first = key.replace("{}", "0")
        layout = tp_layout(first) if tp_size > 1 else "replicated"
        what = []  # how tp cuts it, then which experts ep gives it; neither: "whole"
        if layout != "replicated":
            what.append(f"{layout} shard of {full_shape(first, shape, model.config, tp_size)}")
        elif tp_size > 1:
            what.append("copy")
        if ep_size > 1 and is_expert(first):
            block = ep_block(model.config.n_experts, ep_rank, ep_size)
            what.append(f"experts {block.start}-{block.stop - 1} of {model.config.n_experts} (ep)")
        if first in copies:  # a pipeline's copy of the tied embedding, summed with it after backward
            what.append("tied copy of transformer.wte.weight")
        lines.append(f"holds {name:<42} {str(shape):<12} {', '.join(what) or 'whole'}")
    return lines


def routing(model, mesh) -> list[str]:
    """Who sent which tokens where in the last forward of each MoE block under expert parallelism:
    the rows this rank sent to each ep rank's experts and received from each (experts.py)."""
    lines = []
    ranks = group_members(mesh).get(mesh.ep_group.name) if mesh.ep_group is not None else None
    for name, m in model.named_modules():
        ep = getattr(m, "expert_parallel", None)
        if ep is None or not hasattr(ep, "sent"):
            continue
        local = ep.local
        sent = ", ".join(f"{int(ep.sent[r].sum())} to rank {ranks[r]} (experts {r * local}-{(r + 1) * local - 1}: "
                         f"{'/'.join(map(str, ep.sent[r]))})" for r in range(len(ranks)))
        got = ", ".join(f"{int(ep.received[r].sum())} from rank {ranks[r]}" for r in range(len(ranks)))
        lines.append(f"routes {name}: token rows (last micro-batch) {sent}; its experts got {got}")
    return lines


def _partners(e, members, me: int) -> str:
    """``with ranks 0, 2`` (a collective's other members) or ``to rank 2 (pp rank 1)`` (a message)."""
    ranks = members.get(e.group)
    if e.op.startswith("ring sendrecv"):  # a hop around the ring: on to the next rank, in from the previous
        prev = (e.peer - 2) % len(ranks) if ranks else None
        return (f"to rank {ranks[e.peer]}, from rank {ranks[prev]} ({e.group}), overlapping the attention math"
                if ranks else f"to {e.group} rank {e.peer}")
    if e.kind == "p2p":
        where = "to" if "send" in e.op else "from"
        return f"{where} rank {ranks[e.peer]} ({e.group} rank {e.peer})" if ranks else f"{where} {e.group} rank {e.peer}"
    others = [r for r in ranks if r != me] if ranks else []
    return f"on {e.group}" + (f" with rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}" if others else "")


def _what(e, span, pipeline_op) -> str:
    """What an activation-sized call carries. A pipeline message is an activation when it belongs to
    a forward (sent after one, ``pipeline_op``, or received before one), else a gradient: the
    direction between ranks does not say it, as ZB-V's second chunk sends activations to lower
    ranks. A collective inside a backward span moves activation gradients, elsewhere activations."""
    if e.kind == "p2p" and pipeline_op is not None:
        return "activation" if pipeline_op == "forward" else "gradient"
    return "gradient" if span is not None and span.op == "backward" else "activation"


def step_story(events, members: dict[str, list[int]], me: int, activation_shape=None, itemsize: int = 4) -> list[str]:
    """The events of one step as lines, in start order: a compute span as a heading, each call made
    inside it (or under ``after <span>:``, once it ended) as ``op bytes [shape] group partners
    (algorithm)``; consecutive identical calls fold into ``k x``. A call of exactly ``activation_shape``
    x ``itemsize`` bytes is labelled with that shape and with what it carries (:func:`_what`)."""
    act_bytes = int(np.prod(activation_shape)) * itemsize if activation_shape is not None else None
    lines, last, repeat, span = [], None, 0, None  # span: the last compute event, while not yet left

    def flush():
        if last is not None:
            lines.append(("  " if repeat == 1 else f"  {repeat} x ") + last)

    hop = None  # the last ring hop span (ring attention): its own isend / irecv are told by it
    ordered = sorted(events, key=lambda e: e.start)
    stage_spans = [e for e in ordered if e.kind == "compute" and e.group.startswith("stage")]
    stage_starts = [e.start for e in stage_spans]

    def pipeline_op(e):  # the stage computation a message belongs to: the one before a send, after a receive
        i = bisect.bisect_right(stage_starts, e.start)  # stage_spans[:i] started by then
        before, after = stage_spans[i - 1:i], stage_spans[i:i + 1]
        near = (before if "send" in e.op else after) or before or after
        return near[0].op if near else None

    for e in ordered:
        if e.op.startswith("ring sendrecv"):
            hop = e
        elif hop is not None and e.op in ("isend", "irecv") and e.group == hop.group and e.start <= hop.end:
            continue
        if e.kind == "compute":
            flush()
            last, repeat = None, 0
            stage = f" micro-batch {e.seq} of {e.group}" if e.group.startswith("stage") else ""
            heading = f"{e.op}{stage}  {1e3 * e.duration:.1f} ms"
            lines.append(heading)
            span = e
            continue
        if span is not None and e.start >= span.end:  # outside the span: say so once
            flush()
            last, repeat = None, 0
            if lines[-1] == heading:  # nothing inside it: "forward ... ms, then:"
                lines[-1] += ", then:"
            else:
                lines.append(f"after {span.op}:")
            span = None
        shape = f" {tuple(activation_shape)} {_what(e, span, pipeline_op(e))}" if e.nbytes == act_bytes else ""
        algorithm = f" ({e.algorithm})" if e.algorithm else ""
        text = f"{e.op} {_bytes(e.nbytes)}{shape} {_partners(e, members, me)}{algorithm}"
        if text == last:
            repeat += 1
        else:
            flush()
            last, repeat = text, 1
    flush()
    return lines


def explain_first_step(mesh, model, events, *, activation_shape=None, batch_shape=None,
                       state_bytes: dict | None = None, notes: list[str] | None = None) -> list[str]:
    """This rank's account of one step: heading, groups, what it holds, then the step's ``events``
    (trace events recorded during it). ``activation_shape`` (b, T, C) labels the calls that move
    activations; ``batch_shape`` is this rank's batch; ``state_bytes`` ({what: bytes}) its memory;
    ``notes`` more lines about the step (what offload moved)."""
    members = group_members(mesh)
    groups = [f"{name} = ranks {ranks}" for name, ranks in members.items()
              if len(ranks) > 1 and name != mesh.world.name]
    lines = [f"=== rank {mesh.rank}: {mesh.name} ===", "groups: " + ("; ".join(groups) or "none (one rank)")]
    if batch_shape is not None:
        lines.append(f"reads a batch of {tuple(batch_shape)} token ids")
        cp = getattr(model, "context_parallel", None)
        if cp is not None:
            T = batch_shape[1] - 1
            lines.append(f"computes on tokens {token_ranges(cp.chunks(T))} of each {T}-token "
                         f"sequence (context parallelism, {cp.algorithm})")
    lines += holdings(model, mesh.shape.tp, mesh.ep_rank, mesh.shape.ep) + routing(model, mesh)
    if state_bytes:
        lines.append("model states: " + ", ".join(f"{k} {_bytes(v)}" for k, v in state_bytes.items()))
    lines += notes or []
    itemsize = next(iter(model.parameters())).data.dtype.itemsize
    return lines + step_story(events, members, mesh.rank, activation_shape, itemsize)


def gather_lines(group, lines: list[str], dst: int = 0) -> list[list[str]] | None:
    """Every rank's ``lines`` on rank ``dst``, in rank order; None elsewhere. The text travels as
    UTF-8 bytes, one ``group.gather_bytes``."""
    gathered = group.gather_bytes("\n".join(lines).encode(), dst)
    if gathered is None:
        return None
    return [data.decode().split("\n") if data else [] for data in gathered]


def print_explanation(mesh, model, events, *, file=None, **details) -> None:
    """Collective over ``mesh.world``: gather every rank's :func:`explain_first_step` and print them
    on global rank 0, one block per rank (``details``: its keyword arguments)."""
    stories = gather_lines(mesh.world, explain_first_step(mesh, model, events, **details))
    if stories is not None:
        print("\n\n".join("\n".join(story) for story in stories), file=file or sys.stdout, flush=True)


@contextmanager
def explaining(mesh, model, *, file=None, **details):
    """Print the explanation of whatever the ``with`` block does (a tutorial's training step):
    every event ``mesh.world.trace`` records inside it, however few the trace keeps. Collective over
    ``mesh.world`` on exit."""
    with mesh.world.trace.capture() as events:
        yield
    print_explanation(mesh, model, events, file=file, **details)
