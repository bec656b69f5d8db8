"""The models the planner sizes: a transformer described by its shape, and the published presets.

One :class:`ModelSpec` covers minidist's own GPT-2 (LayerNorm, GELU MLP of 4C, biases, learned
positions, tied embeddings) and Llama-3 (RMSNorm, SwiGLU MLP of three matrices, no biases, rotary
positions, grouped-query attention, untied embeddings). Its parameters are counted tensor by tensor
and grouped into ZeRO's units, as ``minidist/parallel/zero/flat_buffer.py`` groups them: each block one
unit, each other module one unit (the embeddings, the position embeddings, the final norm, the LM
head). Tensor parallelism cuts them as ``minidist/parallel/tensor/layout.py``'s table says: q, k, v and
the MLP's input matrices by output rows (column parallel), the attention output and MLP output
matrices by input columns (row parallel), the vocabulary (padded to a multiple of t) by rows;
norms, position embeddings and the row-parallel biases stay whole on every rank.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass
from functools import lru_cache

from minidist.parallel.pipeline.stages import partition_layers
from minidist.parallel.tensor.layout import padded_vocab_size


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer by shape. ``n_kv_head`` None: as many as ``n_head`` (no GQA);
    ``ffn`` None: 4 ``n_embd``; ``gated``: a SwiGLU MLP (gate, up, down: three matrices);
    ``positions`` "learned" (a (block_size, C) table) or "rope" (no parameters); ``norm``
    "layernorm" (weight, and bias when ``bias``) or "rmsnorm" (weight). ``n_experts`` > 0: every
    ``moe_every``-th block's MLP is that many experts and a router (E x C), ``top_k`` per token."""
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    n_kv_head: int | None = None
    ffn: int | None = None
    gated: bool = False
    norm: str = "layernorm"
    bias: bool = True
    tied: bool = True
    positions: str = "learned"
    block_size: int = 1024
    n_experts: int = 0
    top_k: int = 2
    moe_every: int = 1

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def hidden(self) -> int:
        return self.ffn or 4 * self.n_embd

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` has experts (``minidist.moe.is_moe_layer``'s rule)."""
        return self.n_experts > 0 and layer % self.moe_every == self.moe_every - 1


PRESETS = {  # published shapes: GPT-2 (Radford et al. 2019), GPT-3 (Brown et al. 2020), Llama 3 (Meta 2024)
    "gpt2": ModelSpec("gpt2", 12, 768, 12, 50257),
    "gpt2-medium": ModelSpec("gpt2-medium", 24, 1024, 16, 50257),
    "gpt2-large": ModelSpec("gpt2-large", 36, 1280, 20, 50257),
    "gpt2-xl": ModelSpec("gpt2-xl", 48, 1600, 25, 50257),
    "gpt3-175b": ModelSpec("gpt3-175b", 96, 12288, 96, 50257, block_size=2048),
    **{name: ModelSpec(name, n_layer, n_embd, n_head, 128256, n_kv_head=8, ffn=ffn, gated=True, norm="rmsnorm",
                       bias=False, tied=False, positions="rope", block_size=8192)
       for name, n_layer, n_embd, n_head, ffn in (("llama3-8b", 32, 4096, 32, 14336),
                                                  ("llama3-70b", 80, 8192, 64, 28672),
                                                  ("llama3-405b", 126, 16384, 128, 53248))},
}
ALIASES = {"gpt2-124m": "gpt2", "gpt2-350m": "gpt2-medium", "gpt2-774m": "gpt2-large", "gpt2-1.5b": "gpt2-xl"}


def spelling(name: str) -> str:
    """``name`` as the presets are looked up: lower case, without dashes, underscores, spaces or dots
    but a dot between digits (``Llama-3-70B``, ``llama_3_70b`` and ``llama3-70b`` are ``llama370b``;
    ``GPT2-1.5B`` keeps its ``1.5``)."""
    return re.sub(r"[-_\s]+|(?<!\d)\.|\.(?!\d)", "", name.lower())


SPELLINGS = {spelling(name): key for key in PRESETS for name in (key, *[a for a, k in ALIASES.items() if k == key])}
assert len(SPELLINGS) == len(PRESETS) + len(ALIASES), "two presets or aliases are spelled alike"


def preset(name: str) -> ModelSpec:
    """The preset called ``name``, in any natural spelling (:func:`spelling`: case, dashes,
    underscores, dots); GPT-2's sizes also by parameter count. An unknown name raises ValueError
    listing the presets (and the nearest, when one is close)."""
    key = SPELLINGS.get(spelling(name))
    if key is None:
        names = list(PRESETS) + list(ALIASES)
        near = difflib.get_close_matches(spelling(name), SPELLINGS, n=1, cutoff=0.75)
        hint = f" (did you mean {SPELLINGS[near[0]]}?)" if near else ""
        raise ValueError(f"unknown model preset {name!r}{hint}; choose one of {', '.join(names)} "
                         "(any case; dashes, underscores and dots optional)")
    return PRESETS[key]


def from_gpt_config(config, name: str = "minidist") -> ModelSpec:
    """The spec of minidist's own GPT built from ``config`` (a ``GPTConfig``, whose ``bias`` says it,
    or a ``TrainConfig``, whose ``no_bias`` does)."""
    vocab = getattr(config, "vocab_size", 0) or 256  # a TrainConfig's 0: the data's, bytes until it is read
    bias = config.bias if hasattr(config, "bias") else not config.no_bias
    return ModelSpec(name, config.n_layer, config.n_embd, config.n_head, vocab, block_size=config.block_size,
                     n_experts=config.n_experts, top_k=config.top_k, moe_every=config.moe_every, bias=bias)


def with_shape(spec: ModelSpec, **changes) -> ModelSpec:
    """``spec`` with some fields replaced (``--n-layer`` and friends on top of a preset)."""
    return dataclasses.replace(spec, **{k: v for k, v in changes.items() if v is not None})


def _norm(m: ModelSpec) -> int:
    return m.n_embd * (2 if m.norm == "layernorm" and m.bias else 1)


def _mlp(m: ModelSpec, t: int) -> int:
    """One MLP's elements on a tp rank: gated 3 C F / t; else c_fc (C F + F) / t and c_proj C F / t
    + C (its bias whole)."""
    C, F = m.n_embd, m.hidden
    if m.gated:
        return 3 * C * F // t + (2 * F // t + C if m.bias else 0)
    return 2 * C * F // t + (F // t + C if m.bias else 0)


def block_numel(m: ModelSpec, t: int = 1, layer: int = 0, ep: int = 1) -> dict:
    """A block's elements on one tp rank of ``t``, as {"dense": n, "experts": n}: the experts' unit
    (its 1/ep of the experts) apart, as ZeRO shards it over its own group."""
    C, hs = m.n_embd, m.head_dim
    q, kv = m.n_head * hs // t, max(m.kv_heads // t, 1) * hs  # this rank's heads (kv heads copied if t > them)
    attn = C * (q + 2 * kv) + (q + 2 * kv if m.bias else 0) + q * C + (C if m.bias else 0)
    dense = 2 * _norm(m) + attn
    if not m.is_moe(layer):
        return {"dense": dense + _mlp(m, t), "experts": 0}
    router = m.n_experts * C // t
    return {"dense": dense + router, "experts": m.n_experts // ep * _mlp(m, t)}


@lru_cache(maxsize=256)
def parameter_count(m: ModelSpec) -> int:
    """Every parameter of the model once (tied embeddings once)."""
    blocks = sum(sum(block_numel(m, 1, i).values()) for i in range(m.n_layer))
    positions = m.block_size * m.n_embd if m.positions == "learned" else 0
    return m.vocab_size * m.n_embd * (1 if m.tied else 2) + positions + blocks + _norm(m)


@lru_cache(maxsize=256)
def active_parameters(m: ModelSpec) -> int:
    """The parameters one token's matmuls use: every matrix but the input embedding lookup (tied: the
    matrix counts once, as the LM head) and the position table; of each expert layer top_k experts."""
    count = parameter_count(m) - (0 if m.tied else m.vocab_size * m.n_embd)
    count -= m.block_size * m.n_embd if m.positions == "learned" else 0
    unused = sum(block_numel(m, 1, i)["experts"] * (m.n_experts - m.top_k) // m.n_experts
                 for i in range(m.n_layer) if m.is_moe(i))
    return count - unused


@lru_cache(maxsize=1024)
def layers_per_stage(m: ModelSpec, n_stages: int) -> tuple[int, ...]:
    """Blocks per pipeline stage, split by cost as ``PipelineStage`` splits them
    (``partition_layers`` with ``estimate_layer_costs``' shapes: a block 24 C^2 + 4 T C, the
    embeddings C, the head 2 C V)."""
    C, T, V = m.n_embd, m.block_size, m.vocab_size
    return tuple(partition_layers([24.0 * C * C + 4.0 * T * C] * m.n_layer, n_stages, float(C), 2.0 * C * V))


def stage_units(m: ModelSpec, stage: int, n_stages: int, counts, t: int = 1, ep: int = 1,
                head_copy: bool = False) -> list[tuple[str, int, bool]]:
    """ZeRO's units of pipeline ``stage`` on one tp rank, as (name, elements, experts): the
    embeddings on the first stage, its blocks, the final norm and the LM head on the last. A tied
    head is a unit of its own only when it is a copy (``head_copy``: the pipeline's last stage)."""
    C, V = m.n_embd, padded_vocab_size(m.vocab_size, t) // t
    first = sum(counts[:stage])
    units = []
    if stage == 0:
        units.append(("transformer.wte", V * C, False))
        if m.positions == "learned":
            units.append(("transformer.wpe", m.block_size * C, False))
    for layer in range(first, first + counts[stage]):
        n = block_numel(m, t, layer, ep)
        units.append((f"transformer.h.{layer}", n["dense"], False))
        if n["experts"]:
            units.append((f"transformer.h.{layer}.mlp.experts", n["experts"], True))
    if stage == n_stages - 1:
        units.append(("transformer.ln_f", _norm(m), False))
        if not m.tied or head_copy:
            units.append(("lm_head", V * C, False))
    return units
