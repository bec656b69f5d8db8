"""``--explain``: what every rank holds and sends in one training step, in words.

After the first step each rank turns its own view into lines of text: its place in the mesh and
its groups, the parameters it holds (shards with their full shapes; under ZeRO-3 the elements it
keeps between uses), and its trace of the step in order (compute spans, and under them every
collective and message: bytes, group, partners, and why, as the label its call site gave it:
``<purpose>: <what>``, the purposes of ``comm.trace.PURPOSES``; nothing is guessed from sizes).
train/stories.py gathers the stories to rank 0, which prints them by rank, so 8 ranks read as 8
short stories rather than interleaved output:

    === rank 1: DP(0)-PP(0)-TP(1)-Rank(1) ===
    groups: tp[dp0,pp0] = ranks [0, 1]; dp[pp0,tp1] = ranks [1, 3]
    holds transformer.h.{0,1}.attn.c_attn.weight   (96, 64) qkv shard of (192, 64)
    forward  3.1 ms
      4 x all_reduce 64.0 KiB on tp[dp0,pp0] with rank 0 (doubling) — activation: ... [during h.0, h.0, h.1, h.1]
"""
from __future__ import annotations

import itertools
import re

import numpy as np

from minidist.inspect.spans import is_module_span
from minidist.parallel.context.ring_attention import token_ranges
from minidist.parallel.tensor.layout import ep_block, full_shape, is_expert, tp_layout


