"""Text generation from a model split over ranks: the same tokens as one process's ``GPT.generate``.

Every rank of the mesh calls :func:`generate` with the same prompt and the same seeded Generator.
Each new token is one forward of the context (its last block_size tokens) through this rank's part
of the model, then :func:`~minidist.model.sample_token`, the one-process sampling rule:

    data parallelism / ZeRO   every replica runs the whole thing for itself, with the same numbers
                              (ZeRO-3's forward hooks all-gather each unit's parameters over dp, as
                              in training: the replicas move in step)
    tensor parallelism        the last position's vocabulary slices (B, V_pad/tp) are all-gathered
                              over tp: every tp rank holds the full (B, V) logits and samples the same
                              token (an all-gather gives every rank the same bytes)
    sequence parallelism      the context is padded on the right to a multiple of tp (token 0); causal
                              attention keeps the padding out of the real positions, whose logits are
                              read at the last real position
    context parallelism       padded the same way, to what the cp split needs (cp parts, 2 cp for
                              zig-zag, each again by tp under sequence parallelism); the cp rank that
                              holds the last real position broadcasts its (B, V_pad/tp) logits over cp
    pipeline parallelism      stage s sends its (B, T, C) activation (T/tp under sequence
                              parallelism) to stage s + 1, in stage order (interleaved chunks too); the
                              last stage samples and broadcasts the B new tokens (int64) over pp

What one new token sends, per rank, beyond the model's own forward (tp's all-reduces, ZeRO-3's
all-gathers): one all-gather of B x V_pad/tp logits over tp; under cp, one broadcast of them over
cp first; under pp, one (B, T, C) activation per stage boundary and one broadcast of B int64 over pp. Every rank draws ``rng.random((B, 1))`` for
every token, used or not, so all ranks' Generators stay in step with one process's.
"""
from __future__ import annotations

import numpy as np

from minidist.autograd import Tensor, get_array_module, no_grad, to_numpy
from minidist.model import sample_token
from minidist.parallel.context.context_parallel import tokens_multiple
from minidist.parallel.pipeline.actions import Action, stage_rank
from minidist.parallel.pipeline.p2p import StageLink
from minidist.parallel.pipeline.stages import PipelineStage


def generate(model, idx, max_new_tokens: int, temperature: float = 1.0, top_k=None, rng=None, pp_group=None):
    """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T) with this rank's part of the model:
    a GPT, its tensor-parallel shard (with or without sequence parallelism), either under ZeRO, or
    a :class:`PipelineStage` of them over ``pp_group`` (required then). Returns a NumPy array
    (B, T + max_new_tokens), the same on every rank and equal to ``GPT.generate`` of the whole model
    with the same ``rng`` state. Collective over the model's tp group, ``pp_group`` and (ZeRO-3) dp:
    every rank must call it with the same arguments; see the module docstring for what it sends."""
    pipeline = isinstance(model, PipelineStage)
    if pipeline and (pp_group is None or pp_group.size != model.pp_size or pp_group.rank != model.pp_rank):
        raise ValueError(f"a pipeline stage (pp rank {model.pp_rank} of {model.pp_size}) generates with its pp "
                         f"group: pass pp_group (the mesh's pp_group), got {pp_group!r}")
    rng = np.random.default_rng() if rng is None else rng
    idx = to_numpy(idx)
    first = next(iter(model.parameters()))
    xp = get_array_module(first.data)  # the model's memory: feed it there
    with no_grad():
        for _ in range(max_new_tokens):
            context = idx[:, -model.config.block_size:]  # (B, T)
            u = rng.random((len(idx), 1))  # (B, 1) on every rank: the streams stay in step
            padded = xp.asarray(pad_for_sequence_splits(model, context))  # (B, T')
            if pipeline:
                logits = pipeline_logits(model, padded, pp_group, first.dtype)  # (B, T', V_pad/tp) or None
            else:
                logits = model(padded)[0]  # (B, T', V_pad/tp)
            nxt = np.zeros(len(idx), dtype=np.int64)  # (B,)
            if logits is not None:  # the last stage (every rank without a pipeline)
                last = gather_vocab(model, position_logits(model, logits.data, context.shape[1] - 1,
                                                           padded.shape[1]))  # (B, V)
                nxt[:] = sample_token(to_numpy(last), u, temperature, top_k)
            if pipeline:
                last_rank = stage_rank(model.n_stages - 1, pp_group.size, model.placement)
                pp_group.broadcast(nxt, src=last_rank, label="activation: the sampled tokens, from the last stage")
            idx = np.concatenate([idx, nxt[:, None].astype(idx.dtype)], axis=1)
    return idx


