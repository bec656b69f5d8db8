"""Seconds per step: FLOPs at the hardware's speed, bytes at its links', the bubble from the simulator.

FLOPs (Kaplan et al., PaLM's appendix B): a token costs 2 N forward and 4 N backward in the matmuls
(N: the parameters a token multiplies, :func:`~minidist.plan.models.active_parameters`), plus the
attention scores and their use, 4 s h a layer forward (s: the keys a query sees; minidist computes
every score of the causal square and masks half, so the full s counts). Model FLOPs per token are
therefore 6 N + 12 L h s; full recompute runs the forward twice (8 N + 16 L h s of hardware FLOPs),
selective recompute the attention scores only.

A block's time on one rank, per micro-batch: its FLOPs at ``flops x matmul_efficiency``, plus three
passes over its activations at the memory bandwidth (forward; twice that backward), plus the
profile's fixed ``layer_overhead``; the head adds its (h x V / t) matmul and the softmax's passes.
Backward costs twice the forward; split into B and W (zero-bubble schedules), half each.

Communication: a collective's time is its latency per step of the ring plus its bus bytes
(comm.py) over the link of its group (inside a node or across). What overlaps what, stated:

- tensor parallelism: exposed, on the critical path of every block (Megatron's default);
- pipeline sends: exposed, added to the sending micro-batch's F or B;
- context parallelism's ring: overlapped with the attention of the blocks it feeds (exposed only
  where the transfer is longer); Ulysses' all-to-alls and expert parallelism's: exposed;
- data parallelism: the gradient reduction runs in buckets under the last micro-batch's backward
  (ZeRO-2 and 3 under every micro-batch's, without a pipeline), exposed only beyond it; ZeRO-1 and
  2's all-gather of the new parameters after the step is exposed; ZeRO-3's all-gathers are
  prefetched under the compute, exposed only beyond it;
- the optimizer step: its bytes at the memory bandwidth, or with offload the gradient and parameter
  shards over PCIe and the update at the host's memory bandwidth (disk: NVMe reads and writes).

The pipeline's step comes from the schedule's simulator, which takes one cost per chunk: the mean
chunk of the busiest rank (the rank whose chunks cost most in all); the bubble is its idle share.
Memory passes count the activations the computation writes; on a GPU with fused attention
(``flash_attention``) not the attention probabilities. Where the hardware cannot overlap
(``overlap=False``, a CPU whose ranks share its cores) every transfer is exposed. MFU = model FLOPs
per second per device over the peak.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

from minidist.optim.state_bytes import optimizer_bytes_per_parameter
from minidist.parallel.pipeline import placement_of, rank_stages, simulate, splits_backward
from minidist.plan import comm
from minidist.plan.hardware import Hardware
from minidist.plan.layout import RunSpec
from minidist.plan.memory import (activation_bytes_per_layer, head_activation_bytes, optimizer_numel,
                                  pipeline_schedule, rank_units)
from minidist.plan.models import ModelSpec, active_parameters, layers_per_stage


def model_flops_per_token(model: ModelSpec, seq: int) -> float:
    """6 N + 12 L h s: the training FLOPs a token costs, without recompute."""
    return 6 * active_parameters(model) + 12 * model.n_layer * model.n_embd * seq


def group_span(run: RunSpec, axis: str) -> int:
    """How many consecutive devices an ``axis`` group spans in minidist's mesh order (dp, pp, cp, tp:
    tp neighbours are adjacent devices, dp the farthest apart)."""
    size = {"dp": run.dp, "pp": run.pp, "cp": run.cp, "tp": run.tp, "ep": run.ep, "world": run.world}[axis]
    stride = {"tp": 1, "cp": run.tp, "pp": run.cp * run.tp, "dp": run.pp * run.cp * run.tp,
              "ep": run.pp * run.cp * run.tp, "world": 1}[axis]
    return (size - 1) * stride + 1


def transfer_time(hw: Hardware, run: RunSpec, axis: str, nbytes: float, messages: int = 1) -> float:
    """Seconds to send ``nbytes`` of bus bytes over the ``axis`` group in ``messages`` ring steps."""
    if nbytes <= 0:
        return 0.0
    bandwidth, latency = hw.link(group_span(run, axis))
    return messages * latency + nbytes / bandwidth


def _slowdown(hw: Hardware, run: RunSpec) -> float:
    """Ranks that share cores run that much slower (a CPU with more ranks than cores)."""
    return max(1.0, run.world / hw.cores) if hw.cores else 1.0


def block_forward_time(model: ModelSpec, run: RunSpec, hw: Hardware, layer: int = 0) -> tuple[float, float]:
    """(seconds of one block's forward for one micro-batch on one rank, of which the attention
    scores): FLOPs and memory passes and a third of the fixed overhead, or a third of the profile's
    measured ``block_seconds`` (no attention part: minidist has no selective recompute)."""
    if hw.block_seconds is not None:  # measured at this shape (the local profile): a third is the forward
        return hw.block_seconds / 3 * _slowdown(hw, run), 0.0
    tokens, t = run.micro_batch_size * run.seq // run.cp, run.tp
    C, F = model.n_embd, model.hidden
    q, kv = model.n_head * model.head_dim, model.kv_heads * model.head_dim
    matrices = C * (2 * q + 2 * kv) + (3 if model.gated else 2) * C * F * (model.top_k if model.is_moe(layer) else 1)
    attention = 4 * tokens * run.seq * C  # scores and their use, every key of the sequence
    speed = hw.flops * hw.matmul_efficiency / _slowdown(hw, run)
    written = dataclasses.replace(run, recompute="selective" if hw.flash_attention else "none", dropout=False)
    passes = 3 * activation_bytes_per_layer(model, written, layer)  # fused attention writes no probabilities
    memory = passes / (hw.memory_bandwidth / _slowdown(hw, run))
    core = attention / t / speed
    return (2 * tokens * matrices / t) / speed + core + memory + hw.layer_overhead * _slowdown(hw, run) / 3, core


def head_forward_time(model: ModelSpec, run: RunSpec, hw: Hardware) -> float:
    """The LM head's matmul (h x V / t), the cross-entropy's passes over the logits and a third of the
    embeddings' and head's fixed overhead, one micro-batch's forward."""
    if hw.head_seconds is not None:  # measured at this shape, embeddings included
        return hw.head_seconds / 3 * _slowdown(hw, run)
    tokens = run.micro_batch_size * run.seq // run.cp
    speed = hw.flops * hw.matmul_efficiency / _slowdown(hw, run)
    matmul = 2 * tokens * model.n_embd * model.vocab_size / run.tp / speed
    passes = 3 * head_activation_bytes(model, run) / (hw.memory_bandwidth / _slowdown(hw, run))
    return hw.microbatch_overhead * _slowdown(hw, run) / 3 + matmul + passes


