"""Bytes per rank: model states by the ZeRO paper, activations by Korthikanti et al. or by minidist's model.

Model states, per rank (Rajbhandari et al. 2020). Parameters and gradients in the model's dtype,
the optimizer's state (K bytes per parameter: AdamW's two moments, SGD's momentum, in float32 under
mixed precision, which adds the float32 masters; minidist/optim/state_bytes.py's table) as
``accounting.zero_formula`` splits them by stage.
Here they are counted exactly as minidist holds them: unit by unit (models.py), each ZeRO shard a
``numpy.array_split`` piece of its unit, so data-parallel rank 0 holds the longest pieces.

Activations of one layer and one micro-batch on one rank (s tokens per sequence on this rank, b
sequences, h hidden, a heads, t tensor-parallel ranks; bytes), two models:

    with dropout (Korthikanti et al. 2022, Table 2; 16-bit activations, 1-byte dropout masks)
        no parallelism              s b h (34 + 5 a s / h)
        tensor parallel             s b h (10 + 24 / t + 5 a s / (h t))
        + sequence parallel         s b h / t (34 + 5 a s / h)
        selective recompute         the 5 a s / h terms go (the attention core is recomputed)
        full recompute              2 s b h (the block's input; / t with sequence parallelism)

    without dropout (minidist's GPT: what its autograd saves, in the compute dtype), per layer
        LayerNorm x-hat, 2 LayerNorm outputs (Linear inputs)     4 s b h   replicated over tp
        q, k, v; attention output; GELU input and gate; GELU out 16 s b h / t   (with an MLP of 4h;
                                                                  its 12 scale with the width;
                                                                  k, v with the kv heads;
                                                                  SwiGLU keeps 4 of width F)
        attention probabilities                                  a s (s + 32) b / (2 t)
                                                                  (blocks of 32 queries, each over the
                                                                  keys up to its last one, when 32
                                                                  divides s; kept_probabilities)
        LayerNorm 1 / std                                        2 s b
    sequence parallelism cuts all but the two LayerNorm outputs (the column-parallel Linears save
    their all-gathered inputs); recompute keeps the block's input s b h; ring attention keeps its
    output and log-sum-exp (float32 under 16-bit) instead of the probabilities.

Context parallelism gives each rank s = seq / cp tokens (their queries still score every key of the
sequence where scores are kept: Ulysses' a / cp heads keep the whole sequence's blocks). A pipeline
rank holds a stage's activations from its forward to its backward (its W in a zero-bubble schedule)
for the micro-batches in flight: the schedule's own simulator says how many (``Timeline.peak_held``).
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

from minidist.autograd.attention import kept_probabilities
from minidist.inspect import accounting
from minidist.parallel.pipeline import build_schedule, placement_of, rank_stages, simulate
from minidist.optim.zero_stages import STAGES
from minidist.parallel.tensor.layout import padded_vocab_size
from minidist.optim.state_bytes import state_bytes_per_parameter
from minidist.plan.layout import RunSpec
from minidist.plan.models import ModelSpec, layers_per_stage, stage_units

FLOAT32 = 4


def zero_group(run: RunSpec, experts: bool) -> int:
    """The ranks ZeRO shards a unit over: dp x cp (they hold the same parameters), experts over the
    ranks holding the same experts (dp x cp / ep)."""
    return run.dp * run.cp // (run.ep if experts else 1)


def shard(numel: int, n: int, rank: int = 0) -> int:
    """Rank ``rank``'s piece of ``numpy.array_split(numel, n)``."""
    return numel // n + (rank < numel % n)


def rank_units(model: ModelSpec, run: RunSpec, pp_rank: int = 0) -> list[tuple[str, int, bool]]:
    """The ZeRO units pipeline rank ``pp_rank`` holds (every chunk's), on one tp rank."""
    return _rank_units(model, run.pp, run.virtual_stages, placement_of(run.schedule), run.tp, run.ep, pp_rank)


