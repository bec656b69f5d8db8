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
import difflib
import re
import sys
from contextlib import contextmanager

import numpy as np

from minidist.inspect.accounting import axis_of
from minidist.inspect.spans import is_module_span
from minidist.parallel.context.ring_attention import token_ranges
from minidist.parallel.tensor.layout import ep_block, is_expert, tp_layout
from minidist.parallel.tensor.model import full_shape


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
    if ranks == [me]:
        return f"on {e.group} (this rank alone: nothing sent)"
    return f"on {e.group}" + (f" with rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}" if others else "")


def _what(e, span, pipeline_op) -> str:
    """What an activation-sized call carries. A pipeline message is an activation when it belongs to
    a forward (sent after one, ``pipeline_op``, or received before one), else a gradient: the
    direction between ranks does not say it, as ZB-V's second chunk sends activations to lower
    ranks. A collective inside a backward span moves activation gradients, elsewhere activations."""
    if e.kind == "p2p" and pipeline_op is not None:
        return "activation" if pipeline_op == "forward" else "gradient"
    return "gradient" if span is not None and span.op == "backward" else "activation"


CROSS_ENTROPY = ("max logit", "sum of exp(logit - max)", "target logit")  # vocab_parallel.py's 3 all-reduces


def purpose(e, pass_: str | None, module: str | None, k: int, n: int, act_bytes: int | None,
            stage_op=None) -> tuple[str, str]:
    """Why a call was made, as (what, where): derived from its op, its group's mesh axis
    (``accounting.axis_of``), its size and where in the step it ran. ``pass_``: the compute span it
    started in (forward, backward, weight, optimizer; None: between them); ``module``: the module span
    (module_spans.py) it started in; ``k`` of ``n``: its place among the same module span's tp calls
    (which tells attn from mlp and the cross-entropy's three all-reduces apart); ``stage_op``: for a
    pipeline message, the stage span it belongs to. These are the step's rules, one place: a call
    that fits none gets its axis and op."""
    axis, op, small = axis_of(e.group), e.op, e.nbytes <= 16
    where = module or ""
    if e.group.endswith("/embedding"):
        return "tied embedding grad sum: the first stage's wte + the last stage's lm_head", ""
    if axis == "world":
        return ("found-inf flag: an inf/NaN on any rank skips the step everywhere" if small
                else f"{op} over the world"), ""
    if op.startswith("ring sendrecv"):
        return f"ring attention: the next {op.split()[-1]} block around the cp ring", where
    if e.kind == "p2p" and axis == "pp" and stage_op is not None:
        send, forward = "send" in op, stage_op.op == "forward"  # activations flow up the stages, gradients down
        way = ("to the next" if send else "from the previous") if forward else ("to the previous" if send else "from the next")
        return f"pipeline: micro-batch {stage_op.seq}'s {'activation' if forward else 'gradient'} {way} stage", ""
    if axis == "tp":
        if pass_ == "forward":
            if module == "embedding":
                return ("vocab-parallel embedding: sum of the tp ranks' vocabulary-shard lookups" if op == "all_reduce"
                        else f"vocab-parallel embedding: {op} over the sequence (SP)"), ""
            if module == "head":
                if op == "all_reduce" and e.nbytes != act_bytes and k < 3:
                    return f"vocab-parallel cross-entropy {k + 1}/3: {CROSS_ENTROPY[k]}", ""
                return f"SP {op} before the vocab-parallel lm_head: the whole sequence", ""
            if module is not None and module.startswith("h."):
                sub = "attn" if k < n / 2 else "mlp"
                return {"all_reduce": "TP g all-reduce: sum of the row-parallel c_proj's partial outputs",
                        "all_gather": "SP all-gather: the whole sequence for the column-parallel input",
                        "reduce_scatter": "SP reduce-scatter: c_proj's partial outputs summed, my tokens kept",
                        }.get(op, f"tp {op}"), f"{module} {sub}"
        if pass_ in ("backward", "weight"):
            if module == "head":
                return {"all_reduce": "TP f all-reduce: gradient of the vocab-parallel lm_head's input",
                        }.get(op, f"SP {op}: gradient of the head's input"), ""
            if module == "embedding":
                return f"SP {op}: gradient of the embeddings", ""
            if module is not None and module.startswith("h."):
                sub = "mlp" if k < n / 2 else "attn"  # backward runs the block in reverse
                return {"all_reduce": "TP f all-reduce: gradient of the column-parallel input",
                        "reduce_scatter": "SP reduce-scatter: gradient of the gathered sequence",
                        "all_gather": "SP all-gather: gradient of the scattered output",
                        }.get(op, f"tp {op}"), f"{module} {sub}"
        if small:
            return "grad-norm² sum over tp (clipping: each shard counted once)", ""
        return "SP: sum of the replicated LayerNorm / bias gradients over tp", ""
    if axis == "dp":
        if op == "all_reduce":
            if e.nbytes <= 8:
                return "loss average over dp", ""
            if small:
                return "grad-norm² partial sums over dp (ZeRO's gradient shards)", ""
            return "DP gradient bucket: averaged over dp", "bucket {}"
        if op == "reduce_scatter":
            return "ZeRO reduce-scatter of gradients: my shard of their average", "bucket {}"
        if op == "all_gather":
            if pass_ in ("forward", "backward"):
                return "ZeRO-3 all-gather of parameters for use", where
            return "ZeRO all-gather of the updated parameter shards", ""
        if op == "broadcast":
            return "the initial parameters from dp rank 0", ""
    if axis == "pp":
        if op == "broadcast":
            return "the mean loss, from the last stage to every stage", ""
        if op == "all_reduce" and small:
            return "grad-norm² sum over pp (clipping: every stage's share)", ""
    if axis == "cp":
        if op == "all_reduce" and small:
            return "loss average over cp", ""
        if op == "all_to_all":
            return "Ulysses all-to-all: sequence shards <-> head shards", where
        if op == "all_gather":
            return "context parallelism: every cp rank's part of the sequence", where
    if axis == "ep":
        if op == "all_to_all":
            return "MoE all-to-all: token rows to / from the experts' ranks", where
        if op == "all_reduce" and small:
            return "grad-norm² of the experts over ep", ""
    return f"{axis} {op}", where


