"""Dropout whose mask is a function of the element, not of a random stream: every layout draws the same.

nanoGPT drops (with probability p, the kept values scaled by 1/(1-p): inverted dropout) at four
sites of training forward passes: the token + position embeddings, the attention probabilities, the
attention's output projection and the MLP's output projection. Here whether an element is kept is a
hash of where it is, and of nothing else:

    keep = uniform(seed, step, layer, site, global row, [global head, query, key] or [position, channel]) >= p

``global row`` is the row of the step's global batch (so micro-batches and data-parallel ranks that
cut the batch differently see the same rows), the positions are those of the whole sequence
(context and sequence parallelism hold some of them), the heads those of the whole model (tensor
parallelism and Ulysses hold some of them), and ``layer`` the block's index in the whole model
(pipeline stages hold some blocks). A layout that holds an element draws that element's mask, so
every layout equals one process on the whole batch, and recomputation, which runs a forward again,
draws the same masks again. There is no random state to carry, split or checkpoint: a resumed run
draws step s's masks from s.

Megatron-LM gets the same effect from state: its RNG tracker keeps one generator per model-parallel
rank, seeded from (seed, tp rank), forks it around each dropout, and saves and restores it around
recomputation; its masks depend on the layout (a tp rank's generator draws for its own shard), so a
tp = 2 run does not drop what a tp = 1 run drops. A counter-based mask (Philox in PyTorch's and
JAX's kernels) costs some hashing per element and needs the element's global coordinates, which
every layer here knows.

The hash is splitmix64's mixing function applied once per coordinate, in NumPy uint64 arithmetic
(wrapping), and the top 53 bits of the result read as a uniform draw in [0, 1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minidist.autograd import Function
from minidist.device import get_array_module

SITES = ("embedding", "attention", "attention output", "mlp output")  # where nanoGPT drops; the index is hashed
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z):
    """splitmix64's finaliser, in place on the uint64 array ``z``: a bijection that spreads every
    input bit over the output."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def _hash(words, coords) -> np.ndarray:
    """uint64 per element of the broadcast of ``coords``: ``words`` mixed in one by one, then each
    coordinate (the small arrays first, so most of the work is one mix of the full size)."""
    with np.errstate(over="ignore"):
        h = np.zeros(1, np.uint64)
        for w in words:
            h = _mix(h + np.uint64(int(w) % 2 ** 64) + _GOLDEN)
        for c in coords:
            h = _mix(h + np.asarray(c).astype(np.uint64) + _GOLDEN)
    return h