def _bytes(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB" if n < 2**20 else f"{n / 2**20:.1f} MiB"


def group_members(mesh) -> dict[str, list[int]]:
    """{group name: its global ranks, in group-rank order} for this rank's world and axis groups, and
    with a pipeline its embedding group (the first and the last stage's ranks, where a pipeline sums
    its tied embedding's copies: ``pipeline/tied_embeddings.py``)."""
    s = mesh.shape
    d, p, c, t = mesh.dp_rank, mesh.pp_rank, mesh.cp_rank, mesh.tp_rank
    experts = {}
    if mesh.ep_group is not None:
        block = d - d % s.ep
        experts = {mesh.ep_group.name: [s.rank_of(block + i, p, t, c) for i in range(s.ep)],
                   mesh.expert_dp_group.name: [s.rank_of(i * s.ep + d % s.ep, p, t, j)
                                               for i in range(s.dp // s.ep) for j in range(s.cp)]}
    pp = [s.rank_of(d, i, t, c) for i in range(s.pp)]
    tied = {f"{mesh.pp_group.name}/embedding": [pp[0], pp[-1]]} if s.pp > 1 else {}  # first and last stage's ranks
    return experts | {mesh.world.name: list(range(s.world)),
            mesh.tp_group.name: [s.rank_of(d, p, i, c) for i in range(s.tp)],
            mesh.cp_group.name: [s.rank_of(d, p, t, i) for i in range(s.cp)],
            mesh.pp_group.name: pp,
            mesh.dp_group.name: [s.rank_of(i, p, t, c) for i in range(s.dp)],
            mesh.dp_cp_group.name: [s.rank_of(i, p, t, j) for i in range(s.dp) for j in range(s.cp)]} | tied


def _machines_of(machines, ranks) -> str:
    """`` (inside machine 1)`` or `` (across machines 0, 1)`` when the job spans several machines, else nothing."""
    if machines.count == 1:
        return ""
    spanned = machines.spanned(ranks)
    return f" (inside machine {spanned[0]})" if len(spanned) == 1 else f" (across machines {', '.join(map(str, spanned))})"


def _zero3_held(shards) -> dict[int, tuple[tuple, int, int]]:
    """{id(parameter): (its shape, first, last + 1 of its flattened elements this rank holds)} for
    the parameters of ZeRO-3 ``shards`` (each ``.unit``: a flat vector of ``params`` whose elements
    [lo, hi) are this rank's); a parameter outside this rank's range is absent."""
    held = {}
    for s in shards:
        start = 0
        for (_, p), shape in zip(s.unit.params, s.unit.shapes):
            end = start + int(np.prod(shape))
            first, last = max(start, s.unit.lo), min(end, s.unit.hi)
            if last > first:
                held[id(p)] = (tuple(shape), first - start, last - start)
            start = end
    return held


def holdings(model, tp_size: int, ep_rank: int = 0, ep_size: int = 1, shards=None) -> list[str]:
    """One line per parameter of ``model`` (blocks folded: ``h.{0,1}``): its shape on this rank
    and, when tensor parallelism cuts it, which shard of which full shape (tensor/layout.py's table: the
    vocabulary's full shape has ``model.config.vocab_size`` rows, its padding is not part of it);
    when expert parallelism cuts it (ep rank ``ep_rank`` of ``ep_size``), which experts; a
    pipeline stage's copy of the tied embedding says so. With ZeRO-3's ``shards`` (the parameters
    are released between uses) the lines say which elements of each parameter this rank keeps, and
    leave out the parameters other dp ranks keep."""
    held = _zero3_held(shards) if shards is not None else None
    copies = {name for name, p in model.named_parameters() if p.tied_copy}
    folded: dict[tuple, list[str]] = {}  # (name with h.{}, shape held, what) -> its blocks
    for name, p in model.named_parameters():
        if held is not None and id(p) not in held:
            continue
        shape, first, last = held[id(p)] if held is not None else (p.data.shape, 0, p.data.size)
        key, generic = re.sub(r"\.h\.\d+\.", ".h.{}.", name), re.sub(r"\.h\.\d+\.", ".h.0.", name)
        layout = tp_layout(generic) if tp_size > 1 else "replicated"
        what = []  # how ZeRO-3 and tp cut it, then which experts ep gives it; none of them: "whole"
        if held is not None:
            what.append(f"ZeRO-3 shard: elements {first}-{last - 1} of {shape}")
        if layout != "replicated":
            what.append(f"{layout} shard of {full_shape(generic, shape, model.config, tp_size)}")
        elif tp_size > 1:
            what.append("copy")
        if ep_size > 1 and is_expert(generic):
            block = ep_block(model.config.n_experts, ep_rank, ep_size)
            what.append(f"experts {block.start}-{block.stop - 1} of {model.config.n_experts} (ep)")
        if name in copies:  # a pipeline's copy of the tied embedding, summed with it after backward
            what.append("tied copy of transformer.wte.weight")
        here = (last - first,) if held is not None else shape
        block = re.search(r"\.h\.(\d+)\.", name)
        folded.setdefault((key, str(here), ", ".join(what) or "whole"), []).append(block.group(1) if block else "")
    return [f"holds {key.replace('{}', '{' + ','.join(blocks) + '}'):<42} {here:<12} {what}"
            for (key, here, what), blocks in folded.items()]


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
    if ranks == [me]:
        return f"on {e.group}, this rank alone (nothing sent)"
    return f"on {e.group}" + (f" with rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}" if others else "")


def label_text(e) -> str:
    """What a call's label says, "<purpose>: <what>", as its call site gave it; "(unlabelled)" when
    the call site gave none."""
    return e.label or "(unlabelled)"


def _outermost(spans):
    """Those of ``spans`` (sorted by start) inside no other of them: the step's passes (forward,
    backward, optimizer, a pipeline's per micro-batch ones), not the spans a pass records inside
    itself (an MoE layer's "moe dispatch")."""
    found = []
    for s in spans:
        if not found or s.start > found[-1].end or s.end > found[-1].end:
            found.append(s)
    return found


def _enclosing(spans, e):
    """The last of ``spans`` (sorted by start) that was open when ``e`` started, or None."""
    found = None
    for s in spans:
        if s.start > e.start:
            break
        if e.start <= s.end:
            found = s
    return found


def step_story(events, members: dict[str, list[int]], me: int) -> list[str]:
    """The events of one step as lines, in start order: each pass (a compute span inside no other) as
    a heading, each call made inside it (or under ``after <span>:``, once it ended; ``before its
    first compute:`` before any) as ``op bytes group partners (algorithm) — label [during module
    spans]`` (:func:`label_text`: the purpose its call site gave; a group of this rank alone sends
    nothing and names no algorithm); consecutive calls that differ only in the module span
    (inspect/spans.py) they were made during fold into ``k x``, those modules listed (``h.0 (2)``:
    twice during h.0). Module spans, and the spans a pass records inside itself (an MoE layer's
    dispatch), are not headings: they say when a call was made (a prefetch made during h.0 may fetch
    h.1: its label says what it moves)."""
    lines, span, heading = [], None, None  # span: the last compute event, while not yet left
    last, wheres = None, []  # the call line being folded and the module spans of its calls

    def flush():
        if last is not None:
            places = [(w, len(list(run))) for w, run in itertools.groupby(w for w in wheres if w)]
            repeat = "  " if len(wheres) == 1 else f"  {len(wheres)} x "
            during = ", ".join(w if n == 1 or len(places) == 1 else f"{w} ({n})" for w, n in places)
            lines.append(f"{repeat}{last}" + (f" [during {during}]" if places else ""))

    hop = None  # the last ring hop span (ring attention): its own isend / irecv are told by it
    ordered = sorted(events, key=lambda e: e.start)
    modules = [e for e in ordered if is_module_span(e)]
    passes = _outermost([e for e in ordered if e.kind == "compute" and not is_module_span(e)])
    top = {id(p) for p in passes}
    for e in ordered:
        if e.kind == "data":  # a read from disk, not a call (train/feed.py)
            continue
        if e.op.startswith("ring sendrecv"):
            hop = e
        elif hop is not None and e.op in ("isend", "irecv") and e.group == hop.group and e.start <= hop.end:
            continue
        if is_module_span(e) or (e.kind == "compute" and id(e) not in top):  # a span inside a pass: its calls
            continue                                                           # are told under the pass
        if e.kind == "compute":
            flush()
            last, wheres = None, []
            stage = f" micro-batch {e.seq} of {e.group}" if e.group.startswith("stage") else ""
            heading = f"{e.op}{stage}  {1e3 * e.duration:.1f} ms"
            lines.append(heading)
            span = e
            continue
        if not lines:  # a call before any compute (a pipeline stage waiting for its first input)
            lines.append("before its first compute:")
        if span is not None and e.start >= span.end:  # outside the span: say so once
            flush()
            last, wheres = None, []
            if lines[-1] == heading:  # nothing inside it: "forward ... ms, then:"
                lines[-1] += ", then:"
            else:
                lines.append(f"after {span.op}:")
            span = None
        pass_span = _enclosing(passes, e)
        module = _enclosing([m for m in modules if pass_span is None or m.algorithm == pass_span.op], e)
        alone = members.get(e.group) == [me]  # a group of one rank: no algorithm ran
        algorithm = f" ({e.algorithm})" if e.algorithm and not alone else ""
        text = f"{e.op} {_bytes(e.nbytes)} {_partners(e, members, me)}{algorithm} — {label_text(e)}"
        if text == last:
            wheres.append(module.op if module is not None else "")
        else:
            flush()
            last, wheres = text, [module.op if module is not None else ""]
    flush()
    return lines


def zero_line(stage: int, shards) -> str:
    """What ZeRO stage ``stage`` (1-3) keeps of ``shards`` (a ZeroOptimizer's) on this rank, in one
    line: which states are cut, over which groups, and how many elements of how many units."""
    what = {1: "optimizer state", 2: "gradients and optimizer state",
            3: "parameters, gradients and optimizer state"}[stage]
    groups = {s.group.name: s.group.size for s in shards}
    over = ", ".join(f"{name} ({size} rank{'s' if size > 1 else ''})" for name, size in groups.items())
    kept, total = sum(s.unit.hi - s.unit.lo for s in shards), sum(s.unit.numel for s in shards)
    line = (f"ZeRO-{stage}: this rank keeps its shard of each unit's {what}, {kept:,} of the {total:,} elements of "
            f"its {len(shards)} units (shards over {over})")
    if stage == 3:
        return line + "; between uses it holds only these parameter elements (below), each use all-gathers a unit"
    return line + ("; its parameters and gradients stay whole (below)" if stage == 1 else
                   "; its parameters stay whole (below)")


def explain_first_step(mesh, model, events, *, batch_shape=None, state_bytes: dict | None = None,
                       notes: list[str] | None = None, shards=None, zero=None) -> list[str]:
    """This rank's account of one step: heading, groups, what it holds, then the step's ``events``
    (trace events recorded during it, each call told by its label). ``batch_shape`` is this rank's
    batch; ``state_bytes`` ({what: bytes}) its memory; ``notes`` more lines about the step (what
    offload moved); ``shards``: ZeRO-3's shards, whose parameters this rank keeps only in part;
    ``zero``: (stage, a ZeroOptimizer's shards), said in one line (:func:`zero_line`)."""
    members = group_members(mesh)
    used = {e.group for e in events}
    groups = [f"{name} = ranks {ranks}{_machines_of(mesh.machines, ranks)}" for name, ranks in members.items()
              if len(ranks) > 1 and name != mesh.world.name and (not name.endswith("/embedding") or name in used)]
    lines = [f"=== rank {mesh.rank}: {mesh.name} ===", "groups: " + ("; ".join(groups) or "none (one rank)")]
    if mesh.machines.count > 1:
        m = mesh.machines
        lines[1:1] = [f"on machine {m.of_rank[mesh.rank]} of {m.count}, local rank {m.local_rank(mesh.rank)} of "
                      f"{m.local_size(mesh.rank)}"] + mesh.machine_lines()[1:]  # [1:]: the warning, if any
    if batch_shape is not None:
        lines.append(f"reads a batch of {tuple(batch_shape)} token ids")
        cp = getattr(model, "context_parallel", None)
        if cp is not None:
            T = batch_shape[1] - 1
            lines.append(f"computes on tokens {token_ranges(cp.chunks(T))} of each {T}-token "
                         f"sequence (context parallelism, {cp.algorithm})")
    if zero is not None and zero[0] > 0:
        lines.append(zero_line(*zero))
    lines += holdings(model, mesh.shape.tp, mesh.ep_rank, mesh.shape.ep, shards) + routing(model, mesh)
    if state_bytes:
        lines.append("model states: " + ", ".join(f"{k} {_bytes(v)}" for k, v in state_bytes.items()))
    return lines + (notes or []) + step_story(events, members, mesh.rank)
