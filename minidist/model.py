"""A GPT-2-style language model, nanoGPT's architecture on minidist's autograd.

Parameter names are GPT-2's (``transformer.h.0.attn.c_attn.weight``) and layouts nanoGPT's (Linear weights
(out, in)), so a state_dict loads into nanoGPT / PyTorch code; Hugging Face's GPT-2 stores its Conv1D
weights (in, out), which ``minidist/checkpoint/hf.py`` converts both ways. The model is cut where parallelism
cuts it: ``embed`` -> the blocks -> ``head`` (pipeline stages), c_attn / c_fc / c_proj as separate
Linears, attention sized by its weights and the loss a swappable ``cross_entropy`` (tensor parallelism
turns this same model into one rank's shard: minidist/parallel/tensor/apply.py). A training forward
given a :class:`~minidist.nn.dropout.DropoutKey` drops where nanoGPT does (minidist/nn/dropout.py);
without one (evaluation, generation) nothing is dropped.
"""
import math
from dataclasses import dataclass

import numpy as np

from minidist import nn
from minidist.autograd import cross_entropy, gelu, get_array_module, no_grad, self_attention, to_numpy
from minidist.nn.dropout import Dropout
from minidist.moe import MoE, is_moe_layer


@dataclass
class GPTConfig:
    vocab_size: int = 256  # bytes
    block_size: int = 64  # longest context
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    bias: bool = True  # biases in Linears and LayerNorms
    tie_embeddings: bool = True  # lm_head.weight is transformer.wte.weight
    n_experts: int = 0  # > 0: mixture-of-experts MLPs (minidist/moe.py) in every moe_every-th block
    top_k: int = 2  # experts per token
    moe_every: int = 1
    capacity_factor: float = 0.0  # 0: dropless
    aux_loss_coef: float = 0.01  # the load-balancing loss's weight


def gpt2_init(name: str, shape, seed: int, n_layer: int) -> np.ndarray:
    """GPT-2's initial value (float64) for parameter ``name``: biases 0, LayerNorm weights 1, c_proj
    weights N(0, (0.02/sqrt(2 n_layer))^2) (scaled for the residual sum), other weights N(0, 0.02^2);
    random draws depend only on (seed, name, shape)."""
    module, kind = name.split(".")[-2:]
    if kind == "bias":
        return np.zeros(shape)
    if module.startswith("ln_"):
        return np.ones(shape)
    std = 0.02 / math.sqrt(2 * n_layer) if module == "c_proj" else 0.02  # (experts' stacked c_proj too)
    return nn.init.normal(seed, name, shape, std)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention. The number of heads is read from c_attn's width, so a
    tensor-parallel shard holding some of the heads runs this same code. :meth:`attend` is the
    attention itself; context parallelism replaces it with one that reaches the other ranks' tokens
    (minidist/parallel/context/context_parallel.py)."""

    def __init__(self, config: GPTConfig, dtype="float32"):
        super().__init__()
        C = config.n_embd
        self.head_dim = C // config.n_head
        self.c_attn = nn.Linear(C, 3 * C, bias=config.bias, dtype=dtype)  # q, k, v for all heads
        self.c_proj = nn.Linear(C, C, bias=config.bias, dtype=dtype)

    def forward(self, x, dropout=None):  # dropout: the probabilities' AttentionDropout, or None
        n_head = self.c_attn.out_features // 3 // self.head_dim  # local heads only under TP
        return self.c_proj(self.attend(self.c_attn(x), n_head, dropout))  # (B, T, 3 nh hs) -> (B, T, nh hs) -> (B, T, C)

    def attend(self, qkv, n_head: int, dropout=None):
        """Causal attention of the fused projection ``qkv`` (B, T, 3 nh hs: q | k | v, ``n_head``
        heads side by side in each) to (B, T, nh hs): query t sees keys 0..t."""
        return self_attention(qkv, n_head, dropout)


class MLP(nn.Module):
    """Position-wise feed-forward: C -> 4C, GELU, 4C -> C."""

    def __init__(self, config: GPTConfig, dtype="float32"):
        super().__init__()
        C = config.n_embd
        self.c_fc = nn.Linear(C, 4 * C, bias=config.bias, dtype=dtype)
        self.c_proj = nn.Linear(4 * C, C, bias=config.bias, dtype=dtype)

    def forward(self, x):  # (B, T, C)
        return self.c_proj(gelu(self.c_fc(x)))  # (B, T, 4C) inside


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)); the mlp is a
    mixture of experts (minidist/moe.py) in the blocks :func:`~minidist.moe.is_moe_layer` names.
    ``layer`` is its index in the whole model (dropout's masks depend on it)."""

    def __init__(self, config: GPTConfig, dtype="float32", layer: int = 0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias, dtype=dtype)
        self.attn = CausalSelfAttention(config, dtype)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias, dtype=dtype)
        self.mlp = MoE(config, dtype) if is_moe_layer(config, layer) else MLP(config, dtype)
        self.layer = layer

    def forward(self, x, dropout=None):  # (B, T, C); dropout: the pass's Dropout, or None
        y = self.attn(self.ln_1(x), dropout and dropout.attention(self.layer))  # (B, T, C)
        x = x + (y if dropout is None else dropout.residual(y, self.layer, "attention output"))
        y = self.mlp(self.ln_2(x))  # (B, T, C)
        return x + (y if dropout is None else dropout.residual(y, self.layer, "mlp output"))


