"""Step 2 of the gradient pipeline: complete each gradient over the axes that split its sum.

After the reduction over the data replicas a gradient may still be a part of the one a single
process would have (grad_ownership.py says which):

- sequence parallelism: a replicated parameter (LayerNorm, row-parallel bias, position embedding)
  saw only this tp rank's tokens, so its gradient is a partial sum: all-reduced over tp;
- a pipeline's tied embedding: the first stage's ``wte`` and the last stage's ``lm_head`` are copies
  of one matrix, each with the gradient of its own use: summed over the embedding group (both ends
  on one rank, as ZB-V places them: added there, nothing sent).

The same sums run on whole tensors (plain data parallelism) or on ZeRO's flat shards (the masks
and the units line up element by element on every rank of a group), so each rule is written once
per place its gradients can live, here.
"""
from __future__ import annotations

from minidist.parallel.compose.grad_ownership import summed_over_tp
from minidist.device import get_array_module


def tied_copies(model) -> list:
    """The tied embedding copies ``model`` (a pipeline stage, or any model) holds whose gradients the
    pipeline sums: the first stage's ``transformer.wte.weight``, the last stage's ``lm_head.weight``
    (both on a rank holding both ends); [] without tied embeddings or with one stage."""
    if not (getattr(model, "pp_size", 1) > 1 and model.config.tie_embeddings):
        return []
    return ([model.transformer.wte.weight] if model.holds_first else []) + (
        [model.lm_head.weight] if model.holds_last else [])


def sync_sequence_parallel_grads(model, tp_group) -> None:
    """Under sequence parallelism a replicated parameter (LayerNorm, row-parallel bias, position
    embedding: marked ``sequence_parallel = True``) sees only this rank's tokens, so its gradient is a
    partial sum: add them over the tensor-parallel group, all in ONE all-reduce of a flat buffer.
    A no-op (nothing sent) without sequence parallelism."""
    grads = [p.grad for p in model.parameters() if summed_over_tp(p) and p.grad is not None]
    if not grads:
        return
    flat = get_array_module(grads[0]).concatenate([g.reshape(-1) for g in grads])  # (sum of sizes,)
    tp_group.all_reduce(flat, label="gradient: sequence-parallel partial sums over tp")
    offset = 0
    for g in grads:
        g[...] = flat[offset:offset + g.size].reshape(g.shape)
        offset += g.size


def complete_whole(model, tp_group, tied_group) -> None:
    """Complete ``model``'s whole-tensor gradients: the sequence-parallel partial sums over
    ``tp_group`` (:func:`sync_sequence_parallel_grads`), then the tied copies' gradients over
    ``tied_group`` (one all-reduce of (V, C))."""
    if tp_group is not None:
        sync_sequence_parallel_grads(model, tp_group)
    here = tied_copies(model)
    for p in here:
        if p.grad is None:
            p.grad = get_array_module(p.data).zeros_like(p.data)
    if len(here) == 2:  # both ends on this rank (the "v" placement): added here, nothing sent
        total = here[0].grad + here[1].grad
        for p in here:
            p.grad[...] = total
    elif here and tied_group is not None:
        tied_group.all_reduce(here[0].grad, op="sum", label="gradient: tied embedding copies")


def complete_shards(shards, tied, tp_group, tied_group) -> None:
    """Complete ZeRO's gradient shards (``shard.grad``): the sequence-parallel elements of each shard
    (its mask) all-reduced over ``tp_group``, and the shards of the units holding only a tied copy
    (``tied``: those parameters) summed over ``tied_group``; their units have the same length on both
    ends, so the shards line up."""
    if tp_group is not None and tp_group.size > 1:
        for s in shards:
            if s.sequence_parallel.any():
                partial = s.grad[s.sequence_parallel]  # (k,) a copy
                s.grad[s.sequence_parallel] = tp_group.all_reduce(
                    partial, label=f"gradient: sequence-parallel partial sums of {s.name} over tp")
    ids = {id(p) for p in tied}
    pair = [s for s in shards if len(s.unit.params) == 1 and id(s.unit.params[0][1]) in ids]
    if len(pair) != len(tied):
        raise RuntimeError(f"{len(tied)} tied embedding copies, but {len(pair)} units hold one alone")
    if len(pair) == 2:  # both copies on this rank (ZB-V's placement): added here, nothing sent
        total = pair[0].grad + pair[1].grad
        for s in pair:
            s.grad[...] = total
    elif pair and tied_group is not None:
        tied_group.all_reduce(pair[0].grad, op="sum", label="gradient: tied embedding copies (shards)")
