"""The one table of how tensor parallelism splits each GPT-2 parameter (minidist/parallel/tensor/layout.py)
and everything that reads it: shard_for / unshard, the shapes both ways, the checkpoint regions, the
tensor-parallel model's real parameters and ``--explain``'s holdings, all agreeing, with a vocabulary
(11) that neither tp = 2 nor tp = 3 divides."""
import ast
import math
import re

import numpy as np
import pytest

import minidist
from minidist.train.explain import holdings
from minidist.model import GPT, GPTConfig
from minidist.parallel.tensor.apply import tensor_parallel
from minidist.parallel.tensor.layout import (full_shape, global_shape, local_shape, regions, shard_for, split_of,
                                             tp_layout, unshard)

CONFIG = GPTConfig(vocab_size=11, block_size=4, n_layer=2, n_head=6, n_embd=12, tie_embeddings=False)
FULL = {name: value.shape for name, value in GPT(CONFIG, dtype="float64").state_dict().items()}


def test_the_table_by_name():
    assert split_of("transformer.wte.weight") == ("vocab", 0) == split_of("lm_head.weight")
    assert split_of("transformer.h.3.attn.c_attn.bias") == ("qkv", 0)
    assert split_of("mlp.c_fc.weight") == ("column", 0)  # short names too (one layer alone)
    assert split_of("transformer.h.0.mlp.c_proj.weight") == ("row", 1)
    for name in ("transformer.h.0.mlp.c_proj.bias", "transformer.wpe.weight", "transformer.ln_f.weight"):
        assert split_of(name) == ("replicated", None)
    assert tp_layout("transformer.h.0.attn.c_proj.weight") == "row"


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_shapes_both_ways_and_regions_tile_the_global_tensor(tp):
    V = CONFIG.vocab_size
    for name, shape in FULL.items():
        kind, axis = split_of(name)
        local = local_shape(name, shape, tp)
        assert global_shape(name, local, tp, V) == shape == full_shape(name, local, CONFIG, tp), name
        covered = np.zeros(shape, dtype=int)
        for r in range(tp):
            rows = 0
            for r0, r1, box in regions(name, shape, r, tp):
                piece = tuple(slice(a, b) for a, b in box)
                covered[piece] += 1
                assert covered[piece].shape == (local if axis == 1 else (r1 - r0,) + local[1:]), name
                rows += r1 - r0
            padding = sum(1 for i in range(r * local[0], (r + 1) * local[0]) if i >= V) if kind == "vocab" else 0
            assert rows == local[0] - padding, name  # local rows in no region: only the vocabulary's padding
        assert (covered == (tp if kind == "replicated" else 1)).all(), name  # shards: each element once


@pytest.mark.parametrize("tp", [2, 3])
def test_shard_for_is_the_regions_and_unshard_inverts_it(tp):
    for name, shape in FULL.items():
        full = np.random.default_rng(1).standard_normal(shape)
        shards = [shard_for(name, full, r, tp) for r in range(tp)]
        for r, shard in enumerate(shards):
            assert shard.shape == local_shape(name, shape, tp)
            held = np.zeros(shard.shape[0], dtype=bool)
            for r0, r1, box in regions(name, shape, r, tp):
                np.testing.assert_array_equal(shard[r0:r1], full[tuple(slice(a, b) for a, b in box)])
                held[r0:r1] = True
            np.testing.assert_array_equal(shard[~held], 0.0)  # padding rows are zero
        np.testing.assert_array_equal(unshard(name, shards, vocab_size=CONFIG.vocab_size), full)


def _explained(lines):
    """{parameter name: (local shape, full shape)} from :func:`holdings`' lines, blocks unfolded."""
    out = {}
    for line in lines:
        m = re.fullmatch(r"holds (\S+) +(\([\d, ]*\)) +(?:whole|copy|\w+ shard of (\([\d, ]*\)))", line)
        assert m, line
        folded, local, full = m.group(1), ast.literal_eval(m.group(2)), m.group(3)
        blocks = re.search(r"\{([\d,]+)\}", folded)
        for b in blocks.group(1).split(",") if blocks else [None]:
            name = folded.replace(blocks.group(0), b) if blocks else folded
            out[name] = (local, ast.literal_eval(full) if full else local)
    return out


@pytest.mark.parametrize("tp", [2, 3])
def test_explain_shapes_and_bytes_agree_with_the_table_and_the_model(tp):
    def rank_main(group):
        model = tensor_parallel(GPT(CONFIG, 0, "float64"), group)
        real = {name: p.data.shape for name, p in model.named_parameters()}
        return real, holdings(model, tp), sum(p.data.nbytes for p in model.parameters())

    for r, (real, lines, nbytes) in enumerate(minidist.run_local(rank_main, tp)):
        explained = _explained(lines)
        assert explained.keys() == real.keys() == FULL.keys()
        for name, (local, full) in explained.items():
            assert local == real[name] == local_shape(name, FULL[name], tp), (name, r)
            assert full == FULL[name], (name, r)  # the single-process shape: (11, C), not the padded (12, C)
        assert sum(math.prod(local) for local, _ in explained.values()) * 8 == nbytes  # float64 bytes per rank
    assert explained["transformer.wte.weight"] == ((-(-11 // tp), 12), (11, 12))
