"""Expert parallelism (GShard, DeepSpeed-MoE, torchtitan): the E experts of every MoE layer are
split over the ep ranks of a data-parallel group, E/ep each, and tokens travel to their experts and
back through two all-to-alls.

Each ep rank routes ITS OWN tokens (minidist/moe.py: router, top-k, sort by expert), then:

    1. counts     all_to_all of the counts (ep, E/ep): how many rows I send to each of your experts
    2. dispatch   all_to_all of the rows (uneven splits): rank r gets the rows for its E/ep experts,
                  from each source rank in turn, each source's rows by expert
    3. regroup    a local permutation: by expert, then by source rank (each expert's rows together)
    4. experts    the grouped MLPs of my E/ep experts (tensor parallelism splits them further)
    5. combine    the inverse permutation and the mirror all_to_all: every row goes home, where
                  the gate weights add each token's k outputs

Backward mirrors it: the gradients of the rows take the combine's all-to-all in reverse (the
counts swapped), the experts' backward runs, and the dispatch's all-to-all in reverse brings the
rows' gradients home. Nothing else crosses: the router, the gate weights and the balance loss stay on
the token's rank.

Who reduces which gradient (grad_ownership.py): an expert's gradient sums the tokens of every ep
rank (they came to it), so it is complete over the ep group and is averaged only over the ranks
holding the same experts, the expert-data-parallel group (dp / ep replicas, times cp); everything
else over the whole dp (x cp) group as before.
"""
from __future__ import annotations

import numpy as np

from minidist.autograd import Function, get_array_module, take_rows, to_numpy
from minidist.moe import MoE
from minidist.parallel.tensor.layout import ep_block


DISPATCH = ("activation: tokens to their experts", "activation: the tokens' gradients back from their experts")
COMBINE = ("activation: the experts' outputs back to their tokens",
           "activation: the outputs' gradients to their experts")


class AllToAll(Function):
    """Rows to the ranks of ``group``: ``send_counts[r]`` rows of x (along axis 0) to rank r, and
    ``recv_counts[r]`` rows back from each (concatenated in rank order). Backward sends the
    gradient's rows the other way: the same all-to-all with the counts swapped. ``name`` names
    the step's compute span, ``labels`` the (forward, backward) calls' purposes in the trace."""

    @staticmethod
    def forward(ctx, x, group, send_counts, recv_counts, name, labels):
        ctx.group, ctx.counts, ctx.name, ctx.label = group, (send_counts, recv_counts), name, labels[1]
        with group.trace.record(name, group=group.name, kind="compute"):
            return group.all_to_all(x, send_counts, recv_counts, label=labels[0])

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        xp = get_array_module(grad)
        with ctx.group.trace.record(f"{ctx.name} backward", group=ctx.group.name, kind="compute"):
            rows = ctx.group.all_to_all(xp.ascontiguousarray(grad), recv_counts, send_counts, label=ctx.label)
            return rows, None, None, None, None, None


def regroup_by_expert(counts) -> np.ndarray:
    """The permutation that takes rows arriving by source rank, then by expert (``counts`` (ep,
    L): rows from source s for local expert e), to rows by expert, then by source."""
    starts = np.concatenate([[0], np.cumsum(counts.reshape(-1))])[:-1].reshape(counts.shape)  # (ep, L)
    return np.concatenate([np.arange(starts[s, e], starts[s, e] + counts[s, e])
                           for e in range(counts.shape[1]) for s in range(counts.shape[0])]
                          + [np.zeros(0, dtype=np.int64)]).astype(np.int64)


