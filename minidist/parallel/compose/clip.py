"""Global-norm gradient clipping when the model is spread over ranks.

The norm must be the norm of the gradient of the WHOLE model, the one a single process would clip
by. Each rank sums the squares of what it owns, once (the rule lives in grad_ownership.py):

- a tensor-parallel parameter (``p.tensor_parallel = True``) is a distinct shard on each tp rank:
  every tp rank adds its shard's squares;
- a replicated parameter (LayerNorm, position embeddings, row-parallel biases) is the same on every
  tp rank: only tp rank 0 adds it, so it is counted once;
- pipeline stages hold different layers: their sums add up too; the last stage's copy of the tied
  embedding (``p.tied_copy = True``, the first stage holds the original) is not added again;
- data-parallel replicas hold the same (averaged) gradients: nothing to add over dp;
- under expert parallelism each ep rank holds different experts: their squares add up over ep.

So: one all-reduce of a single float over the tp group and one over the pp group (and one over the
ep group for the experts' squares), then every rank scales its own gradients by the same factor.

Under ZeRO the same rule runs on flat shards (:func:`clip_shards`): the tags become masks over each
shard (flat_buffer.py), each element lives on one rank of its shard's group (stages >= 1), so the
sums are added over that group too; a replicated element is counted on every tp rank's shard of it
and left out of the tp sum instead of being counted on tp rank 0 only.
"""
from __future__ import annotations

import numpy as np

from minidist.device import get_array_module
from minidist.optim import clip_coef, grad_norm_sq
from minidist.parallel.compose.grad_ownership import counted_in_norm, summed_over_ep


def local_grad_norm_sq(params, tp_rank: int) -> float:
    """The squares of the gradient elements this rank owns: its tensor-parallel shards, plus the
    replicated parameters if it is tp rank 0; never a pipeline stage's tied copy of a parameter
    another stage holds too (:func:`~minidist.parallel.compose.grad_ownership.counted_in_norm`)."""
    return grad_norm_sq([p.grad for p in params if counted_in_norm(p, tp_rank)])


def clip_grad_norm_parallel(params, max_norm: float, mesh) -> float:
    """Scale the gradients of this rank's ``params`` so that the global L2 norm over the whole model
    (tp shards and pp stages of ``mesh``) is at most ``max_norm``. Returns the norm before clipping,
    the same on every rank. Sends one 8-byte all-reduce on the tp group and one on the pp group (and
    first one of the experts' squares on the ep group), in the gradients' memory (host or GPU)."""
    params = [p for p in params if p.grad is not None]
    xp = get_array_module(params[0].grad) if params else np
    total = xp.array([local_grad_norm_sq([p for p in params if not summed_over_ep(p)], mesh.tp_rank)])  # (1,)
    experts = xp.array([local_grad_norm_sq([p for p in params if summed_over_ep(p)], mesh.tp_rank)])  # (1,)
    if mesh.ep_group is not None:
        mesh.ep_group.all_reduce(experts, label="metric: experts' gradient norm squares over ep")
    total += experts
    mesh.tp_group.all_reduce(total, label="metric: gradient norm squares over tp")
    mesh.pp_group.all_reduce(total, label="metric: gradient norm squares over pp")
    total_norm = float(total[0]) ** 0.5
    coef = clip_coef(total_norm, max_norm)
    if coef < 1.0:
        for p in params:
            p.grad *= coef
    return total_norm


def clip_shards(shards, max_norm: float, partitioned: bool, dp_group, mesh=None) -> float:
    """Scale ZeRO's gradient shards (``shard.param.grad``, where the update runs) so that the global
    L2 norm of the full gradient is at most ``max_norm``; returns the norm before clipping. Each rank
    sums the squares of its shards (tensor-parallel and replicated elements apart, by the shards'
    masks; a tied copy's elements not at all), all-reduces the two sums over each shard's group when
    ``partitioned`` (stages >= 1: every element lives on one rank of it; the experts' group's sums then
    add over the ep group too), the tensor-parallel sum over tp, and the total over pp (``mesh``'s
    groups; none without a mesh). Sends those 8-16 byte all-reduces, from the shards' device; one
    float crosses to the host."""
    tp_group, pp_group, ep_group = (mesh.tp_group, mesh.pp_group, mesh.ep_group) if mesh is not None else (None,) * 3
    xp = get_array_module(shards[0].param.grad)  # where the update runs: the host under offload
    sums = {}  # shard group -> [tensor-parallel elements, replicated elements]
    for s in shards:
        g = s.param.grad
        group_sums = sums.setdefault(s.group, xp.zeros(2))
        group_sums[0] += (g[s.tensor_parallel & s.counted] ** 2).sum()
        group_sums[1] += (g[~s.tensor_parallel & s.counted] ** 2).sum()
    sums = {group: shards[0].unit.xp.asarray(v) for group, v in sums.items()}  # sent from the device
    for group, group_sums in sums.items():
        if partitioned:
            group.all_reduce(group_sums, label="metric: gradient norm squares over the shards")
        if group is not dp_group and ep_group is not None:  # the experts: other ep ranks hold others
            ep_group.all_reduce(group_sums, label="metric: experts' gradient norm squares over ep")
    sums = sum(sums.values())
    if tp_group is not None:
        tp_group.all_reduce(sums[:1], label="metric: gradient norm squares over tp")
    total = sums.sum(keepdims=True)  # (1,)
    if pp_group is not None:
        pp_group.all_reduce(total, label="metric: gradient norm squares over pp")
    norm = float(total[0]) ** 0.5
    coef = clip_coef(norm, max_norm)
    if coef < 1.0:
        for s in shards:
            s.param.grad *= coef
    return norm
