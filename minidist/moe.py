"""Mixture of experts: a block's MLP becomes E expert MLPs and a learned router (Switch, GShard,
Mixtral, DeepSeek-MoE), on minidist's autograd. The one-process reference of expert parallelism.

For the N = B T tokens of a micro-batch (rows of x (N, C)):

    probs   = softmax(x @ router.T)                 (N, E)   the router, one Linear without bias
    experts = the top_k largest probs of each token (N, k)   ties: the lower expert index
    weights = those probs, renormalised to sum 1    (N, k)   (k = 1: the probability itself, as Switch)
    sort the N k (token, choice) assignments by expert (stable: token order inside each expert)
    y_e     = MLP_e(x of the tokens sent to expert e)        one grouped matmul per expert layer
    out[n]  = sum_j weights[n, j] * y_{experts[n, j]}[n]     (N, C)

Dropless by default: every assignment is computed, so every layout computes the same function.
With ``capacity_factor`` c > 0 each expert takes at most ceil(c k T / E) assignments PER SEQUENCE,
first choices before second choices, earlier tokens first; the rest are dropped (they add nothing:
the residual carries the token). The rule reads one sequence only, so it does not depend on how
the batch is split over data-parallel ranks or micro-batches, nor on where the experts live (under
context parallelism the cp ranks gather the sequence's choices first).

Load balancing (Switch / GShard's auxiliary loss, computed per sequence as DeepSeek-V3's
sequence-wise balance loss is, so that a batch split over ranks adds up to the same value):

    aux = coef * E * mean over sequences b of sum_e f[b, e] * P[b, e]
    f[b, e] = (assignments of b's tokens to e) / (k T)      P[b, e] = mean over b's tokens of probs[:, e]

It is 1 * coef when the load is even. f is a count (no gradient); P carries it. The loss the model
returns is the cross-entropy alone; each MoE layer adds its aux gradient to its router's in backward
(Megatron's way, so a pipeline stage needs no loss of its own): ``aux_loss_seed`` times the
gradient of ``aux``, the seed being what the cross-entropy's backward starts from
(minidist/parallel/compose/loss_scaling.py sets it: loss scale / micro-batches).

Hooks for the parallel versions, each the one-process rule here: :meth:`MoE.run_experts` (expert
parallelism sends the tokens to the ranks holding their experts, minidist/parallel/expert/experts.py),
:meth:`MoE.keep` and :meth:`MoE.sequence_statistics` (the rules that read whole sequences: context
parallelism installs versions that gather a sequence's choices, and sum its statistics, over the cp
ranks holding its parts, minidist/parallel/context/context_parallel.py) and
:meth:`Experts.reduce_partial` (tensor parallelism splits the experts' MLPs like the dense MLP's and
sums their partial outputs, minidist/parallel/tensor/apply.py).
"""
from __future__ import annotations

import math

import numpy as np

from minidist import nn
from minidist.autograd import (Function, combine, gelu, get_array_module, grouped_bias, grouped_linear,
                               is_grad_enabled, softmax, take_rows, to_numpy)


def is_moe_layer(config, layer: int) -> bool:
    """Whether block ``layer`` (0-based) of ``config`` has experts: with ``n_experts`` > 0, every
    ``moe_every``-th block, the last of each group (moe_every 2: blocks 1, 3, ...)."""
    return config.n_experts > 0 and layer % config.moe_every == config.moe_every - 1


def route(probs, top_k: int):
    """The experts of each token (N, k): the indices of its ``top_k`` largest probabilities (N, E),
    largest first, ties going to the lower index (a stable sort)."""
    return get_array_module(probs).argsort(-probs, axis=-1, kind="stable")[:, :top_k]


def capacity(capacity_factor: float, tokens: int, top_k: int, n_experts: int) -> int:
    """Assignments one expert takes from one sequence of ``tokens`` tokens: ceil(c k T / E)."""
    return math.ceil(capacity_factor * top_k * tokens / n_experts)


