"""The GPT with tensor parallelism (and optionally sequence parallelism) over one group of n ranks.

Same modules, names and cut (``embed`` -> ``transformer.h`` -> ``head``) as :class:`minidist.model.GPT`;
the big matrices are shards (which part of which: the table in :mod:`minidist.parallel.tensor.layout`).
Where each rank talks to the others, per transformer block:

    x ──ln_1──f──[c_attn: my heads' q,k,v]──attention(my heads)──[c_proj: my rows]──g──+ x
    x ──ln_2──f──[c_fc: my columns]──GELU──[c_proj: my rows]──g──+ x

A mixture-of-experts block (minidist/moe.py) splits every expert like the dense MLP, and its router
by experts (column-parallel, then an all-gather of the logits: every rank routes every token the
same way); the experts' partial outputs are summed over tp where the experts run, before their
bias, and the combined output leaves the region as it is (under sequence parallelism: this rank's
T/n tokens of it):

    x ──ln_2──f──[router: my E/n logits]──all-gather──top-k ──┐
                 └─────────────────── rows by expert ─────────┴─[experts: my columns, my rows]──all-reduce──+bias──combine──+ x

f: identity forward, all-reduce backward; g: all-reduce forward, identity backward. With
``sequence_parallel`` x, the LayerNorms and residual adds hold only this rank's T/n tokens, f is an
all-gather (backward reduce-scatter) and g a reduce-scatter (backward all-gather). Around the
blocks: the vocab-parallel embedding ends in g, the LM head starts with f, and the vocab-parallel
cross-entropy costs 3 small all-reduces.
"""

from minidist import nn
from minidist.model import MLP, Block, CausalSelfAttention, GPTConfig, gpt2_init, local_tokens, sequence_loss
from minidist.moe import Experts, MoE, is_moe_layer
from minidist.parallel.tensor.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, enter_tensor_parallel_region,
                                               gather_from_tensor_parallel_region,
                                               reduce_from_tensor_parallel_region,
                                               scatter_to_sequence_parallel_region)
from minidist.parallel.tensor.layout import divide, global_shape, is_expert, padded_vocab_size, shard_for
from minidist.parallel.tensor.vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy


class TensorParallelAttention(CausalSelfAttention):
    """CausalSelfAttention over this rank's n_head/n heads: c_attn column-parallel, c_proj row-parallel.
    The forward is the parent's, which reads the number of heads from c_attn's (local) width."""

    def __init__(self, config: GPTConfig, tp_group, sequence_parallel: bool, dtype):
        nn.Module.__init__(self)
        C = config.n_embd
        self.head_dim = C // config.n_head
        self.c_attn = ColumnParallelLinear(C, 3 * C, tp_group, bias=config.bias, dtype=dtype)
        self.c_proj = RowParallelLinear(C, C, tp_group, bias=config.bias, dtype=dtype,
                                        sequence_parallel=sequence_parallel)


class TensorParallelMLP(MLP):
    """MLP with c_fc column-parallel (4C/n hidden units here) and c_proj row-parallel."""

    def __init__(self, config: GPTConfig, tp_group, sequence_parallel: bool, dtype):
        nn.Module.__init__(self)
        C = config.n_embd
        self.c_fc = ColumnParallelLinear(C, 4 * C, tp_group, bias=config.bias, dtype=dtype)
        self.c_proj = RowParallelLinear(4 * C, C, tp_group, bias=config.bias, dtype=dtype,
                                        sequence_parallel=sequence_parallel)


class TensorParallelRouter(ColumnParallelLinear):
    """The router's logits for this rank's E/n experts (column-parallel), all-gathered: every rank
    gets all E logits of every token (backward keeps the gradient of its own E/n)."""

    def __init__(self, config: GPTConfig, tp_group, dtype):
        super().__init__(config.n_embd, config.n_experts, tp_group, bias=False, dtype=dtype)
        self.tp_group = tp_group

    def forward(self, x):  # (N, C) -> (N, E)
        return gather_from_tensor_parallel_region(super().forward(x), self.tp_group)


class TensorParallelExperts(Experts):
    """The experts with every expert's hidden units split: c_fc by columns (axis 1 of (E, 4C, C)),
    c_proj by rows (axis 2 of (E, C, 4C)); the partial outputs are all-reduced over the group
    before the (replicated) c_proj bias is added."""

    def __init__(self, config: GPTConfig, tp_group, dtype):
        hidden = divide(4 * config.n_embd, tp_group.size, "each expert's hidden units")
        super().__init__(config.n_experts, config.n_embd, hidden, config.bias, dtype)
        self.tp_group = tp_group
        for p in (self.c_fc.weight, self.c_fc.bias, self.c_proj.weight):
            if p is not None:
                p.tensor_parallel = True

    def reduce_partial(self, y):
        return reduce_from_tensor_parallel_region(y, self.tp_group)


class TensorParallelMoE(MoE):
    """The mixture of experts over the group (module docstring); under sequence parallelism its
    output keeps this rank's T/n tokens (backward all-gathers their gradients)."""

    def __init__(self, config: GPTConfig, tp_group, sequence_parallel: bool, dtype):
        super().__init__(config, dtype)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.router = TensorParallelRouter(config, tp_group, dtype)
        self.experts = TensorParallelExperts(config, tp_group, dtype)

    def forward(self, x):  # (B, T, C), the same on every rank -> (B, T, C), or (B, T/n, C) under SP
        y = super().forward(x)
        return scatter_to_sequence_parallel_region(y, self.tp_group) if self.sequence_parallel else y