def _enclosing(spans, e):
    """The last of ``spans`` (sorted by start) that was open when ``e`` started, or None."""
    found = None
    for s in spans:
        if s.start > e.start:
            break
        if e.start <= s.end:
            found = s
    return found


def step_story(events, members: dict[str, list[int]], me: int, activation_shape=None, itemsize: int = 4) -> list[str]:
    """The events of one step as lines, in start order: a compute span as a heading, each call made
    inside it (or under ``after <span>:``, once it ended) as ``op bytes [shape] group partners
    (algorithm) — purpose [where]`` (:func:`purpose`); consecutive calls that differ only in where
    fold into ``k x``, their places listed. A call of exactly ``activation_shape`` x ``itemsize``
    bytes is labelled with that shape and with what it carries (:func:`_what`). Module spans
    (module_spans.py) are not headings: they say where a call ran."""
    act_bytes = int(np.prod(activation_shape)) * itemsize if activation_shape is not None else None
    lines, span = [], None  # span: the last compute event, while not yet left
    last, wheres = None, []  # the call line being folded and the places of its calls

    def flush():
        if last is not None:
            text, what = last
            places = [w for w in wheres if w]
            repeat = "  " if len(wheres) == 1 else f"  {len(wheres)} x "
            lines.append(f"{repeat}{text} — {what}" + (f" [{', '.join(places)}]" if places else ""))

    hop = None  # the last ring hop span (ring attention): its own isend / irecv are told by it
    ordered = sorted(events, key=lambda e: e.start)
    modules = [e for e in ordered if is_module_span(e)]
    passes = [e for e in ordered if e.kind == "compute" and not is_module_span(e)]
    stage_spans = [e for e in passes if e.group.startswith("stage")]
    stage_starts = [e.start for e in stage_spans]

    def stage_of(e):  # the stage computation a message belongs to: the one before a send, after a receive
        i = bisect.bisect_right(stage_starts, e.start)  # stage_spans[:i] started by then
        before, after = stage_spans[i - 1:i], stage_spans[i:i + 1]
        near = (before if "send" in e.op else after) or before or after
        return near[0] if near else None

    tp_calls: dict[int, list] = {}  # id(module span) -> its tp collectives, in order
    context = {}
    for e in ordered:
        if e.kind == "compute":
            continue
        pass_span = _enclosing(passes, e)
        module = _enclosing([m for m in modules if pass_span is None or m.algorithm == pass_span.op], e)
        context[id(e)] = (pass_span, module)
        if module is not None and e.kind == "collective" and axis_of(e.group) == "tp":
            tp_calls.setdefault(id(module), []).append(e)
    counters: dict[str, int] = {}
    for e in ordered:
        if e.op.startswith("ring sendrecv"):
            hop = e
        elif hop is not None and e.op in ("isend", "irecv") and e.group == hop.group and e.start <= hop.end:
            continue
        if is_module_span(e):
            continue
        if e.kind == "compute":
            flush()
            last, wheres = None, []
            stage = f" micro-batch {e.seq} of {e.group}" if e.group.startswith("stage") else ""
            heading = f"{e.op}{stage}  {1e3 * e.duration:.1f} ms"
            lines.append(heading)
            span = e
            continue
        if span is not None and e.start >= span.end:  # outside the span: say so once
            flush()
            last, wheres = None, []
            if lines[-1] == heading:  # nothing inside it: "forward ... ms, then:"
                lines[-1] += ", then:"
            else:
                lines.append(f"after {span.op}:")
            span = None
        pass_span, module = context[id(e)]
        calls = tp_calls.get(id(module), [])
        k = next((i for i, c in enumerate(calls) if c is e), 0)
        stage = stage_of(e)
        what, where = purpose(e, pass_span.op if pass_span is not None else None,
                              module.op if module is not None else None, k, len(calls), act_bytes, stage)
        if "{}" in where:  # numbered per step: DP buckets, ZeRO's reduce-scatters
            counters[what] = counters.get(what, 0) + 1
            where = where.format(counters[what])
        shape = f" {tuple(activation_shape)} {_what(e, span, stage.op if stage else None)}" if e.nbytes == act_bytes else ""
        algorithm = f" ({e.algorithm})" if e.algorithm else ""
        text = (f"{e.op} {_bytes(e.nbytes)}{shape} {_partners(e, members, me)}{algorithm}", what)
        if text == last:
            wheres.append(where)
        else:
            flush()
            last, wheres = text, [where]
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