def tp_time_per_block(model: ModelSpec, run: RunSpec, hw: Hardware) -> float:
    """Forward(s) + backward of one block's all-reduces of X, 2 each (or their all-gathers and
    reduce-scatters)."""
    x = comm.activation(model, run)
    calls = 2 * run.forwards + 2
    return calls * transfer_time(hw, run, "tp", comm.all_reduce(x, run.tp), 2 * (run.tp - 1)) if run.tp > 1 else 0.0


def cp_exposed_per_block(model: ModelSpec, run: RunSpec, hw: Hardware, core: float) -> float:
    """Forward + backward of one block's context-parallel traffic not hidden under its attention."""
    if run.cp == 1:
        return 0.0
    x = comm.activation(model, run) / run.tp
    if run.cp_algorithm == "ulysses":
        return (4 * run.forwards + 4) * transfer_time(hw, run, "cp", comm.one_way(x, run.cp), run.cp - 1)
    forward = (run.cp - 1) * transfer_time(hw, run, "cp", 2 * x)
    backward = (run.cp - 1) * transfer_time(hw, run, "cp", 2 * x) + run.cp * transfer_time(hw, run, "cp", 2 * x)
    hidden = (core, 2 * core) if hw.overlap else (0.0, 0.0)
    return run.forwards * max(0.0, forward - hidden[0]) + max(0.0, backward - hidden[1])


