"""How tensor parallelism splits each GPT-2 parameter over n ranks: ONE table, read by the model
(:func:`shard_for`), consolidation (:func:`unshard`), checkpoints (:func:`regions`) and
``--explain`` (:func:`global_shape`, :func:`full_shape`).

    GPT-2 name                          kind        axis   rank r of n holds
    transformer.wte.weight, lm_head     vocab       0      rows [r V_pad/n, (r+1) V_pad/n), V_pad = V
                                                           rounded up to a multiple of n; rows >= V
                                                           are zero padding, in no global box
    *.c_attn.weight / .bias             qkv         0      [q_r; k_r; v_r]: block r of each third
                                                           (whole heads of q, k and v)
    *.mlp.router.weight (E, C)          column      0      block r of the experts' logits
    *.experts.c_fc.weight / .bias       column      1      block r of every expert's hidden units
    *.experts.c_proj.weight             row         2      block r of every expert's hidden units
    *.c_fc.weight / .bias               column      0      block r of n (output features)
    *.c_proj.weight                     row         1      block r of n (input features)
    everything else                     replicated  -      the whole tensor (LayerNorms, wpe, the
                                                           c_proj biases: added once, after the sum)

Expert parallelism cuts once more: a stacked expert parameter (``*.experts.*``, E experts along axis
0, minidist/moe.py) holds only the experts of its ep rank, block r of E/ep (:func:`ep_block`), and the
tp cut above applies to that block.

Everything below derives from the table and from :func:`regions`, where rank r's local rows sit in
the global tensor: shard_for copies those boxes out, unshard copies them back.
"""
from __future__ import annotations

import re

from minidist.device import get_array_module

TABLE = (  # (GPT-2 name pattern, kind, axis cut); the first full match wins, else "replicated"
    (re.compile(r"transformer\.wte\.weight|lm_head\.weight"), "vocab", 0),
    (re.compile(r"(.+\.)?router\.weight"), "column", 0),
    (re.compile(r"(.+\.)?experts\.c_fc\.[^.]+"), "column", 1),
    (re.compile(r"(.+\.)?experts\.c_proj\.weight"), "row", 2),
    (re.compile(r"(.+\.)?experts\.c_proj\.bias"), "replicated", None),
    (re.compile(r"(.+\.)?c_attn\.[^.]+"), "qkv", 0),
    (re.compile(r"(.+\.)?c_fc\.[^.]+"), "column", 0),
    (re.compile(r"(.+\.)?c_proj\.weight"), "row", 1),
)


EXPERT = re.compile(r"(.+\.)?experts\.[^.]+\.[^.]+")  # stacked experts: ep cuts axis 0


def is_expert(name: str) -> bool:
    """Whether parameter ``name`` stacks experts along axis 0 (expert parallelism cuts it)."""
    return EXPERT.fullmatch(name) is not None


def ep_block(n_experts: int, ep_rank: int, ep_size: int) -> slice:
    """The experts ep rank ``ep_rank`` of ``ep_size`` holds: block r of E/ep (E divisible by ep)."""
    local = divide(n_experts, ep_size, "n_experts", "expert parallelism")
    return slice(ep_rank * local, (ep_rank + 1) * local)


def split_of(name: str) -> tuple[str, int | None]:
    """(kind, axis cut) of parameter ``name`` from :data:`TABLE`; ("replicated", None) if no row matches."""
    for pattern, kind, axis in TABLE:
        if pattern.fullmatch(name):
            return kind, axis
    return "replicated", None


def tp_layout(name: str) -> str:
    """How GPT parameter ``name`` is split: "vocab", "qkv", "column", "row" or "replicated"."""
    return split_of(name)[0]


