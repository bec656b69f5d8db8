"""Pipeline stages: which transformer blocks each stage holds, and the module a rank keeps.

The GPT is cut where ``minidist.model`` cuts it: ``embed`` on the first stage, then the blocks in
order, then ``head`` (final LayerNorm, LM head, loss) on the last. With p ranks and v chunks per rank
there are S = p * v stages; stage s lives on rank s % p (Megatron's interleaved layout), or in ZB-V's
"v" placement on rank r for stages r and 2p-1-r (actions.py).

A pipeline runs at the pace of its slowest stage, so the blocks are split by COST, not by count: the
first stage also pays for the embeddings and the last for the LM head, whose (C x V) matmul is a
large share of a small model. Costs are estimated from the shapes (:func:`estimate_layer_costs`),
measured (:func:`measure_layer_costs`), or the split is given outright.

Tied embeddings: the first stage uses ``transformer.wte.weight`` to embed, the last uses the same
matrix as ``lm_head.weight``. On different ranks they are two copies; each receives only its own part
of the gradient. Megatron keeps them equal by summing the two gradients over a 2-rank "embedding
group" (first and last stage) before the optimizer step: :meth:`PipelineStage.all_reduce_tied_grads`.
In the "v" placement rank 0 holds both ends. The head still gets a copy of its own: a split backward
runs the two ends' weight gradients as separate passes (W of the first stage, W of the last), and
data parallelism and ZeRO count a parameter's gradient as final once per pass. The copies are summed
on the rank itself (:meth:`PipelineStage.all_reduce_tied_grads`, ``ZeroOptimizer``).
"""
from __future__ import annotations

import copy
import time

import numpy as np

from minidist import nn
from minidist.autograd import Tensor, get_array_module
from minidist.parallel.pipeline.actions import rank_stages, stage_rank

_SHARED_ATTRIBUTES = ("config", "tp_group", "sequence_parallel", "context_parallel")  # what embed/head read


def estimate_layer_costs(config) -> tuple[float, list[float], float]:
    """Forward FLOPs per token of (embeddings, each block, head), from the shapes: a block's four
    Linears cost 2 * 12 C^2 and attention 2 * 2 T C; the head 2 C V; embeddings ~C (a lookup and an
    add). Backward costs about twice the forward everywhere, so the ratios hold for F + B."""
    C, T, V = config.n_embd, config.block_size, config.vocab_size
    return float(C), [24.0 * C * C + 4.0 * T * C] * config.n_layer, 2.0 * C * V


def measure_layer_costs(model, idx, targets, repeats: int = 3) -> tuple[float, list[float], float]:
    """Measured seconds of forward + backward of (embeddings, each block, head) on the batch
    (``idx``, ``targets``), best of ``repeats``: the same shape as :func:`estimate_layer_costs`."""
    def best(fn):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    x = model.embed(idx).data  # (B, T, C)
    xp = get_array_module(x)

    def block_pass(block):
        y = block(Tensor(x, requires_grad=True))  # (B, T, C)
        y.backward(xp.ones_like(y.data))

    embed = best(lambda: model.embed(idx).backward(xp.ones_like(x)))
    blocks = [best(lambda b=b: block_pass(b)) for b in model.transformer.h]
    head = best(lambda: model.head(Tensor(x, requires_grad=True), targets)[1].backward())
    model.zero_grad()
    return embed, blocks, head


def partition_layers(block_costs, n_stages: int, first_extra: float = 0.0,
                     last_extra: float = 0.0) -> list[int]:
    """Blocks per stage: cut the blocks into ``n_stages`` contiguous runs of at least one block each
    so that the most expensive stage (its blocks, plus ``first_extra`` on the first, ``last_extra`` on
    the last) is as cheap as possible. Dynamic programming over (stages, blocks): O(S L^2)."""
    L = len(block_costs)
    if not 1 <= n_stages <= L:
        raise ValueError(f"cannot give each of {n_stages} pipeline stages at least one of {L} blocks "
                         f"(use more layers or fewer stages x virtual stages)")
    prefix = np.concatenate([[0.0], np.cumsum(block_costs)])  # prefix[j] = cost of blocks 0..j-1

    def cost(stage, i, j):  # stage `stage` holds blocks i..j-1
        return prefix[j] - prefix[i] + (first_extra if stage == 0 else 0) + (last_extra if stage == n_stages - 1 else 0)

    # best[s][j]: the smallest max-stage cost putting blocks 0..j-1 on stages 0..s; cut[s][j]: where s starts
    best = np.full((n_stages, L + 1), np.inf)
    cut = np.zeros((n_stages, L + 1), dtype=int)
    for j in range(1, L + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, n_stages):
        for j in range(s + 1, L + 1):
            for i in range(s, j):
                c = max(best[s - 1][i], cost(s, i, j))
                if c < best[s][j]:
                    best[s][j], cut[s][j] = c, i
    counts, j = [], L
    for s in range(n_stages - 1, 0, -1):
        counts.append(j - int(cut[s][j]))
        j = int(cut[s][j])
    return [j] + counts[::-1]