def uniform(words, *coords) -> np.ndarray:
    """Draws in [0, 1), one per element of the broadcast of ``coords`` (integer arrays, each the
    global coordinate of one axis), a function of ``words`` (integers: which draw) and the
    element's coordinates only: the top 53 bits of their hash."""
    return (_hash(words, coords) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


@dataclass(frozen=True)
class DropoutKey:
    """What one forward pass draws its masks for: drop probability ``p``, the run's ``seed``, the
    training ``step``, ``rows`` (the rows of the step's global batch that the pass holds, in order)
    and ``seq_len`` (T, the whole sequence's length)."""
    p: float
    seed: int
    step: int
    rows: tuple
    seq_len: int

    def split(self, n: int) -> list[DropoutKey]:
        """The keys of ``n`` consecutive micro-batches of the rows (as ``parallel/data/sampler.py``'s
        ``micro_batches`` cuts the batch)."""
        return [DropoutKey(self.p, self.seed, self.step, tuple(int(r) for r in part), self.seq_len)
                for part in np.array_split(np.asarray(self.rows, dtype=np.int64), n)]

    @property
    def scale(self) -> float:
        """What a kept element is multiplied by: 1/(1-p) (inverted dropout keeps the expectation)."""
        return 1.0 / (1.0 - self.p)

    def keep(self, layer: int, site: str, *coords, like) -> np.ndarray:
        """Whether each element is kept (bool, in ``like``'s memory): the broadcast of the rows (axis 0)
        and ``coords`` (the element's other global coordinates), kept where uniform(...) >= p."""
        rows = np.asarray(self.rows, dtype=np.int64).reshape((-1,) + (1,) * len(coords))
        bits = _hash((self.seed, self.step, layer, SITES.index(site)), (rows, *coords)) >> np.uint64(11)
        return get_array_module(like).asarray(bits >= np.uint64(math.ceil(self.p * 2 ** 53)))  # exactly

    def scaled_keep(self, layer: int, site: str, *coords, like) -> np.ndarray:
        """:meth:`keep` as 0 (dropped) or 1/(1-p) (kept), in ``like``'s dtype and memory."""
        keep = self.keep(layer, site, *coords, like=like).astype(like.dtype)
        keep *= self.scale
        return keep


class DropMasked(Function):
    """``x`` with the elements ``keep`` (a boolean array) drops zeroed and the others multiplied by
    ``scale``; backward does the same to the gradient. Saves only ``keep``, one byte an element."""

    @staticmethod
    def forward(ctx, x, keep, scale):
        ctx.keep, ctx.scale = keep, scale
        return drop_masked(x, keep, scale)

    @staticmethod
    def backward(ctx, grad):
        return drop_masked(grad, ctx.keep, ctx.scale), None, None


def drop_masked(a, keep, scale: float):
    """``a * keep * scale`` as one new array: the same numbers as ``a`` times :meth:`DropoutKey.scaled_keep`."""
    out = a * keep
    out *= scale
    return out


class Dropout:
    """One forward pass's dropout on one rank: the ``key``, and the global coordinates of what the
    rank holds: ``positions`` (L,) of the residual stream's tokens and ``heads``, the global indices
    of its attention heads. Computes masks, sends nothing."""

    def __init__(self, key: DropoutKey, positions, heads):
        self.key, self.positions, self.heads = key, np.asarray(positions), np.asarray(heads)

    def residual(self, x, layer: int, site: str):
        """``x`` (B, L, C) (a Tensor) with its dropped elements zeroed and the rest scaled by 1/(1-p)."""
        C = x.shape[-1]
        keep = self.key.keep(layer, site, self.positions[:, None], np.arange(C)[None, :], like=x.data)  # (B, L, C)
        return DropMasked.apply(x, keep, self.key.scale)

    def attention(self, layer: int) -> AttentionDropout:
        """The attention probabilities' dropout of block ``layer``."""
        return AttentionDropout(self.key, layer, self.heads)


@dataclass(frozen=True)
class AttentionDropout:
    """Dropout of one block's attention probabilities (B, nh, Lq, Lk): ``heads`` are the global
    indices of the nh heads held; an attention that holds some queries and keys asks
    :meth:`scaled_keep` for theirs."""
    key: DropoutKey
    layer: int
    heads: np.ndarray

    @property
    def scale(self) -> float:
        return self.key.scale

    def keep(self, q_positions, k_positions, like):
        """(B, nh, Lq, Lk) bool: whether the probability of each query at global ``q_positions`` for
        each key at ``k_positions`` is kept, in ``like``'s memory."""
        return self.key.keep(self.layer, "attention", self.heads[:, None, None], np.asarray(q_positions)[None, :, None],
                             np.asarray(k_positions)[None, None, :], like=like)

    def scaled_keep(self, q_positions, k_positions, like):
        """:meth:`keep` as 0 or 1/(1-p), in ``like``'s dtype and memory."""
        keep = self.keep(q_positions, k_positions, like).astype(like.dtype)
        keep *= self.scale
        return keep

    def of_heads(self, part: slice) -> AttentionDropout:
        """The same dropout for ``part`` of the heads held (Ulysses' head groups)."""
        return AttentionDropout(self.key, self.layer, self.heads[part])