def block_costs(model: ModelSpec, run: RunSpec, hw: Hardware, layer: int) -> tuple[float, float]:
    """(forward, backward) seconds of block ``layer`` for one micro-batch: its compute (backward
    twice the forward, plus what recompute runs again) and a third / two thirds of its exposed tp,
    cp and ep traffic."""
    f, core = block_forward_time(model, run, hw, layer)
    extra = {"none": 0.0, "selective": core, "full": f}[run.recompute]
    traffic = tp_time_per_block(model, run, hw) + cp_exposed_per_block(model, run, hw, core)
    if run.ep > 1 and model.is_moe(layer):
        routed = comm.one_way(comm.activation(model, run) * model.top_k, run.ep)
        traffic += (2 * run.forwards + 2) * transfer_time(hw, run, "ep", routed, run.ep - 1)
    return f + traffic / 3, 2 * f + extra + 2 * traffic / 3


def stage_costs(model: ModelSpec, run: RunSpec, hw: Hardware) -> list[tuple[float, float]]:
    """Per global pipeline stage, (forward, backward) seconds of one micro-batch: its blocks, the
    head on the last stage, the exposed tp, cp and ep traffic and the pipeline's sends."""
    x_pp = comm.activation(model, run) / (run.tp if run.sequence_parallel else 1)
    send = transfer_time(hw, run, "pp", x_pp) if run.pp > 1 else 0.0
    kinds = {moe: block_costs(model, run, hw, model.moe_every - 1 if moe else 0)  # blocks differ only by experts
             for moe in {model.is_moe(layer) for layer in range(model.n_layer)}}
    costs, first = [], 0
    for s, n in enumerate(layers_per_stage(model, run.n_stages)):
        blocks = [kinds[model.is_moe(layer)] for layer in range(first, first + n)]
        forward, backward = sum(b[0] for b in blocks), sum(b[1] for b in blocks)
        if s == run.n_stages - 1:
            head = head_forward_time(model, run, hw)
            forward, backward = forward + head, backward + 2 * head
        costs.append((forward + send, backward + send))
        first += n
    return costs


def optimizer_time(model: ModelSpec, run: RunSpec, hw: Hardware) -> float:
    """The optimizer step on pipeline rank 0: read and write its shard's state, gradient and
    parameter once; on the device, or with offload on the host after the gradient shard came down
    (the new parameter shard goes up), the store read from and written to disk under "disk"."""
    _, numel = optimizer_numel(model, run)
    b = run.itemsize
    state = numel * optimizer_bytes_per_parameter(run.optimizer, run.dtype, run.mixed)  # masters and slots
    touched = 2 * (state + 2 * numel * b)  # state, gradient and parameter, read and written
    if run.offload == "none":
        tensors = len(rank_units(model, run)) if run.zero else parameter_tensors(model, run)  # ZeRO: flat units
        fixed = tensors * hw.tensor_update_overhead
        return (touched / hw.memory_bandwidth + fixed) * _slowdown(hw, run)
    moved = 2 * numel * b / hw.host_bandwidth  # the gradient shard down, the parameter shard up
    disk = 2 * state / hw.disk_bandwidth if run.offload_to == "disk" else 0.0
    return moved + touched / hw.host_memory_bandwidth + disk


