"""Tied embeddings across a pipeline: the first stage's wte and the last stage's lm_head are one matrix.

The first stage embeds with ``transformer.wte.weight``, the last uses the same matrix as
``lm_head.weight``. On different ranks they are two copies, and each receives only its own part of
the gradient. Megatron keeps them equal by summing the two gradients over a 2-rank "embedding group"
(the ranks of the first and the last stage) before the optimizer step.

In ZB-V's "v" placement rank 0 holds both ends. The head still gets a copy of its own: a split
backward runs the two ends' weight gradients as separate passes (W of the first stage, W of the
last), and data parallelism and ZeRO count a parameter's gradient as final once per pass. The copies
are then summed on the rank itself. The sum is the gradient pipeline's (compose/complete.py).
"""
from __future__ import annotations

import copy

from minidist import nn
from minidist.parallel.pipeline.actions import stage_rank


def tied_head(stage, model):
    """The lm_head that pipeline ``stage`` (holding the last stage) uses: the model's own, or with
    both ends on its rank a module of its own around a copy of the weight. Its weight is marked
    ``tied_copy``: counted once with wte (compose/grad_ownership.py)."""
    head = model.lm_head
    if not (model.config.tie_embeddings and stage.pp_size > 1):
        return head
    if stage.holds_first:  # the V: both ends here, the head gets a parameter of its own
        head = copy.copy(model.lm_head)
        object.__setattr__(head, "_parameters", dict(model.lm_head._parameters))
        head.weight = nn.Parameter(model.lm_head.weight.data.copy())
        head.weight.tensor_parallel = model.lm_head.weight.tensor_parallel
    head.weight.tied_copy = True
    return head


def embedding_group(stage, pp_group):
    """Collective over ``pp_group``: the 2-rank group of the first and the last stage that hold the
    tied embedding copies, or None (on other ranks, with untied embeddings, or both ends on one rank)."""
    ends = {stage_rank(s, stage.pp_size, stage.placement) for s in (0, stage.n_stages - 1)}
    member = stage.config.tie_embeddings and len(ends) == 2 and pp_group.rank in ends
    return pp_group.split(0 if member else -1, name=f"{pp_group.name}/embedding")