class GPT(nn.Module):
    """GPT-2: token + position embeddings, ``n_layer`` Blocks, final LayerNorm, LM head.

    ``GPT(config, seed, dtype)`` initialises every parameter with :func:`gpt2_init`. Under context
    parallelism ``context_parallel`` says which tokens of each sequence this rank holds (embed and
    head keep only those; minidist/parallel/context/context_parallel.py); None: all of them.
    ``cross_entropy(logits, targets)`` is the head's loss; tensor parallelism installs the
    vocab-parallel one (minidist/parallel/tensor/apply.py).
    """
    context_parallel = None
    cross_entropy = staticmethod(cross_entropy)

    def __init__(self, config: GPTConfig, seed: int = 0, dtype="float32"):
        super().__init__()
        self.config = config
        C, V = config.n_embd, config.vocab_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(V, C, dtype=dtype),
            wpe=nn.Embedding(config.block_size, C, dtype=dtype),
            h=nn.ModuleList([Block(config, dtype, i) for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(C, bias=config.bias, dtype=dtype),
        ))
        self.lm_head = nn.Linear(C, V, bias=False, dtype=dtype)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight  # one Parameter, two names
        for name, p in self.named_parameters():
            p.data[...] = gpt2_init(name, p.shape, seed, config.n_layer)

    def embed(self, idx, dropout=None):
        """Token ids (B, T) -> token + position embeddings (B, T, C), or this rank's (B, T/cp, C)
        under context parallelism, dropped by ``dropout`` (the pass's Dropout, or None). The first
        pipeline stage."""
        idx, pos = local_tokens(self, idx)  # (B, T) and (T,), or this rank's T/cp of them
        tok_emb = self.transformer.wte(idx)  # (B, T, C)
        pos_emb = self.transformer.wpe(pos)  # (T, C)
        x = tok_emb + pos_emb  # (B, T, C)
        return x if dropout is None else dropout.residual(x, -1, "embedding")

    def head(self, x, targets=None):
        """Hidden states (B, T, C) -> (logits (B, T, V), mean cross-entropy or None). The last stage."""
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits, None
        return logits, sequence_loss(self, self.cross_entropy, logits, targets)

    def forward(self, idx, targets=None, dropout=None):
        """(logits (B, T, V), loss) for token ids ``idx`` (B, T); loss is None without ``targets``.
        ``dropout``: a DropoutKey (a training step's rows), or None: nothing dropped."""
        drop = dropout_of(self, dropout)
        x = self.embed(idx, drop)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x, drop)  # (B, T, C)
        return self.head(x, targets)

    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k=None, rng=None):
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T); returns a NumPy array
        (B, T + max_new_tokens). Each step feeds the last block_size tokens, divides the last logits
        by ``temperature``, keeps the ``top_k`` largest, and samples with one ``rng.random((B, 1))``
        per token (``rng``: a NumPy Generator; a fresh unseeded one if None): :func:`sample_token`.
        The model runs where its parameters are; sampling runs on the host, on a copy of the last
        position's (B, V) logits. The one-process reference of minidist/parallel/whole_model/generate.py."""
        rng = np.random.default_rng() if rng is None else rng
        idx = to_numpy(idx)
        xp = get_array_module(self.transformer.wte.weight.data)  # the model's memory: feed it there
        with no_grad():
            for _ in range(max_new_tokens):
                logits, _ = self(xp.asarray(idx[:, -self.config.block_size:]))
                u = rng.random((len(idx), 1))  # (B, 1)
                nxt = sample_token(to_numpy(logits.data[:, -1, :]), u, temperature, top_k)  # (B,)
                idx = np.concatenate([idx, nxt[:, None].astype(idx.dtype)], axis=1)
        return idx


