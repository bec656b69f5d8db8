"""Bytes each rank sends per step, per mesh axis: minidist's own collectives, counted as the trace counts them.

Every count is nccl-tests' bus bytes (``accounting.sent_bytes``): of an all-reduce of N bytes on n
ranks each rank sends 2 (n-1)/n N; of a reduce-scatter (its input) or all-gather (its output)
(n-1)/n N; of a point-to-point message, its bytes. With X = one micro-batch's activation
(b, s, h) on this rank (s = seq / cp) and P the parameters this rank holds:

    dp   gradients: all-reduce of P (ZeRO-0), reduce-scatter of P + all-gather of P (ZeRO-1, 2),
         ZeRO-3 all-gathers each unit for every forward and backward use instead (1.5x; a pipeline
         keeps units gathered for the whole step: one all-gather); over dp x cp ranks, the experts'
         units over dp x cp / ep; the loss (8 bytes) and with ZeRO the gradient norm's pieces
    tp   per layer 2 all-reduces of X forward and 2 backward (Megatron's f and g), with sequence
         parallelism an all-gather and a reduce-scatter for each; the embedding's and the head's one
         each; an MoE layer's experts reduce k rows a token, and its router's logits are gathered; the vocab-parallel cross-entropy's 3 all-reduces of (b, s); sequence-parallel
         parameters' gradients; the gradient norm
    pp   each micro-batch's activation to the next stage and its gradient back (X, / tp under
         sequence parallelism), for every stage boundary between ranks; the tied embedding's
         gradient between the first and last stage; the loss broadcast; the gradient norm
    cp   ring attention: per layer K and V to the next rank cp - 1 times forward and again
         backward, and their gradients cp times; Ulysses: four all-to-alls of X per layer forward,
         four backward; one 4-byte all-reduce
    ep   per MoE layer two all-to-alls of the routed tokens forward and two backward (an even
         routing's; the real one varies by rank) and one of the counts; the experts' gradient norm
    world  under mixed precision, whether any rank's gradients overflowed (8 bytes)

Two counts are averages over ranks: the experts' all-to-alls (an even routing's rows) and, under ZeRO
with sequence parallelism, the norms' gradient elements in each rank's shards (where the shard
boundaries fall decides each rank's share; the ZeRO group's mean is exact).

Full recompute runs each block's forward again inside its backward, with the forward's tp, cp and
ep traffic.

ZeRO-2 and 3 reduce-scatter after every micro-batch's backward, unless a pipeline defers the
gradient sync to the last one (``no_sync``); ZeRO-3 then also re-gathers per micro-batch.
"""
from __future__ import annotations

from minidist.parallel.pipeline import placement_of, rank_stages, stage_rank
from minidist.optim.zero_stages import STAGES
from minidist.parallel.tensor.layout import padded_vocab_size
from minidist.plan.layout import RunSpec
from minidist.plan.memory import rank_layers, rank_units, shard, zero_group
from minidist.plan.models import ModelSpec

AXES = ("dp", "tp", "pp", "cp", "ep", "world")
SCALAR = 8  # the loss, a norm: one float64


def all_reduce(nbytes: float, n: int) -> float:
    return 2 * (n - 1) / n * nbytes


def one_way(nbytes: float, n: int) -> float:
    """A reduce-scatter of ``nbytes`` (input), an all-gather (output) or an all-to-all (input)."""
    return (n - 1) / n * nbytes


def activation(model: ModelSpec, run: RunSpec) -> float:
    """X: one micro-batch's (b, s, h) on this rank, s = seq / cp, in the compute dtype."""
    return run.micro_batch_size * run.seq // run.cp * model.n_embd * run.itemsize


def dp_parts(model: ModelSpec, run: RunSpec, pp_rank: int = 0) -> dict:
    """The data-parallel bytes of pipeline rank ``pp_rank`` per step, by what they are for:
    ``reduce`` (the gradients' all-reduce or reduce-scatters), ``gather`` (ZeRO's all-gathers of
    parameters) and ``scalars`` (the loss; with ZeRO the norm's two pieces)."""
    b, parts = run.itemsize, {"reduce": 0.0, "gather": 0.0}
    every = run.micro_batches if run.pp == 1 else 1  # ZeRO-2, 3 without a pipeline: per micro-batch
    for name, numel, experts in rank_units(model, run, pp_rank):
        n = zero_group(run, experts)
        if run.zero == 0:
            parts["reduce"] += all_reduce(numel * b, n)
            continue
        parts["reduce"] += (every if STAGES[run.zero].gradients else 1) * one_way(numel * b, n)
        uses = 1
        if STAGES[run.zero].parameters and run.pp == 1:  # gathered for forward and again for backward (a pipeline keeps them)
            uses = every * (2 + (model.tied and name == "transformer.wte"))  # the head gathers the tied matrix again
        parts["gather"] += uses * one_way(numel * b, n)
    parts["scalars"] = all_reduce(SCALAR, run.dp) + (run.zero > 0) * 2 * all_reduce(SCALAR, run.dp * run.cp)
    return parts


def dp_bytes(model: ModelSpec, run: RunSpec, pp_rank: int = 0) -> float:
    return sum(dp_parts(model, run, pp_rank).values())