def parameter_tensors(model: ModelSpec, run: RunSpec) -> int:
    """How many parameter tensors pipeline rank 0 updates one by one (without ZeRO's flat units):
    per block two norms and four Linears, with biases twice as many; the embeddings, final norm, head."""
    per_block = (2 + 4) * (2 if model.bias else 1)
    names = [name for name, _, _ in rank_units(model, run) if not name.endswith("experts")]
    blocks = sum(".h." in name for name in names)
    return per_block * blocks + 2 * (len(names) - blocks)


def dp_exposed(model: ModelSpec, run: RunSpec, hw: Hardware, backward: float, compute: float) -> float:
    """Data parallelism's exposed seconds per step on pipeline rank 0 (the overlap rules above):
    ``backward`` is one micro-batch's backward on the stage, ``compute`` the step's compute. The
    reduction and the all-gathers share one link, so ZeRO-3's whole traffic is set against the
    compute once."""
    n = run.dp * run.cp
    if n == 1:
        return 0.0
    parts = comm.dp_parts(model, run)
    reduce = transfer_time(hw, run, "dp", parts["reduce"], (2 if run.zero == 0 else 1) * (n - 1))
    gather = transfer_time(hw, run, "dp", parts["gather"], n - 1)
    if not hw.overlap:
        return reduce + gather
    if run.zero == 3:
        return max(0.0, reduce + gather - compute)
    calls = run.micro_batches if run.zero == 2 and run.pp == 1 else 1  # ZeRO-2 reduces every micro-batch
    return calls * max(0.0, reduce / calls - backward) + gather


def busiest_stages(run: RunSpec, costs: list[tuple[float, float]]) -> list[int]:
    """The stages of the pipeline rank whose chunks cost most in all (``costs``: :func:`stage_costs`)."""
    placement = placement_of(run.schedule)
    held = [rank_stages(r, run.pp, run.virtual_stages, placement) for r in range(run.pp)]
    return max(held, key=lambda stages: sum(sum(costs[s]) for s in stages))


@lru_cache(maxsize=4096)
def simulated(name: str, pp: int, micro_batches: int, virtual_stages: int, ratio: float) -> tuple[float, float]:
    """(makespan in forward costs, bubble share) of the schedule simulated with F = 1 and B =
    ``ratio`` (split into B and W halves in a zero-bubble schedule). A timeline scales with its costs,
    so the step is the chunk's forward times this makespan; the ratio is rounded to 3 significant
    digits so that a search simulates each shape once."""
    schedule, _ = pipeline_schedule(name, pp, micro_batches, virtual_stages)
    weight = ratio / 2 if splits_backward(name) else 0.0
    timeline = simulate(schedule, pp, 1.0, ratio, weight, placement_of(name))
    return timeline.makespan, timeline.bubble()


def step_time(model: ModelSpec, run: RunSpec, hw: Hardware) -> dict:
    """Seconds of one step and where they go (pipeline rank 0's view): ``pipeline`` (the forward and
    backward of every micro-batch, their exposed tp, cp, ep and pp traffic, and the bubble, of which
    ``bubble`` seconds idle), ``dp_exposed``, ``optimizer``, ``total``; ``bubble_share`` of the
    pipeline idle."""
    costs = stage_costs(model, run, hw)
    if run.pp == 1:
        pipeline, share = run.micro_batches * sum(costs[0]), 0.0
    else:  # a chunk costs its rank's chunks on average, on the busiest rank (the simulator takes one cost)
        chunks = [costs[s] for s in busiest_stages(run, costs)]
        forward, backward = (sum(c[i] for c in chunks) / len(chunks) for i in (0, 1))
        makespan, share = simulated(run.schedule, run.pp, run.micro_batches, run.virtual_stages,
                                    float(f"{backward / forward:.3g}"))
        pipeline = forward * makespan
    dp = dp_exposed(model, run, hw, costs[0][1], pipeline)
    optimizer = optimizer_time(model, run, hw)
    return {"pipeline": pipeline, "bubble": share * pipeline, "dp_exposed": dp, "optimizer": optimizer,
            "total": pipeline + dp + optimizer, "bubble_share": share}