def rank_layers(model: ModelSpec, run: RunSpec, pp_rank: int = 0) -> list[int]:
    """The blocks pipeline rank ``pp_rank`` holds (every chunk's), by index."""
    counts = layers_per_stage(model, run.n_stages)
    return [layer for s in rank_stages(pp_rank, run.pp, run.virtual_stages, placement_of(run.schedule))
            for layer in range(sum(counts[:s]), sum(counts[:s + 1]))]


@lru_cache(maxsize=4096)
def _rank_units(model: ModelSpec, pp: int, virtual_stages: int, placement: str, tp: int, ep: int, pp_rank: int):
    counts = layers_per_stage(model, pp * virtual_stages)
    copy = model.tied and pp > 1
    return tuple(u for s in rank_stages(pp_rank, pp, virtual_stages, placement)
                 for u in stage_units(model, s, pp * virtual_stages, counts, tp, ep, head_copy=copy))


def optimizer_numel(model: ModelSpec, run: RunSpec, pp_rank: int = 0, dp_rank: int = 0) -> tuple[int, int]:
    """(elements of the units pipeline rank ``pp_rank`` holds, of which its ZeRO shards: each unit's
    ``dp_rank``-th piece; all of it without ZeRO)."""
    whole = sharded = 0
    for _, numel, experts in rank_units(model, run, pp_rank):
        whole += numel
        sharded += shard(numel, zero_group(run, experts), dp_rank) if run.zero else numel
    return whole, sharded


def model_state_bytes(model: ModelSpec, run: RunSpec, pp_rank: int = 0, dp_rank: int = 0) -> dict:
    """Bytes of parameters, gradients, float32 master weights and optimizer states that rank
    (``dp_rank`` of the ZeRO group, ``pp_rank``, any tp rank) holds after backward. With offload the
    optimizer shard (and ZeRO-3's parameter shards) move to ``host`` or ``disk`` as
    ``accounting.offload_formula`` says."""
    b, z = run.itemsize, run.zero
    whole, sharded = optimizer_numel(model, run, pp_rank, dp_rank)
    state = state_bytes_per_parameter(run.optimizer, run.dtype, run.mixed)  # masters and slots, per parameter
    shards = STAGES[z]  # what the stage shards (optim/zero_stages.py)
    held = {"parameters": (sharded if shards.parameters else whole) * b, "gradients": (sharded if shards.gradients else whole) * b,
            "master_weights": sharded * state["master_weights"], "optimizer_states": sharded * state["optimizer_states"]}
    if run.offload == "none":
        return held
    part = {"parameters": held["parameters"], "gradients": held["gradients"],
            "optimizer": held["master_weights"] + held["optimizer_states"]}
    moved = accounting.offload_formula(part, sharded * b, run.offload_to,
                                       params=run.offload == "optimizer,params", master_copy=not run.mixed)
    return {"parameters": moved["parameters"], "gradients": moved["gradients"], "master_weights": 0,
            "optimizer_states": 0, "host": moved["host"], "disk": moved["disk"]}