def pad_for_sequence_splits(model, context) -> np.ndarray:
    """``context`` (B, T), with token 0 appended up to the shortest length the model's sequence
    splits cut evenly: cp parts (2 cp for zig-zag) under context parallelism, each of them (or the
    whole sequence) into tp parts under sequence parallelism; unchanged without them. Nothing sent."""
    tp = model.tp_group.size if getattr(model, "sequence_parallel", False) else 1
    cp = model.context_parallel
    parts, per_rank = (1, 1) if cp is None else (tokens_multiple(cp.size, cp.algorithm), cp.size)
    B, T = context.shape
    length = T
    while length % parts or (length // per_rank) % tp:
        length += 1
    if length > model.config.block_size:
        raise ValueError(f"the sequence splits (cp parts {parts}, tp {tp}) pad a {T}-token context to {length} "
                         f"tokens, more than block_size {model.config.block_size}: use a block_size they divide")
    return np.concatenate([context, np.zeros((B, length - T), dtype=context.dtype)], axis=1)  # (B, length)


def position_logits(model, logits, position: int, T: int):
    """The logits (B, V_pad/tp) at ``position`` of a T-token sequence from this rank's ``logits``
    (B, T_local, V_pad/tp). Under context parallelism the cp rank holding that position broadcasts
    them over the cp group (B x V_pad/tp values); without it they are here."""
    cp = model.context_parallel
    if cp is None:
        return logits[:, position, :]
    owner, local = cp.owner(position, T)
    xp = get_array_module(logits)
    row = xp.ascontiguousarray(logits[:, local, :]) if cp.group.rank == owner else xp.empty_like(logits[:, 0, :])
    label = "activation: the last position's logits, from the cp rank holding it"
    return cp.group.broadcast(row, src=owner, label=label)


def gather_vocab(model, logits):
    """One position's logits (B, V) from this rank's vocabulary slice (B, V_pad/tp): an all-gather
    over the model's tp group of B x V_pad/tp values, padding columns dropped. Returned as is without
    tensor parallelism."""
    group = getattr(model, "tp_group", None)
    if group is None:
        return logits
    xp = get_array_module(logits)
    B, per_rank = logits.shape
    full = group.all_gather(xp.ascontiguousarray(logits)[None], label="activation: the next token's logits, every "
                            "rank's vocabulary shard")  # (tp, B, V_pad/tp)
    return full.transpose(1, 0, 2).reshape(B, group.size * per_rank)[:, :model.config.vocab_size]  # (B, V)


def pipeline_logits(stage: PipelineStage, idx, pp_group, dtype):
    """One forward of token ids ``idx`` (B, T) through the pipeline, stage after stage (this rank
    runs its chunks in stage order, receiving each chunk's input from the previous stage's rank and
    sending its output to the next one's: one (B, T, C) activation per stage boundary, with the
    pipeline's own tags and placement, see p2p.py). Returns the logits (B, T, V_pad/tp) on the rank
    holding the last stage, None elsewhere."""
    shape = stage.activation_shape(*idx.shape)  # (B, T, C), T/tp under sequence parallelism
    link = StageLink(pp_group, get_array_module(idx), stage.placement, shape, dtype)
    logits = out = None
    for chunk, s in enumerate(stage.stages):
        local = s > 0 and s - 1 in stage.stages  # the previous stage is this rank's too (ZB-V's V): handed over
        if s > 0 and not local:
            link.post([(Action("RECV_F", s, 0), None)])  # a round of its own
        x = idx if s == 0 else out if local else Tensor(link.take(Action("RECV_F", s, 0)))
        out = stage(chunk, x)  # (B, T, C), or the logits (B, T, V_pad/tp) on the last stage
        if s == stage.n_stages - 1:
            logits = out
        elif s + 1 not in stage.stages:
            link.post([(Action("SEND_F", s, 0), out.data)])
    link.wait_sends()
    return logits
