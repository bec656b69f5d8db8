"""Context parallelism: every sequence cut over the ranks of a cp group, attention joining the pieces.

Long sequences make the activations, not the weights, the memory that runs out: each layer keeps
(B, T, C) values and attention's (T x T) scores. Context parallelism gives each of the n ranks of
the cp group 1/n of every sequence's tokens, everywhere in the model: embeddings, LayerNorms, MLPs,
the LM head and the loss all work token by token, so they run on the local tokens unchanged. Only
attention needs other tokens (a query attends to every earlier key), and three algorithms bring them:

    ring      rank r holds tokens [r T/n, (r+1) T/n); K/V blocks travel around the ring,
              partial results merged with the online softmax (ring_attention.py)
    zigzag    the ring, with the sequence cut into 2n chunks and rank r holding chunks r and
              2n-1-r, so that every rank does the same causal work
    ulysses   two all-to-alls swap the sequence split for a head split around ordinary attention
              (ulysses.py); needs the heads to divide by n

Parameters are not split: cp ranks hold the same weights and see different tokens of the same
rows. The loss is the mean over the cp ranks' token means (one scalar all-reduce in forward, so
every rank reports the one-process loss), and its backward is that mean's exact derivative, 1/cp
to each rank: every activation gradient then has the value it has in one process (in float16 a
smaller slice of tokens does not scale gradients up toward overflow). A rank's parameter gradient
is the part its tokens contribute, so the gradient sync over dp x cp (``mesh.dp_cp_group``,
DataParallel or ZeRO with ``replicas = dp``) sums over cp and averages over dp.

Composition: tensor parallelism splits the heads first; ring attention then runs on this tp rank's
heads, Ulysses splits them further by n. Sequence parallelism cuts this rank's T/n tokens again by
tp. Pipelines pass (B, T/n, C) activations. ZeRO shards over dp x cp.
"""
from __future__ import annotations

from minidist.autograd import Function, get_array_module, merge_heads, split_heads
from minidist.moe import MoE
from minidist.parallel.context.ring_attention import ring_attention, sequence_chunks
from minidist.parallel.context.ulysses import ulysses_attention

ALGORITHMS = ("ring", "zigzag", "ulysses")


def tokens_multiple(cp_size: int, algorithm: str) -> int:
    """What the sequence length must divide by: 2 cp for zig-zag (2 cp equal chunks), else cp."""
    return 2 * cp_size if algorithm == "zigzag" else cp_size


