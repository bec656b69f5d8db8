"""Flat buffers: a group of parameters laid end to end in one 1-D array, cut into dp shards by offset.

ZeRO never partitions a tensor along one of its own axes: it concatenates the parameters of a *unit*
(one transformer block, the embeddings, the head) into a flat vector of ``numel`` elements and gives
data-parallel rank r the r-th piece of ``numpy.array_split`` of it (the first ``numel % N`` pieces
are one element longer). A shard may start in the middle of one parameter and end in the middle of
another; the optimizer does not care, because its update is element-wise.

    unit "transformer.h.0", numel 12,672 on dp = 4 ranks:

    |ln_1.w|ln_1.b|   attn.c_attn.weight   |c_attn.b| ... |  mlp.c_proj.weight  |c_proj.b|
    |<------ rank 0 ------>|<------ rank 1 ------>|<------ rank 2 ----->|<----- rank 3 ----->|
                           lo                   hi          (this rank's elements flat[lo:hi])

Whatever must be known per element of a shard (does weight decay apply, is the element part of a
tensor-parallel shard) becomes a 0/1 mask over the flat vector, cut the same way.
"""
from __future__ import annotations

import math

import numpy as np

from minidist.comm.ops import offsets, split_counts
from minidist.device import get_array_module
from minidist.optim import decays
from minidist.parallel.compose.grad_ownership import norm_bucket, summed_over_tp


class FlatUnit:
    """The parameters of one unit as a flat vector of ``numel`` elements, and this rank's shard of it.

    ``params`` is a list of (name, Parameter), all of one dtype; ``starts[i]`` is where parameter i
    begins in the flat vector; ``counts`` / ``lo`` / ``hi`` are every rank's shard length and this
    rank's bounds (``numpy.array_split`` of ``numel`` over ``dp_size``). Every array it makes lives
    where the parameters do (``xp``: NumPy, or CuPy on the GPU).
    """

    def __init__(self, name: str, params, dp_rank: int, dp_size: int):
        self.name = name
        self.params = list(params)
        dtypes = {p.data.dtype for _, p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"unit {name}: parameters of one unit must share a dtype, got {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.xp = get_array_module(self.params[0][1].data) if self.params else np
        self.shapes = [p.data.shape for _, p in self.params]
        sizes = [math.prod(s) for s in self.shapes]
        self.starts = offsets(sizes) if sizes else []
        self.numel = sum(sizes)
        self.counts = split_counts(self.numel, dp_size)
        self.lo = offsets(self.counts)[dp_rank]
        self.hi = self.lo + self.counts[dp_rank]

    def __repr__(self) -> str:
        return f"FlatUnit({self.name!r}, {len(self.params)} params, numel={self.numel}, shard [{self.lo}:{self.hi}])"

    def flatten(self, arrays) -> np.ndarray:
        """One new flat array (numel,) holding ``arrays`` (one per parameter, in order) end to end;
        a ``None`` entry (a parameter that got no gradient) contributes zeros."""
        flat = self.xp.zeros(self.numel, dtype=self.dtype)  # (numel,)
        for a, start, shape in zip(arrays, self.starts, self.shapes):
            if a is not None:
                flat[start:start + math.prod(shape)] = a.reshape(-1)
        return flat

    def views(self, flat: np.ndarray) -> list:
        """Views of ``flat`` (numel,) shaped like each parameter, in order (no copy)."""
        return [flat[start:start + math.prod(shape)].reshape(shape) for start, shape in zip(self.starts, self.shapes)]

    def bind(self, flat: np.ndarray) -> None:
        """Make every parameter's ``.data`` a view into ``flat`` (numel,): writing the flat vector
        (an optimizer step, an all-gather) writes the parameters, with no copy."""
        for (_, p), view in zip(self.params, self.views(flat)):
            p.data = view

    def release(self) -> None:
        """Drop the parameters' full values: ``.data`` becomes an empty array (ZeRO-3 between uses)."""
        for _, p in self.params:
            p.data = self.xp.empty(0, dtype=self.dtype)

    def shard_mask(self, predicate) -> np.ndarray:
        """A 0/1 mask (hi - lo,) of this rank's shard: 1 where the element belongs to a parameter
        ``p`` (named ``name``) with ``predicate(name, p)`` true."""
        mask = self.xp.zeros(self.numel, dtype=self.dtype)  # (numel,)
        for (name, p), start, shape in zip(self.params, self.starts, self.shapes):
            if predicate(name, p):
                mask[start:start + math.prod(shape)] = 1
        return mask[self.lo:self.hi]

    def decay_mask(self) -> np.ndarray:
        """1 on shard elements of parameters that take weight decay (ndim >= 2), else 0."""
        return self.shard_mask(lambda name, p: decays(p.data.shape))

    def tensor_parallel_mask(self) -> np.ndarray:
        """1 on shard elements of tensor-parallel parameters (distinct on each tp rank), 0 on
        replicated ones: gradient-norm clipping sums the former over the tp group, not the latter."""
        return self.shard_mask(lambda name, p: p.tensor_parallel)

    def counted_mask(self) -> np.ndarray:
        """1 on shard elements the global gradient norm counts on this stage, 0 on a tied copy of a
        parameter another pipeline stage holds (that stage counts it): see grad_ownership.py."""
        return self.shard_mask(lambda name, p: norm_bucket(p) is not None)

    def sequence_parallel_mask(self) -> np.ndarray:
        """1 on shard elements of sequence-parallel parameters, whose gradients are partial sums to
        all-reduce over the tp group."""
        return self.shard_mask(lambda name, p: summed_over_tp(p))


def units_by_module(named_parameters) -> list[tuple[str, list]]:
    """Group (name, Parameter) pairs into ZeRO units, keeping their order: every transformer block
    (``transformer.h.<i>``) is one unit, every other module (``transformer.wte``, ``transformer.ln_f``,
    ...) one unit, and a block's stacked experts (``transformer.h.<i>.mlp.experts``) one more. A parameter appearing under two names (tied weights) goes in once, under the
    first. Returns [(unit name, [(name, Parameter), ...]), ...]."""
    units: dict[str, list] = {}
    seen = set()
    for name, p in named_parameters:
        if id(p) in seen:
            continue
        seen.add(id(p))
        parts = name.split(".")
        key = ".".join(parts[:3]) if parts[:2] == ["transformer", "h"] else ".".join(parts[:-1])
        if p.expert:  # a block's experts are a unit of their own: other ranks hold other experts
            key = name[:name.index(".experts.") + len(".experts")]
        units.setdefault(key, []).append((name, p))
    return list(units.items())