def layer_activation_terms(model: ModelSpec, run: RunSpec, layer: int = 0) -> list[tuple[str, float]]:
    """Layer ``layer``'s activations of one micro-batch on one rank, as (what, bytes) terms (module
    docstring); their sum is :func:`activation_bytes_per_layer`. An MoE layer's experts keep k rows
    a token (an even routing's; the real one varies by rank), each with its MLP's activations, and
    the router's probabilities and choices."""
    s, bsz, h, a, t = run.seq // run.cp, run.micro_batch_size, model.n_embd, model.n_head, run.tp
    sbh, sp = s * bsz * h, t if run.sequence_parallel else 1
    mlp = model.hidden / h  # 4 for GPT-2's MLP
    kv = model.kv_heads / model.n_head  # k and v are this much of q's width (grouped-query attention)
    if run.recompute == "full":
        return [("block input (the rest recomputed)", (2 if run.dropout else run.itemsize) * sbh / sp)]
    if run.dropout:  # Korthikanti et al., 2-byte activations and 1-byte masks
        terms = [("LayerNorm inputs", 4 * sbh / sp), ("QKV and MLP inputs", 4 * sbh / sp),
                 ("dropout masks after attention and MLP", 2 * sbh / sp),
                 ("Q, K, V and the projection's input", (4 + 4 * kv) * sbh / t),
                 ("MLP activation in and out", (4 + 4 * model.gated) * mlp * sbh / t)]
        core = [("softmax output, dropout mask and output", 5 * a * s * s * run.cp * bsz / t)]  # s/cp queries, s keys
    else:  # minidist's GPT: what its autograd saves, in the compute dtype
        b = run.itemsize
        terms = [("norm x-hat", 2 * b * sbh / sp), ("norm outputs (Linear inputs; gathered under SP)", 2 * b * sbh),
                 ("q, k, v and the attention output", (2 + 2 * kv) * b * sbh / t),
                 ("MLP hidden activations (" + ("gate, SiLU, up, product" if model.gated else "GELU's input, gate, output")
                  + ")", (3 + model.gated) * mlp * b * sbh / t),
                 *moe_terms(model, run, layer, b),
                 ("norm 1/std", 2 * b * s * bsz / sp)]
        if run.cp > 1 and run.cp_algorithm in ("ring", "zigzag"):
            acc = max(b, FLOAT32)  # ring attention's running output and log-sum-exp (float32 under 16-bit)
            core = [("ring attention output and log-sum-exp", acc * (sbh + a * s * bsz) / t)]
        else:
            keys = s * run.cp  # every key of the sequence (Ulysses: all tokens, a / cp heads)
            heads = a / t / (run.cp if run.cp_algorithm == "ulysses" and run.cp > 1 else 1)
            rows = keys if run.cp_algorithm == "ulysses" and run.cp > 1 else s
            core = [("attention probabilities", b * heads * kept_probabilities(rows, keys) * bsz)]
    return terms + ([] if run.recompute == "selective" else core)


def moe_terms(model: ModelSpec, run: RunSpec, layer: int, b: int) -> list[tuple[str, float]]:
    """What an MoE layer (minidist/moe.py) keeps beyond a dense one: k routed rows a token in and out,
    k - 1 more MLPs' activations, the router's probabilities (float) and choices (int64)."""
    if not model.is_moe(layer):
        return []
    tokens, k, mlp = run.seq // run.cp * run.micro_batch_size, model.top_k, model.hidden / model.n_embd
    rows = tokens * model.n_embd / run.tp
    return [("experts' rows in and out, k - 1 more MLPs", b * rows * (2 * k + 3 * mlp * (k - 1))),
            ("router probabilities and choices", tokens * (model.n_experts * b + 8 * k))]


def activation_bytes_per_layer(model: ModelSpec, run: RunSpec, layer: int = 0) -> float:
    """Layer ``layer``'s activation bytes for one micro-batch on one rank."""
    return sum(v for _, v in layer_activation_terms(model, run, layer))


def head_activation_bytes(model: ModelSpec, run: RunSpec) -> float:
    """The last stage's activations outside the blocks for one micro-batch (minidist's head): the
    logits' softmax (s b V / t, float32: the cross-entropy runs in float32); the final LayerNorm's
    x-hat, 1/std and output, cut like a block's; the targets and their mask, 9 bytes a token;
    under tensor parallelism one more (s b h) and one value per token (vocab-parallel
    cross-entropy)."""
    s, bsz, h, t = run.seq // run.cp, run.micro_batch_size, model.n_embd, run.tp
    sp = t if run.sequence_parallel else 1
    logits = s * bsz * padded_vocab_size(model.vocab_size, t) // t * max(run.itemsize, FLOAT32)
    norm = (s * bsz * h / sp + s * bsz * h + s * bsz / sp) * run.itemsize
    return logits + norm + 9 * s * bsz + (t > 1) * (s * bsz * h + s * bsz) * run.itemsize