def local_tokens(model, idx):
    """(ids, positions) of the tokens of ``idx`` (B, T) that ``model`` computes on: all of them,
    (B, T) and arange(T), or under context parallelism this rank's (B, T/cp) and their positions."""
    T = idx.shape[1]
    if T > model.config.block_size:
        raise ValueError(f"sequence length {T} exceeds block_size {model.config.block_size}")
    xp = get_array_module(model.transformer.wpe.weight.data)
    cp = model.context_parallel
    if cp is None:
        return idx, xp.arange(T)
    return cp.shard(idx), cp.positions(T, xp)


def dropout_of(model, key):
    """This rank's :class:`~minidist.nn.dropout.Dropout` of ``model`` (a GPT, or a part of one with
    its ``config``, ``context_parallel``, ``sequence_parallel``, ``tp_group`` and ``heads``) for
    ``key`` (a DropoutKey; None, or p = 0: None): the global positions of its residual stream's
    tokens (context parallelism's, then under sequence parallelism this tp rank's block of them)
    and the global indices of its heads (tensor parallelism's, ``parallel/tensor/layout.py``)."""
    if key is None or key.p == 0:
        return None
    cp = model.context_parallel
    positions = np.arange(key.seq_len) if cp is None else cp.positions(key.seq_len, np)
    if getattr(model, "sequence_parallel", False):
        positions = np.array_split(positions, model.tp_group.size)[model.tp_group.rank]
    heads = getattr(model, "heads", None)
    return Dropout(key, positions, range(model.config.n_head) if heads is None else heads)


def sequence_loss(model, loss_fn, logits, targets):
    """``loss_fn(logits, targets)``, the mean over the tokens ``model`` computed on; under context
    parallelism over this rank's targets, averaged over the cp ranks (the whole sequence's mean)."""
    cp = model.context_parallel
    if cp is None:
        return loss_fn(logits, targets)
    return cp.average_loss(loss_fn(logits, cp.shard(targets)))


def sample_token(logits, u, temperature: float = 1.0, top_k=None) -> np.ndarray:
    """The sampling rule of :meth:`GPT.generate` (and of every parallel layout's generation): the
    next token (B,) from one position's logits (B, V) (a host array) and uniform draws ``u`` (B, 1)
    in [0, 1). The logits, in float64, are divided by ``temperature``, all but the ``top_k`` largest
    are dropped, and the token is the first whose softmax cumulative sum exceeds ``u`` (inverse CDF)."""
    logits = np.asarray(logits).astype(np.float64) / temperature  # (B, V)
    if top_k is not None:
        kth = np.sort(logits, axis=-1)[:, [-min(top_k, logits.shape[-1])]]  # (B, 1)
        logits[logits < kth] = -np.inf
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)  # (B, V)
    return np.minimum((probs.cumsum(axis=-1) <= u).sum(axis=-1), probs.shape[-1] - 1)  # (B,)