class TensorParallelBlock(Block):
    """Block whose attention and MLP are split over the group; f (or the all-gather) enters each."""

    def __init__(self, config: GPTConfig, tp_group, sequence_parallel: bool, dtype, layer: int = 0):
        nn.Module.__init__(self)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias, dtype=dtype)
        self.attn = TensorParallelAttention(config, tp_group, sequence_parallel, dtype)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias, dtype=dtype)
        self.mlp = (TensorParallelMoE if is_moe_layer(config, layer) else TensorParallelMLP)(
            config, tp_group, sequence_parallel, dtype)

    def forward(self, x):  # (B, T, C), or (B, T/n, C) under sequence parallelism
        x = x + self.attn(enter_tensor_parallel_region(self.ln_1(x), self.tp_group, self.sequence_parallel))
        x = x + self.mlp(enter_tensor_parallel_region(self.ln_2(x), self.tp_group, self.sequence_parallel))
        return x


class TensorParallelGPT(nn.Module):
    """GPT-2 split over ``tp_group`` (built by :func:`build_tp_gpt`). ``forward(idx, targets)`` returns
    (logits, loss): logits (B, T, V_pad/n) are this rank's slice of the padded vocabulary (rank r holds
    columns [r V_pad/n, (r+1) V_pad/n); columns >= vocab_size are padding), loss is the full mean
    cross-entropy, bitwise the same on every rank."""
    context_parallel = None  # or this rank's part of context parallelism, as in minidist.model.GPT

    def __init__(self, config: GPTConfig, seed: int, dtype, tp_group, sequence_parallel: bool = False):
        super().__init__()
        n = tp_group.size
        if config.n_head % n:
            raise ValueError(f"tensor parallelism splits heads: n_head = {config.n_head} is not divisible by tp = {n}")
        self.config, self.tp_group, self.sequence_parallel = config, tp_group, sequence_parallel
        C, V = config.n_embd, config.vocab_size
        self.transformer = nn.ModuleDict(dict(
            wte=VocabParallelEmbedding(V, C, tp_group, dtype=dtype, sequence_parallel=sequence_parallel),
            wpe=nn.Embedding(config.block_size, C, dtype=dtype),
            h=nn.ModuleList([TensorParallelBlock(config, tp_group, sequence_parallel, dtype, i)
                             for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(C, bias=config.bias, dtype=dtype),
        ))
        self.lm_head = ColumnParallelLinear(C, padded_vocab_size(V, n), tp_group, bias=False, dtype=dtype)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight  # one shard, two names
        for name, p in self.named_parameters():
            p.sequence_parallel = sequence_parallel and not (p.tensor_parallel or p.expert)  # sees only my tokens
            # (an expert's replicated c_proj bias sees every token: the experts run on the gathered sequence)
            p.data[...] = shard_for(name, gpt2_init(name, full_shape(name, p.shape, config, n), seed,
                                                    config.n_layer), tp_group.rank, n)

    def embed(self, idx):
        """Token ids (B, T) -> embeddings (B, T, C), or this rank's tokens (B, T/n, C) under sequence
        parallelism; T is this cp rank's T/cp under context parallelism. The first pipeline stage."""
        idx, pos = local_tokens(self, idx)  # (B, T) and (T,), or this cp rank's T/cp of them
        T, n = idx.shape[1], self.tp_group.size
        if self.sequence_parallel and T % n:
            raise ValueError(f"sequence parallelism splits the sequence: T = {T} is not divisible by tp = {n}")
        tok_emb = self.transformer.wte(idx)  # (B, T, C) or (B, T/n, C): summed over the group inside
        if self.sequence_parallel:
            pos = pos[self.tp_group.rank * T // n:(self.tp_group.rank + 1) * T // n]  # my T/n of them
        return tok_emb + self.transformer.wpe(pos)  # (T, C) or (T/n, C) broadcast over B

    def head(self, x, targets=None):
        """Hidden states -> (this rank's logits (B, T, V_pad/n), mean cross-entropy or None)."""
        x = enter_tensor_parallel_region(self.transformer.ln_f(x), self.tp_group, self.sequence_parallel)
        logits = self.lm_head(x)  # (B, T, V_pad/n)
        if targets is None:
            return logits, None

        def loss_fn(logits, targets):
            return vocab_parallel_cross_entropy(logits, targets, self.tp_group, self.config.vocab_size)
        return logits, sequence_loss(self, loss_fn, logits, targets)

    def forward(self, idx, targets=None):
        """(logits (B, T, V_pad/n), loss) for token ids ``idx`` (B, T); loss is None without targets."""
        x = self.embed(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.head(x, targets)


def full_shape(name: str, local_shape, config: GPTConfig, tp_size: int) -> tuple:
    """The single-process shape of parameter ``name`` whose shard on one of ``tp_size`` ranks has
    ``local_shape`` (:func:`~minidist.parallel.tensor.layout.global_shape` with ``config``'s vocabulary;
    a stacked expert parameter has all ``config.n_experts`` experts, whatever block of them it holds)."""
    shape = global_shape(name, local_shape, tp_size, config.vocab_size)
    return (config.n_experts,) + shape[1:] if is_expert(name) else shape


def build_tp_gpt(config: GPTConfig, seed: int, dtype, tp_group, sequence_parallel: bool = False) -> TensorParallelGPT:
    """This rank's part of the GPT: every parameter is :func:`shard_for` of ``gpt2_init``'s full value
    (so it starts from exactly the single-process weights); shards carry ``tensor_parallel = True``,
    replicated parameters ``False`` (and ``sequence_parallel = True`` under sequence parallelism: see
    :func:`~minidist.parallel.tensor.tensor_parallel.sync_sequence_parallel_grads`). Collective over ``tp_group``
    only in that every rank must build the same configuration."""
    return TensorParallelGPT(config, seed, dtype, tp_group, sequence_parallel)
