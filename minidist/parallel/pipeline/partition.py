"""Which transformer blocks each pipeline stage holds: balanced by cost, not by count.

A pipeline runs at the pace of its slowest stage. The first stage also pays for the embeddings and
the last for the LM head, whose (C x V) matmul is a large share of a small model, so the blocks are
cut where the costs balance: estimated from the shapes (:func:`estimate_layer_costs`), measured
(:func:`measure_layer_costs`), or given outright (``PipelineStage(layers_per_stage=...)``).
"""
from __future__ import annotations

import time

import numpy as np

from minidist.autograd import Tensor, get_array_module


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


def layers_for(config, n_stages: int, costs=None) -> list[int]:
    """Blocks per stage for ``config`` balanced by ``costs`` (embed, [per block], head), default
    :func:`estimate_layer_costs`."""
    embed, blocks, head = costs if costs is not None else estimate_layer_costs(config)
    return partition_layers(blocks, n_stages, embed, head)