class AverageOverContextParallel(Function):
    """Forward: the mean of the cp ranks' losses (an all-reduce of one value), so every rank
    reports the whole sequence's loss. Backward: its derivative with respect to this rank's loss,
    ``grad / cp`` (no communication: the other ranks' terms are theirs)."""

    @staticmethod
    def forward(ctx, loss, group):
        ctx.n = group.size
        return group.all_reduce(loss.reshape(1).copy(), op="avg", label="metric: mean loss over cp").reshape(loss.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.n, None


class ContextParallel:
    """This rank's part of context parallelism over ``group`` with ``algorithm`` (ring, zigzag or
    ulysses): which tokens of each sequence it holds (:meth:`positions`), its attention
    (:meth:`attend`), and the loss average. :func:`context_parallel` attaches one to a model."""

    def __init__(self, group, algorithm: str = "ring"):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"cp algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
        self.group, self.algorithm = group, algorithm

    @property
    def size(self) -> int:
        return self.group.size

    def chunks(self, T: int) -> list[tuple[int, int]]:
        """The (start, stop) token ranges of a T-token sequence this rank holds, in local order."""
        if T % tokens_multiple(self.size, self.algorithm):
            raise ValueError(f"context parallelism ({self.algorithm}) over cp = {self.size} cuts a sequence into "
                             f"{tokens_multiple(self.size, self.algorithm)} equal parts: T = {T} does not divide")
        return sequence_chunks(T, self.size, self.group.rank, self.algorithm == "zigzag")

    def positions(self, T: int, xp):
        """This rank's token positions (T/cp,) of a T-token sequence, an index array of module ``xp``."""
        return xp.concatenate([xp.arange(a, b) for a, b in self.chunks(T)])

    def shard(self, tokens):
        """This rank's tokens (B, T/cp) of ``tokens`` (B, T): the input ids or the targets."""
        return tokens[:, self.positions(tokens.shape[1], get_array_module(tokens))]

    def whole_sequences(self, local, what: str):
        """Every cp rank's part (B, T/cp, ...) of ``local``, gathered into whole sequences (B, T, ...)
        in token order, the same on every rank. Sends one all-gather of ``local`` (``what`` names it in
        the trace's label)."""
        xp = get_array_module(local)
        n, T_local = self.size, local.shape[1]
        T = n * T_local
        gathered = self.group.all_gather(xp.ascontiguousarray(local.swapaxes(0, 1)),  # (n T/cp, B, ...) by rank
                                         label=f"activation: {what}, every cp rank's tokens")
        order = xp.concatenate([xp.arange(a, b) for r in range(n)  # every rank's positions, in rank order
                                for a, b in sequence_chunks(T, n, r, self.algorithm == "zigzag")])
        whole = xp.empty_like(gathered)
        whole[order] = gathered
        return whole.swapaxes(0, 1)

    def owner(self, position: int, T: int) -> tuple[int, int]:
        """(cp rank, local index) of the token at ``position`` of a T-token sequence."""
        for rank in range(self.size):
            offset = 0
            for a, b in sequence_chunks(T, self.size, rank, self.algorithm == "zigzag"):
                if a <= position < b:
                    return rank, offset + position - a
                offset += b - a
        raise ValueError(f"position {position} is outside a {T}-token sequence")

    def attend(self, qkv, n_head: int, dropout=None):
        """The model's attention (``CausalSelfAttention.attend``) with the other ranks' tokens reached:
        this rank's fused projection ``qkv`` (B, T/cp, 3 nh hs) to (B, T/cp, nh hs), by
        :meth:`attend_heads` on its heads."""
        return merge_heads(self.attend_heads(*split_heads(qkv, n_head), dropout))

    def attend_heads(self, q, k, v, dropout=None):
        """Causal attention of this rank's q, k, v (B, nh, T/cp, hs) over the whole sequence, its
        probabilities dropped by ``dropout`` (an AttentionDropout of the heads held, or None)."""
        if self.algorithm == "ulysses":
            return ulysses_attention(q, k, v, self.group, dropout)
        return ring_attention(q, k, v, self.group, zigzag=self.algorithm == "zigzag", dropout=dropout)

    def average_loss(self, loss):
        """The mean of the cp ranks' losses, the same on every rank (:class:`AverageOverContextParallel`)."""
        return AverageOverContextParallel.apply(loss, self.group)


def whole_sequence_routing(moe, cp: ContextParallel) -> None:
    """Make the mixture-of-experts layer ``moe`` (minidist/moe.py) apply its per-sequence rules to
    whole sequences while this rank holds 1/cp of each: its :meth:`~minidist.moe.MoE.keep` (the
    capacity, which reads a sequence's choices in order) runs on the choices all-gathered over the cp
    group, each rank keeping its own tokens' verdicts, and its
    :meth:`~minidist.moe.MoE.sequence_statistics` (the balance loss's counts and probability sums)
    are summed over the group. Sends, per forward: with a capacity factor one all-gather of the
    (B, T/cp, k) choices; with a balance loss, in grad mode, one all-reduce of (2, B, E) float64."""
    keep, statistics = moe.keep, moe.sequence_statistics  # the one-process rules, for whole sequences

    def keep_of_whole_sequences(experts):  # this rank's (B, T/cp, k) -> its verdicts (B, T/cp, k)
        if not moe.capacity_factor:
            return keep(experts)  # dropless: every assignment, nothing to gather
        whole = cp.whole_sequences(experts, "each token's chosen experts")  # (B, T, k)
        return keep(whole)[:, cp.positions(whole.shape[1], get_array_module(whole))]

    def statistics_of_whole_sequences(experts, p):  # this rank's tokens -> (2, B, E), T
        stats, T = statistics(experts, p)
        cp.group.all_reduce(stats, label="activation: the balance loss's expert counts and router probabilities "
                                         "per sequence, summed over cp")
        return stats, T * cp.size

    moe.keep, moe.sequence_statistics = keep_of_whole_sequences, statistics_of_whole_sequences


def context_parallel(model, group, algorithm: str = "ring"):
    """Make ``model`` (a GPT or its tensor-parallel shard, before it is cut into pipeline stages) run
    on this rank's 1/cp of every sequence: its embed keeps this rank's tokens, its attention layers
    attend over ``group`` with ``algorithm``, its head keeps this rank's targets and averages the
    loss over the group, and a mixture-of-experts layer reads whole sequences
    (:func:`whole_sequence_routing`). Returns ``model``. Sends nothing; every later forward is
    collective over ``group``."""
    cp = ContextParallel(group, algorithm)
    model.context_parallel = cp
    for block in model.transformer.h:
        block.attn.attend = cp.attend
        if isinstance(block.mlp, MoE):  # its capacity and balance statistics, per whole sequence
            whole_sequence_routing(block.mlp, cp)
    return model
