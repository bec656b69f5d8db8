"""Tensor parallelism (and optionally sequence parallelism) applied to a GPT: :func:`tensor_parallel`
makes the one-process model of minidist/model.py (dense or mixture of experts) this rank's shard of
it over a group of n ranks, in place, as ``context_parallel`` and ``expert_parallel`` do. The modules,
names and cut (``embed`` -> ``transformer.h`` -> ``head``) stay; every parameter keeps the part the
one table gives this rank (minidist/parallel/tensor/layout.py), and the forward changes only where
the ranks talk. Per transformer block:

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
cross-entropy costs 3 small all-reduces. What each module gets (the rest runs its one-process code
on its shard):

    every LayerNorm          its output enters the tp region: f (SP: the all-gather)
    c_attn, c_fc, lm_head    column-parallel: nothing, the Linear on its block of output rows
    both c_proj              row-parallel (tensor_parallel.py): g (SP: the reduce-scatter), then the bias
    transformer.wte          vocab-parallel (vocab_parallel.py): a lookup of my rows, then g
    transformer.wpe          under SP: this rank's T/n positions
    mlp.router               column-parallel, then the all-gather of the E logits
    mlp.experts              reduce_partial: g, before their bias
    mlp (MoE, under SP)      this rank's T/n tokens of its output
    the model                cross_entropy: the vocab-parallel one (vocab_parallel.py)
"""
from minidist import nn
from minidist.moe import MoE
from minidist.parallel.tensor.layout import shard_for, tp_heads, tp_layout
from minidist.parallel.tensor.tensor_parallel import (enter_tensor_parallel_region, gather_from_tensor_parallel_region,
                                                      reduce_from_tensor_parallel_region, row_parallel,
                                                      scatter_to_sequence_parallel_region)
from minidist.parallel.tensor.vocab_parallel import vocab_parallel_cross_entropy, vocab_parallel_embedding


def tensor_parallel(model, group, sequence_parallel: bool = False):
    """Make ``model`` (a whole GPT, dense or mixture of experts, any dtype; before context, expert or
    pipeline parallelism) this rank's tensor-parallel shard over ``group``, in place; returns it.

    Every parameter keeps :func:`shard_for` of its value: the one-process initial value, which
    depends only on (seed, name, shape), so every layout starts from the same weights (vocabulary
    padding rows zero). Shards are tagged ``tensor_parallel``, replicated parameters not, and under
    sequence parallelism a replicated parameter that sees only this rank's tokens ``sequence_parallel``
    (:func:`~minidist.parallel.compose.complete.sync_sequence_parallel_grads`). Then the forwards
    change where the ranks talk (module docstring), the model records ``tp_group``,
    ``sequence_parallel`` (the pipeline and generation read them) and ``heads`` (dropout's masks
    read them), and the Linears their local widths.

    Memory: the whole model exists from its construction until this call has cut it; each tensor
    is cut in turn and its full value freed as its shard replaces it. Fine at this engine's sizes
    (a larger engine would create each shard directly). Sends nothing; every later forward and
    backward is collective over ``group``."""
    config, n = model.config, group.size
    if config.n_head % n:
        raise ValueError(f"tensor parallelism splits heads: n_head = {config.n_head} is not divisible by tp = {n}")
    for name, p in model.named_parameters():
        p.data = shard_for(name, p.data, group.rank, n)
        p.tensor_parallel = tp_layout(name) != "replicated"
        p.sequence_parallel = sequence_parallel and not (p.tensor_parallel or p.expert)  # sees only my tokens
        # (an expert's replicated c_proj bias sees every token: the experts run on the gathered sequence)
    for _, module in model.named_modules():
        if isinstance(module, nn.Linear):  # attention counts its heads from c_attn's local width
            module.out_features, module.in_features = module.weight.shape
    t = model.transformer
    vocab_parallel_embedding(t.wte, config.vocab_size, group, sequence_parallel)
    if sequence_parallel:
        my_positions(t.wpe, group)
    for block in t.h:
        enter_after(block.ln_1, group, sequence_parallel, "the attention's input")
        row_parallel(block.attn.c_proj, group, sequence_parallel, "the attention's output")
        enter_after(block.ln_2, group, sequence_parallel, "the MLP's input")
        if isinstance(block.mlp, MoE):
            split_experts(block.mlp, group, sequence_parallel)
        else:
            row_parallel(block.mlp.c_proj, group, sequence_parallel, "the MLP's output")
    enter_after(t.ln_f, group, sequence_parallel, "the LM head's input")

    def cross_entropy(logits, targets):  # logits: this rank's vocabulary slice (B, T, V_pad/n)
        return vocab_parallel_cross_entropy(logits, targets, group, config.vocab_size)
    model.cross_entropy = cross_entropy
    model.tp_group, model.sequence_parallel = group, sequence_parallel
    model.heads = tp_heads(config.n_head, group.rank, n)  # the global heads this rank attends with
    return model


def enter_after(layer_norm, group, sequence_parallel: bool, what: str) -> None:
    """``layer_norm``'s output enters the tensor-parallel region, where a column-parallel layer reads
    it: f, or under sequence parallelism the all-gather of the sequence (B, T/n, C) -> (B, T, C).
    ``what`` names the output in the labels of the calls."""
    forward = layer_norm.forward
    layer_norm.forward = lambda x: enter_tensor_parallel_region(forward(x), group, sequence_parallel, what)


def my_positions(wpe, group) -> None:
    """Sequence parallelism: the position embedding ``wpe`` looks up only this rank's block of the
    positions it is given, T/n of them (the tokens the vocab-parallel embedding's reduce-scatter kept)."""
    forward = wpe.forward

    def forward_mine(pos):  # (T,) -> (T/n, C)
        T, r = len(pos), group.rank
        return forward(pos[r * T // group.size:(r + 1) * T // group.size])
    wpe.forward = forward_mine


def split_experts(moe, group, sequence_parallel: bool) -> None:
    """The mixture-of-experts layer ``moe`` over the group: its router gives this rank's E/n logits,
    all-gathered into every token's E (backward keeps this rank's block of their gradient); every
    expert holds its block of hidden units and their partial outputs are summed (g) before the
    bias; under sequence parallelism the combined output keeps this rank's T/n tokens (backward
    all-gathers their gradients)."""
    router = moe.router.forward
    moe.router.forward = lambda x: gather_from_tensor_parallel_region(router(x), group, "the router's logits")  # (N, E)
    moe.experts.reduce_partial = lambda y: reduce_from_tensor_parallel_region(y, group, "the experts' outputs")
    if sequence_parallel:
        forward = moe.forward
        moe.forward = lambda x: scatter_to_sequence_parallel_region(forward(x), group, "the experts' combined output")