_RANK_SPECIFIC = [  # what differs between ranks that play the same part: group names, partners, times
    (re.compile(r"\b(\w+)\[[^\]]*\]"), r"\1[.]"),
    (re.compile(r"with ranks? [\d, ]+"), "with ."),
    (re.compile(r"\b(to|from) rank \d+"), r"\1 rank ."),
    (re.compile(r"\d+\.\d ms"), ". ms"),
]


def _same_part(line: str) -> str:
    """``line`` with its rank-specific words blanked: two ranks that play the same part in the step
    (tp rank 1 of dp replica 0 and of replica 1) tell the same blanked story."""
    for pattern, blank in _RANK_SPECIFIC:
        line = pattern.sub(blank, line)
    return line


def differences(story: list[str], like: list[str], rank: int = 0) -> list[str]:
    """``story`` (a rank's lines after its heading and groups) told against ``like`` (rank ``rank``'s):
    one line when they match but for the ranks' own groups, partners and times, else only the lines
    that differ (difflib's opcodes on the blanked lines): ``~`` this rank's version of a line of
    ``rank``'s in the same place, ``+`` a line only this rank has, ``-`` one only ``rank`` has."""
    a, b = [_same_part(line) for line in like], [_same_part(line) for line in story]
    out = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "replace" and i2 - i1 == j2 - j1:
            out += [f"~ {line}" for line in story[j1:j2]]
        elif tag != "equal":
            out += [f"- {line}" for line in like[i1:i2]] + [f"+ {line}" for line in story[j1:j2]]
    if not out:
        return [f"the same step as rank {rank}, with its own groups and partners (above)"]
    return [f"as rank {rank}, with its own groups and partners (above), except (~: this rank's version of "
            f"rank {rank}'s line, +: only here, -: only on rank {rank}):"] + out


def format_stories(stories: list[list[str]]) -> str:
    """Every rank's story as printed: rank 0's whole; each other rank's heading, groups and its
    :func:`differences` from the most alike story printed whole before it, or its whole story when
    less than half of it is alike (another pipeline stage: a story of its own)."""
    blocks, whole = [], {}  # whole: rank -> its blanked body, for the stories printed whole
    for rank, story in enumerate(stories):
        body = [_same_part(line) for line in story[2:]]
        alike = {r: difflib.SequenceMatcher(None, b, body, autojunk=False).ratio() for r, b in whole.items()}
        best = max(alike, key=alike.get, default=None)
        if best is None or alike[best] < 0.5:
            whole[rank] = body
            blocks.append("\n".join(story))
        else:
            blocks.append("\n".join(story[:2] + differences(story[2:], stories[best][2:], best)))
    return "\n\n".join(blocks)


def print_explanation(mesh, model, events, *, file=None, **details) -> None:
    """Collective over ``mesh.world``: gather every rank's :func:`explain_first_step` and print them
    on global rank 0: rank 0's whole, then per other rank what differs from an alike one
    (:func:`format_stories`;
    ``details``: :func:`explain_first_step`'s keyword arguments)."""
    stories = gather_lines(mesh.world, explain_first_step(mesh, model, events, **details))
    if stories is not None:
        print(format_stories(stories), file=file or sys.stdout, flush=True)


@contextmanager
def explaining(mesh, model, *, file=None, **details):
    """Print the explanation of whatever the ``with`` block does (a tutorial's training step):
    every event ``mesh.world.trace`` records inside it, however few the trace keeps. Collective over
    ``mesh.world`` on exit."""
    with mesh.world.trace.capture() as events:
        yield
    print_explanation(mesh, model, events, file=file, **details)