def capacity_keep(experts, cap: int, n_experts: int):
    """Which assignments of ``experts`` (B, T, k) are kept when each expert takes ``cap`` of each
    sequence (B, T, k bools): a sequence's assignments in the order (choice j, token t), the first
    ``cap`` of each expert kept."""
    xp = get_array_module(experts)
    B, T, k = experts.shape
    ordered = experts.transpose(0, 2, 1).reshape(B, k * T)  # (B, k T): first choices, then second ...
    onehot = ordered[..., None] == xp.arange(n_experts)  # (B, k T, E)
    position = (xp.cumsum(onehot, axis=1) - 1)[onehot].reshape(B, k * T)  # place in its expert's queue
    return (position < cap).reshape(B, k, T).transpose(0, 2, 1)  # (B, T, k)


class BalanceLoss(Function):
    """Identity on ``out``; in backward it also hands ``grad_probs`` (the load-balancing loss's
    gradient, already times its seed) to the router's probabilities."""

    @staticmethod
    def forward(ctx, out, probs, grad_probs):
        ctx.grad_probs = grad_probs
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, ctx.grad_probs, None


class ExpertLinear(nn.Module):
    """E Linears stacked: weight (E, out, in), bias (E, out). Each parameter is tagged ``expert``
    (expert parallelism gives each ep rank a block of E along axis 0)."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, bias: bool = True, dtype="float32"):
        super().__init__()
        self.weight = nn.Parameter(np.zeros((n_experts, out_features, in_features), dtype=dtype))
        self.bias = nn.Parameter(np.zeros((n_experts, out_features), dtype=dtype)) if bias else None
        for p in (self.weight, self.bias):
            if p is not None:
                p.expert = True


class Experts(nn.Module):
    """E expert MLPs (C -> hidden, GELU, hidden -> C) over rows grouped by expert: ``forward(x,
    counts)`` runs the first ``counts[0]`` rows of x (M, C) through expert 0, the next through
    expert 1, ... (the experts this module holds, in order)."""

    def __init__(self, n_experts: int, n_embd: int, hidden: int, bias: bool = True, dtype="float32"):
        super().__init__()
        self.c_fc = ExpertLinear(n_experts, n_embd, hidden, bias, dtype)
        self.c_proj = ExpertLinear(n_experts, hidden, n_embd, bias, dtype)

    rows = 0  # rows this module's experts computed in grad mode since the MoE layer's reset_stats

    def forward(self, x, counts):  # (M, C), counts: one int per expert held here
        if is_grad_enabled():
            self.rows += x.shape[0]
        h = gelu(grouped_linear(x, self.c_fc.weight, self.c_fc.bias, counts))  # (M, hidden)
        y = self.reduce_partial(grouped_linear(h, self.c_proj.weight, None, counts))  # (M, C)
        return y if self.c_proj.bias is None else grouped_bias(y, self.c_proj.bias, counts)

    def reduce_partial(self, y):
        """The experts' outputs before their bias: whole here; partial sums to add over the tensor-
        parallel group when tp splits the experts (minidist/parallel/tensor/apply.py)."""
        return y


class MoE(nn.Module):
    """The mixture-of-experts MLP of one block: ``router`` (E, C) and ``experts`` (hidden 4C each).
    ``forward(x)`` (B, T, C) -> (B, T, C), as in the module docstring. After each forward in grad
    mode ``load`` (E,) holds the assignments each expert got (summed over the forwards since
    :meth:`reset_stats`, before any drop), ``dropped`` the dropped ones, ``aux_loss`` the summed
    values of the balance loss and ``experts.rows`` the rows this rank's experts computed."""
    expert_parallel = None  # or an ExpertParallel (minidist/parallel/expert/experts.py): where the experts run

    def __init__(self, config, dtype="float32"):
        super().__init__()
        C, E = config.n_embd, config.n_experts
        self.n_experts, self.top_k = E, config.top_k
        self.capacity_factor, self.aux_loss_coef = config.capacity_factor, config.aux_loss_coef
        self.aux_loss_seed = 1.0  # what the loss's backward starts from (loss_scaling.py sets it)
        self.router = nn.Linear(C, E, bias=False, dtype=dtype)
        self.experts = Experts(E, C, 4 * C, config.bias, dtype)
        self.reset_stats()

    def reset_stats(self) -> None:
        self.load, self.dropped, self.aux_loss = np.zeros(self.n_experts, dtype=np.int64), 0, 0.0
        self.experts.rows = 0

    def forward(self, x):  # (B, T, C)
        """Route, run the experts, combine (module docstring). Sends nothing itself: under expert
        parallelism :meth:`run_experts` all-to-alls the rows, under context parallelism :meth:`keep`
        and :meth:`sequence_statistics` gather and sum over the cp ranks."""
        B, T, C = x.shape
        N, k = B * T, self.top_k
        flat = x.reshape(N, C)  # (N, C)
        probs = softmax(self.router(flat))  # (N, E)
        xp = get_array_module(probs.data)
        experts = route(probs.data, k)  # (N, k)
        weights = probs[xp.arange(N)[:, None], experts]  # (N, k)
        if k > 1:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        keep = self.keep(experts.reshape(B, T, k)).reshape(-1)  # (N k,)
        chosen = experts.reshape(-1)  # (N k,) assignment a = n k + j
        order = xp.nonzero(keep)[0]
        order = order[xp.argsort(chosen[order], kind="stable")]  # kept assignments, by expert
        counts = [int(c) for c in to_numpy(xp.bincount(chosen[order], minlength=self.n_experts))]  # (E,)
        slot = xp.full(N * k, -1, dtype=np.int64)
        slot[order] = xp.arange(len(order))  # where each assignment's output lands; -1: dropped
        y = self.run_experts(take_rows(flat, order, k), counts)  # (M, C): the tokens, grouped by expert
        out = combine(y, weights, slot.reshape(N, k))  # (N, C)
        out = self.balance(out, probs, experts.reshape(B, T, k))
        if probs.requires_grad:
            self.load += np.bincount(to_numpy(chosen), minlength=self.n_experts)
            self.dropped += N * k - len(order)
        return out.reshape(B, T, C)

    def run_experts(self, x, counts):
        """The experts' outputs (M, C) for rows ``x`` (M, C) grouped by expert, ``counts[e]`` rows
        for expert e (all E of them). Here: the experts of this module; expert parallelism sends the
        rows to the ranks holding their experts and back."""
        if self.expert_parallel is not None:
            return self.expert_parallel.run(self.experts, x, counts)
        return self.experts(x, counts)

    def keep(self, experts):
        """Which assignments of ``experts`` (B, T, k) are computed: all of them (dropless), or with
        a capacity factor the first ``capacity`` of each expert in each sequence (whole sequences:
        context parallelism gathers them first)."""
        if not self.capacity_factor:
            return get_array_module(experts).ones(experts.shape, dtype=bool)
        cap = capacity(self.capacity_factor, experts.shape[1], self.top_k, self.n_experts)
        return capacity_keep(experts, cap, self.n_experts)

    def sequence_statistics(self, experts, p):
        """The balance loss's statistics per sequence and expert, float64 (2, B, E): [assignments,
        sum of router probabilities] over the tokens of ``experts`` (B, T, k) and ``p`` (B, T, E),
        and the number of tokens they count, T (context parallelism sums them over the cp ranks)."""
        xp = get_array_module(p)
        B, T, k = experts.shape
        stats = xp.zeros((2, B, self.n_experts))
        for j in range(k):
            stats[0] += (experts[..., j, None] == xp.arange(self.n_experts)).sum(axis=1)
        stats[1] = p.sum(axis=1)
        return stats, T

    def balance(self, out, probs, experts):
        """``out`` unchanged; with a balance coefficient and a graph, the aux loss's gradient joins
        the router's in backward, from each sequence's :meth:`sequence_statistics`."""
        if not self.aux_loss_coef or not probs.requires_grad:
            return out
        xp = get_array_module(probs.data)
        B, T, k = experts.shape
        E = self.n_experts
        p = probs.data.reshape(B, T, E)
        stats, T_all = self.sequence_statistics(experts, p)  # (2, B, E), and the whole sequence's tokens
        f = stats[0] / (k * T_all)  # (B, E)
        self.aux_loss += float(self.aux_loss_coef * E * (f * stats[1] / T_all).sum() / B)
        grad = self.aux_loss_seed * self.aux_loss_coef * E * f / (B * T_all)  # d aux / d probs[b, t, e]
        grad = xp.broadcast_to(grad[:, None, :], p.shape).reshape(B * T, E).astype(p.dtype)
        return BalanceLoss.apply(out, probs, grad)