class PipelineStage(nn.Module):
    """The part of ``model`` (a GPT or a tensor-parallel GPT) that pipeline rank ``pp_rank`` of
    ``pp_size`` holds: its ``virtual_stages`` chunks, chunk c being stage c * pp_size + pp_rank.

    ``layers_per_stage`` (one count per stage, summing to n_layer) overrides the split; else blocks
    are split by ``costs`` (embed, [per block], head), default :func:`estimate_layer_costs`.
    Parameters keep their GPT names (``transformer.h.5.attn.c_attn.weight``), so optimizers, data
    parallelism and state dicts work unchanged; the blocks of other stages are not referenced.
    ``forward(chunk, x, targets)`` runs one chunk: token ids -> embeddings on stage 0, the chunk's
    blocks, and on the last stage the head, returning the mean loss (the logits without targets);
    other stages return (B, T, C).
    """

    def __init__(self, model, pp_rank: int, pp_size: int, virtual_stages: int = 1, layers_per_stage=None,
                 costs=None, placement: str = "loop"):
        super().__init__()
        for name in _SHARED_ATTRIBUTES:
            if hasattr(model, name):
                setattr(self, name, getattr(model, name))
        self._model_type = type(model)
        n_layer, n_stages = model.config.n_layer, pp_size * virtual_stages
        if layers_per_stage is None:
            embed, blocks, head = costs if costs is not None else estimate_layer_costs(model.config)
            layers_per_stage = partition_layers(blocks, n_stages, embed, head)
        if len(layers_per_stage) != n_stages or sum(layers_per_stage) != n_layer or min(layers_per_stage) < 1:
            raise ValueError(f"layers_per_stage {list(layers_per_stage)} must give each of the {n_stages} stages "
                             f"at least one block, {n_layer} in all")
        starts = np.concatenate([[0], np.cumsum(layers_per_stage)])
        self.layers_per_stage = list(layers_per_stage)
        self.pp_rank, self.pp_size, self.n_stages, self.placement = pp_rank, pp_size, n_stages, placement
        self.stages = rank_stages(pp_rank, pp_size, virtual_stages, placement)  # chunk -> global stage
        self.layers = [range(int(starts[s]), int(starts[s + 1])) for s in self.stages]  # chunk -> blocks
        t = model.transformer
        parts = dict(wte=t.wte, wpe=t.wpe) if self.holds_first else {}
        parts["h"] = nn.ModuleDict({str(i): t.h[i] for layers in self.layers for i in layers})
        if self.holds_last:
            parts["ln_f"] = t.ln_f
        self.transformer = nn.ModuleDict(parts)
        if self.holds_last:
            self.lm_head = model.lm_head
            if model.config.tie_embeddings and pp_size > 1:
                if self.holds_first:  # the V: both ends here, the head gets a parameter of its own
                    self.lm_head = copy.copy(model.lm_head)
                    object.__setattr__(self.lm_head, "_parameters", dict(model.lm_head._parameters))
                    self.lm_head.weight = nn.Parameter(model.lm_head.weight.data.copy())
                    self.lm_head.weight.tensor_parallel = model.lm_head.weight.tensor_parallel
                self.lm_head.weight.tied_copy = True  # a copy of the first stage's wte: counted once (grad_ownership.py)

    @property
    def holds_first(self) -> bool:
        return 0 in self.stages

    @property
    def holds_last(self) -> bool:
        return self.n_stages - 1 in self.stages

    def forward(self, chunk: int, x, targets=None):
        """Chunk ``chunk``: ids (B, T) or activations (B, T, C) in; activations (B, T, C) out, or on
        the last stage the mean cross-entropy (the logits (B, T, V), or this tp rank's slice of them,
        without ``targets``: generation)."""
        stage = self.stages[chunk]
        if stage == 0:
            x = self._model_type.embed(self, x)  # (B, T, C)
        for i in self.layers[chunk]:
            x = self.transformer.h[str(i)](x)  # (B, T, C)
        if stage == self.n_stages - 1:
            logits, loss = self._model_type.head(self, x, targets)
            return logits if targets is None else loss
        return x

    def activation_shape(self, batch_rows: int, seq_len: int) -> tuple[int, int, int]:
        """The (B, T, C) shape stages send each other (T / cp under context parallelism, and / tp
        under sequence parallelism)."""
        if self.context_parallel is not None:
            seq_len //= self.context_parallel.size
        if getattr(self, "sequence_parallel", False):
            seq_len //= self.tp_group.size
        return batch_rows, seq_len, self.config.n_embd

    def embedding_group(self, pp_group):
        """Collective over ``pp_group``: the 2-rank group of the first and the last stage that hold
        the tied embedding copies, or None (on other ranks, with untied embeddings, or one rank)."""
        ends = {stage_rank(0, self.pp_size, self.placement), stage_rank(self.n_stages - 1, self.pp_size, self.placement)}
        tied = self.config.tie_embeddings and len(ends) == 2
        member = tied and pp_group.rank in ends
        return pp_group.split(0 if member else -1, name=f"{pp_group.name}/embedding")

    def all_reduce_tied_grads(self, embedding_group) -> None:
        """Sum the gradients of the two tied-embedding copies over ``embedding_group`` (from
        :meth:`embedding_group`): first stage ``transformer.wte.weight`` + last stage ``lm_head.weight``,
        as one process would have accumulated into its single matrix. Sends one all-reduce of (V, C);
        with both copies on this rank (the "v" placement) adds them here and sends nothing."""
        if not (self.config.tie_embeddings and self.pp_size > 1):
            return
        here = ([self.transformer.wte.weight] if self.holds_first else []) + (
            [self.lm_head.weight] if self.holds_last else [])  # the copies this rank holds
        for p in here:
            if p.grad is None:
                p.grad = get_array_module(p.data).zeros_like(p.data)
        if len(here) == 2:  # both ends on this rank (the "v" placement): added here, nothing sent
            total = here[0].grad + here[1].grad
            for p in here:
                p.grad[...] = total
        elif embedding_group is not None:
            embedding_group.all_reduce(here[0].grad, op="sum")