def tp_bytes(model: ModelSpec, run: RunSpec, pp_rank: int = 0) -> float:
    t = run.tp
    if t == 1:
        return 0.0
    x, m, f = activation(model, run), run.micro_batches, run.forwards
    stages = rank_stages(pp_rank, run.pp, run.virtual_stages, placement_of(run.schedule))
    layers, last = rank_layers(model, run, pp_rank), run.n_stages - 1 in stages
    ends = (0 in stages) + last  # the embedding's and the head's
    per_microbatch = ((2 * f + 2) * len(layers) + ends) * all_reduce(x, t)  # = in all-gathers + reduce-scatters
    tokens = run.micro_batch_size * run.seq // run.cp
    moe = sum(map(model.is_moe, layers))  # their experts' partial outputs: k rows a token; the router's logits
    per_microbatch += moe * f * (all_reduce((model.top_k - 1) * x, t)  # (SP: an all-reduce of X, not
                                 + one_way(tokens * model.n_experts * run.itemsize, t)  # a reduce-scatter)
                                 + run.sequence_parallel * one_way(x, t))
    ce = 3 * all_reduce(tokens * max(run.itemsize, 4), t) * last
    sp_grads = 0.0
    if run.sequence_parallel:  # LayerNorms, row-parallel biases, positions: summed over tp, under ZeRO
        numel = sequence_parallel_numel(model, layers, 0 in stages, last)  # the part in this rank's shards
        sp_grads = all_reduce(numel / (run.dp * run.cp if run.zero else 1) * run.itemsize, t)
    return m * (per_microbatch + ce) + sp_grads + all_reduce(SCALAR, t)


def sequence_parallel_numel(model: ModelSpec, layers: list[int], first: bool, last: bool) -> int:
    """Elements of the parameters whose gradients sequence parallelism sums over tp, of blocks
    ``layers`` (and the first / last stage's): every norm, the row-parallel biases (an MoE layer's
    experts see every token: theirs is not), the learned positions."""
    C = model.n_embd
    norm = C * (2 if model.norm == "layernorm" and model.bias else 1)
    numel = sum(2 * norm + (C * (2 - model.is_moe(layer)) if model.bias else 0) for layer in layers)
    if first and model.positions == "learned":
        numel += model.block_size * C
    return numel + (norm if last else 0)


def pp_bytes(model: ModelSpec, run: RunSpec, pp_rank: int = 0) -> float:
    if run.pp == 1:
        return 0.0
    x = activation(model, run) / (run.tp if run.sequence_parallel else 1)
    placement = placement_of(run.schedule)
    stages = rank_stages(pp_rank, run.pp, run.virtual_stages, placement)
    here = lambda s: stage_rank(s, run.pp, placement) == pp_rank  # noqa: E731
    boundaries = sum((s + 1 < run.n_stages and not here(s + 1)) + (s > 0 and not here(s - 1)) for s in stages)
    ends = {stage_rank(0, run.pp, placement), stage_rank(run.n_stages - 1, run.pp, placement)}
    tied = 0.0
    if model.tied and len(ends) == 2 and pp_rank in ends:
        numel = padded_vocab_size(model.vocab_size, run.tp) // run.tp * model.n_embd
        if run.zero_optimizer:  # ZeRO sums the copies' shards only
            numel = shard(numel, run.dp * run.cp if run.zero else 1)
        tied = all_reduce(numel * run.itemsize, 2)
    return run.micro_batches * boundaries * x + tied + SCALAR + all_reduce(SCALAR, run.pp)


def cp_bytes(model: ModelSpec, run: RunSpec, pp_rank: int = 0) -> float:
    c, f = run.cp, run.forwards
    if c == 1:
        return 0.0
    layers = len(rank_layers(model, run, pp_rank))
    last = run.n_stages - 1 in rank_stages(pp_rank, run.pp, run.virtual_stages, placement_of(run.schedule))
    x = activation(model, run) / run.tp
    if run.cp_algorithm == "ulysses":
        per_layer = (4 * f + 4) * one_way(x, c)
    else:
        kv, dkv = 2 * x, 2 * x * max(run.itemsize, 4) / run.itemsize  # gradients in float32 under 16-bit
        per_layer = (f + 1) * (c - 1) * kv + c * dkv
    return run.micro_batches * (layers * per_layer + last * all_reduce(4, c))  # the loss's token count


def ep_bytes(model: ModelSpec, run: RunSpec, pp_rank: int = 0) -> float:
    if run.ep == 1:
        return 0.0
    moe, f = sum(map(model.is_moe, rank_layers(model, run, pp_rank))), run.forwards
    routed = activation(model, run) * model.top_k  # an even routing's rows (whole: tp ranks hold every token)
    counts = one_way(model.n_experts * 8, run.ep)  # (ep, E/ep) int64: how many rows go to each expert
    norm = (1 + (run.zero > 0)) * all_reduce(SCALAR, run.ep)
    return run.micro_batches * moe * ((2 * f + 2) * one_way(routed, run.ep) + f * counts) + norm


def comm_bytes_per_step(model: ModelSpec, run: RunSpec, pp_rank: int = 0) -> dict:
    """Bytes pipeline rank ``pp_rank`` (data-parallel rank 0) sends per step, per axis."""
    return {"dp": dp_bytes(model, run, pp_rank), "tp": tp_bytes(model, run, pp_rank),
            "pp": pp_bytes(model, run, pp_rank), "cp": cp_bytes(model, run, pp_rank),
            "ep": ep_bytes(model, run, pp_rank), "world": all_reduce(SCALAR, run.world) * run.mixed}