def tp_heads(n_head: int, tp_rank: int, tp_size: int) -> range:
    """The global indices of the attention heads tp rank ``tp_rank`` of ``tp_size`` holds: block r
    of the ``qkv`` split (dropout draws its attention masks for them, minidist/nn/dropout.py)."""
    local = divide(n_head, tp_size, "n_head")
    return range(tp_rank * local, (tp_rank + 1) * local)


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The vocabulary rounded up to a multiple of ``tp_size`` (each rank holds an equal slice)."""
    return -(-vocab_size // tp_size) * tp_size


def divide(n: int, parts: int, what: str, who: str = "tensor parallelism") -> int:
    """``n / parts``, or a ValueError naming ``what`` when ``who`` cannot split it evenly."""
    if n % parts:
        raise ValueError(f"{who} splits {what} = {n} over {parts} ranks: it must be divisible")
    return n // parts


def local_shape(name: str, global_shape, tp_size: int) -> tuple:
    """The shape of each rank's shard of parameter ``name`` (single-process shape ``global_shape``)
    on ``tp_size`` ranks. Raises ValueError when the cut axis does not divide."""
    kind, axis = split_of(name)
    shape = list(global_shape)
    if kind == "vocab":
        shape[0] = padded_vocab_size(shape[0], tp_size) // tp_size
    elif kind == "qkv":
        shape[0] = 3 * divide(shape[0] // 3, tp_size, f"the width of {name}")
    elif axis is not None:
        shape[axis] = divide(shape[axis], tp_size, f"axis {axis} of {name}")
    return tuple(shape)


def global_shape(name: str, local_shape, tp_size: int, vocab_size: int | None = None) -> tuple:
    """The single-process shape of parameter ``name`` whose shard on each of ``tp_size`` ranks has
    ``local_shape``. A "vocab" parameter needs ``vocab_size``: its padding rows are not part of it."""
    kind, axis = split_of(name)
    shape = list(local_shape)
    if kind == "vocab":
        if vocab_size is None:
            raise ValueError(f"{name} needs vocab_size: the vocabulary is padded to a multiple of tp")
        shape[0] = vocab_size
    elif axis is not None:
        shape[axis] *= tp_size
    return tuple(shape)


def full_shape(name: str, local_shape, config, tp_size: int) -> tuple:
    """The single-process shape of parameter ``name`` whose shard on one of ``tp_size`` ranks has
    ``local_shape`` (:func:`global_shape` with the vocabulary of ``config``, a GPTConfig; a stacked
    expert parameter has all ``config.n_experts`` experts, whatever block of them it holds)."""
    shape = global_shape(name, local_shape, tp_size, config.vocab_size)
    return (config.n_experts,) + shape[1:] if is_expert(name) else shape


def regions(name: str, global_shape, tp_rank: int, tp_size: int, ep_rank: int = 0, ep_size: int = 1) -> list:
    """Where rank ``tp_rank``'s local shard of parameter ``name`` (single-process shape
    ``global_shape``, ndim >= 1) sits in the global tensor: a list of (local row start, local row
    stop, global box), a box being one (start, stop) per axis. Local rows in no entry are vocabulary
    padding. With one rank every parameter is one whole box. A stacked expert parameter on ep rank
    ``ep_rank`` of ``ep_size``: the boxes of its block of experts (axis 0 shifted to the block)."""
    if ep_size > 1 and is_expert(name):
        block = ep_block(int(global_shape[0]), ep_rank, ep_size)
        local = (block.stop - block.start,) + tuple(global_shape[1:])
        return [(r0, r1, ((box[0][0] + block.start, box[0][1] + block.start),) + box[1:])
                for r0, r1, box in regions(name, local, tp_rank, tp_size)]
    kind, axis = split_of(name) if tp_size > 1 else ("replicated", None)
    whole = tuple((0, int(n)) for n in global_shape)
    if kind == "replicated":
        return [(0, int(global_shape[0]), whole)]
    if kind == "vocab":
        rows = padded_vocab_size(global_shape[0], tp_size) // tp_size
        lo, hi = tp_rank * rows, min((tp_rank + 1) * rows, int(global_shape[0]))
        return [(0, hi - lo, ((lo, hi),) + whole[1:])] if hi > lo else []
    if kind == "qkv":
        rows = global_shape[0] // 3 // tp_size  # rows of q_r (= of k_r, v_r)
        third = rows * tp_size
        return [(i * rows, (i + 1) * rows, ((i * third + tp_rank * rows, i * third + (tp_rank + 1) * rows),)
                 + whole[1:]) for i in range(3)]
    width = global_shape[axis] // tp_size
    box = list(whole)
    box[axis] = (tp_rank * width, (tp_rank + 1) * width)
    return [(0, width if axis == 0 else int(global_shape[0]), tuple(box))]


def _slices(box) -> tuple:
    return tuple(slice(start, stop) for start, stop in box)


def shard_for(name: str, full, tp_rank: int, tp_size: int):
    """The part of parameter ``name``'s full value that rank ``tp_rank`` of ``tp_size`` holds: the
    full value itself when replicated, else a new array of :func:`local_shape` filled from this
    rank's :func:`regions` (vocabulary padding rows zero)."""
    if tp_layout(name) == "replicated":
        return full
    shard = get_array_module(full).zeros(local_shape(name, full.shape, tp_size), dtype=full.dtype)
    for r0, r1, box in regions(name, full.shape, tp_rank, tp_size):
        shard[r0:r1] = full[_slices(box)]
    return shard


def unshard(name: str, shards: list, vocab_size: int | None = None):
    """The full value of parameter ``name`` from the shards of ranks 0..n-1 (inverse of
    :func:`shard_for`). For "vocab" parameters ``vocab_size`` is required: the padded rows are dropped."""
    if tp_layout(name) == "replicated":
        return shards[0]
    n = len(shards)
    shape = global_shape(name, shards[0].shape, n, vocab_size)
    full = get_array_module(shards[0]).zeros(shape, dtype=shards[0].dtype)
    for r, shard in enumerate(shards):
        for r0, r1, box in regions(name, shape, r, n):
            full[_slices(box)] = shard[r0:r1]
    return full