class ExpertParallel:
    """One MoE layer's dispatch and combine over ``group`` (its ep group), whose rank r holds
    experts [r E/ep, (r+1) E/ep). :meth:`run` is :meth:`minidist.moe.MoE.run_experts` under expert
    parallelism. ``sent`` / ``received`` count the rows of the last call (for tests and --explain)."""

    def __init__(self, group, n_experts: int):
        self.group, self.n_experts = group, n_experts
        self.local = n_experts // group.size

    def run(self, experts, x, counts):
        """Outputs (M, C) of the experts for rows ``x`` (M, C) grouped by expert, ``counts[e]`` for
        each of the E experts. Sends: one all-to-all of (ep, E/ep) int64 counts; the rows for rank
        r's experts to rank r (all_to_all, uneven: "moe dispatch"), and their outputs back ("moe
        combine"); in backward the two row all-to-alls again, reversed."""
        n, L = self.group.size, self.local
        xp = get_array_module(x.data)
        send = np.asarray(counts, dtype=np.int64).reshape(n, L)  # (ep, L) rows for rank r's expert e
        label = "activation: how many token rows go to each expert"
        recv = to_numpy(self.group.all_to_all(xp.asarray(send), label=label))  # (ep, L) rows from rank s for my expert e
        to_rank, from_rank = [int(c) for c in send.sum(axis=1)], [int(c) for c in recv.sum(axis=1)]
        self.sent, self.received = send, recv
        rows = AllToAll.apply(x, self.group, to_rank, from_rank, "moe dispatch", DISPATCH)  # (R, C) by source, expert
        perm = regroup_by_expert(recv)
        y = experts(take_rows(rows, xp.asarray(perm)), [int(c) for c in recv.sum(axis=0)])  # (R, C) by expert, by source
        back = np.empty_like(perm)  # the inverse permutation (host), then where the rows are
        back[perm] = np.arange(len(perm))
        y = take_rows(y, xp.asarray(back))  # (R, C) by source, by expert
        return AllToAll.apply(y, self.group, from_rank, to_rank, "moe combine", COMBINE)  # (M, C)


def moe_layers(model) -> list:
    """The MoE modules of ``model`` (a GPT, its tensor-parallel shard or a pipeline stage), in order."""
    return [m for _, m in model.named_modules() if isinstance(m, MoE)]


def expert_parallel(model, group) -> None:
    """Split the experts of every MoE layer of ``model`` over ``group`` (the ep group): each
    stacked expert parameter keeps its block of E/ep experts along axis 0 (ep_block), and the layer
    dispatches through :class:`ExpertParallel`. Call before wrapping the model for data parallelism
    or ZeRO. Sends nothing."""
    for moe in moe_layers(model):
        for p in moe.experts.parameters():
            p.data = p.data[ep_block(moe.n_experts, group.rank, group.size)].copy()
        moe.expert_parallel = ExpertParallel(group, moe.n_experts)


def expert_load(model, mesh, micro_batches: int) -> dict:
    """What this step's routing did, the same on every rank, and reset the layers' counters:
    ``expert_load`` {block index: assignments per expert (E,), summed over every token of the
    global batch}, ``expert_imbalance`` (the largest max / mean over the MoE blocks: 1.0 is an even
    load), ``expert_rows`` (per global rank, the token rows its experts computed over all its MoE
    blocks: under expert parallelism the busiest rank sets the step's pace), ``dropped``
    (assignments over capacity) and ``aux_loss`` (the balance losses summed over the blocks, the
    mean over micro-batches and the dp replicas). Sends one all-reduce of (n_layer E + 2 + world,)
    float64 over the world: tp rank 0 adds its counts (the tp ranks route the same tokens), the cp
    ranks their tokens', the pp stages their blocks', the dp replicas their rows'."""
    layers = {int(name.split(".")[2]): m for name, m in model.named_modules() if isinstance(m, MoE)}
    E, n_layer = model.config.n_experts, model.config.n_layer  # the same on every rank (a stage may hold no MoE block)
    totals = np.zeros(n_layer * E + 2 + mesh.world.size)  # [load of block 0 (E,), block 1, ..., dropped, aux, rows]
    if mesh.tp_rank == 0:
        for i, moe in layers.items():
            totals[i * E:(i + 1) * E] = moe.load
            totals[n_layer * E] += moe.dropped
            if mesh.cp_rank == 0:  # every cp rank has the whole sequence's aux value
                totals[n_layer * E + 1] += moe.aux_loss / micro_batches / mesh.shape.dp
    totals[n_layer * E + 2 + mesh.rank] = sum(moe.experts.rows for moe in layers.values())
    for moe in layers.values():
        moe.reset_stats()
    xp = get_array_module(next(iter(model.parameters())).data)
    label = "metric: expert load, dropped rows, aux loss and rows per rank over the world"
    totals = to_numpy(mesh.world.all_reduce(xp.asarray(totals), label=label))  # in the model's memory (NCCL: GPU only)
    load = {i: totals[i * E:(i + 1) * E].astype(np.int64).tolist() for i in range(n_layer) if totals[i * E:(i + 1) * E].any()}
    imbalance = max((max(v) / (sum(v) / E) for v in load.values() if sum(v)), default=1.0)
    return {"expert_load": load, "expert_imbalance": imbalance, "expert_rows": totals[n_layer * E + 2:].astype(np.int64).tolist(),
            "dropped": int(totals[n_layer * E]), "aux_loss": float(totals[n_layer * E + 1])}