def embedding_activation_bytes(model: ModelSpec, run: RunSpec) -> float:
    """The first stage's: the token ids (int64) its embedding lookup keeps, and the positions' (one
    sequence's) for learned positions."""
    s = run.seq // run.cp
    return 8 * s * run.micro_batch_size + 8 * s * (model.positions == "learned")


def stage_weights(model: ModelSpec, run: RunSpec) -> dict[int, float]:
    """Per global stage, the activation bytes one micro-batch leaves there (its blocks, the head)."""
    counts = layers_per_stage(model, run.n_stages)
    first = [sum(counts[:s]) for s in range(run.n_stages)]
    per_layer = [activation_bytes_per_layer(model, run, i) for i in range(model.n_layer)] if model.n_experts else None
    dense = activation_bytes_per_layer(model, run)
    head, embed = head_activation_bytes(model, run), embedding_activation_bytes(model, run)
    blocks = [sum(per_layer[first[s]:first[s] + counts[s]]) if per_layer else counts[s] * dense for s in range(run.n_stages)]
    return {s: blocks[s] + (head if s == run.n_stages - 1 else 0) + (embed if s == 0 else 0) for s in range(run.n_stages)}


@lru_cache(maxsize=256)
def pipeline_schedule(name: str, pp: int, micro_batches: int, virtual_stages: int):
    """(the schedule as the trainer builds it, its simulated timeline at unit costs); the trainer
    validates it before it runs, and tests/test_pipeline_schedules.py every schedule's shape."""
    schedule = build_schedule(name, pp, micro_batches, virtual_stages)
    return schedule, simulate(schedule, pp, 1.0, 2.0, 1.0, placement_of(name))


def activation_bytes(model: ModelSpec, run: RunSpec) -> list[float]:
    """Per pipeline rank, the peak activation bytes it holds: one micro-batch's without a pipeline
    (gradient accumulation frees each before the next), else the schedule's in-flight ones. The same
    for every ZeRO stage, optimizer and offload (a search asks once for all of them)."""
    return list(_activation_bytes(model, dataclasses.replace(run, zero=0, optimizer="adamw", offload="none",
                                                             offload_to="host")))


@lru_cache(maxsize=4096)
def _activation_bytes(model: ModelSpec, run: RunSpec) -> tuple[float, ...]:
    weights = stage_weights(model, run)
    if run.pp == 1:
        return (weights[0],)
    _, timeline = pipeline_schedule(run.schedule, run.pp, run.micro_batches, run.virtual_stages)
    return tuple(timeline.peak_held(weights.__getitem__))  # its held counts computed once per schedule


def working_bytes(model: ModelSpec, run: RunSpec, pp_rank: int = 0) -> float:
    """Buffers that live only while a unit is worked on: ZeRO-3 gathers a whole block's parameters
    (two: the one computing and the next, prefetched), and in a pipeline keeps every unit of the
    rank gathered from its first forward to its last backward (``reshard_after_forward=False``);
    ZeRO-2 and 3 hold a block's full gradient until its reduce-scatter."""
    units = rank_units(model, run, pp_rank)
    block = max((n for name, n, _ in units if ".h." in name), default=0) * run.itemsize
    gathered = sum(n for _, n, _ in units) * run.itemsize if run.pp > 1 else 2 * block
    return gathered * STAGES[run.zero].parameters + block * STAGES[run.zero].gradients


def per_rank_bytes(model: ModelSpec, run: RunSpec) -> list[dict]:
    """Per pipeline rank: model states, activations, ZeRO's working buffers and the device total."""
    acts = activation_bytes(model, run)
    rows = []
    for r in range(run.pp):
        held = model_state_bytes(model, run, r)
        held["activations"] = acts[r]
        held["buffers"] = working_bytes(model, run, r)
        held["total"] = sum(v for k, v in held.items() if k not in ("host", "disk"))
        rows.append(held)
    return rows
