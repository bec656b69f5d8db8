"""Generation in every layout (minidist/parallel/whole_model/generate.py): after the same training, every rank of
dp, tp, tp + sequence parallelism, ZeRO-3, pp (1F1B and interleaved), 3D (dp2 x pp2 x tp2) and
context parallelism (ring, zig-zag with tp + sequence parallelism, Ulysses under a pipeline) and
expert parallelism (with tp, sp, ZeRO-3, pp and cp) writes
exactly the text one process's ``GPT.generate`` writes with the same seed, in float64. The 40 new
tokens outgrow block_size 16 (the context is cropped) and pass through context lengths that are not
multiples of tp or cp (the sequence splits pad them)."""
import dataclasses

import numpy as np
import pytest

from minidist import run_local
from minidist.data import ByteTokenizer
from minidist.model import GPT, GPTConfig, sample_token
from minidist.parallel.whole_model.generate import generate
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.pipeline import PipelineStage
from minidist.parallel.tensor.apply import tensor_parallel
from minidist.train import train
from minidist.train.config import TrainConfig
from minidist.train.outputs import sample

TINY = dict(n_layer=2, n_head=4, n_embd=16, block_size=16, batch_size=8, steps=3, eval_every=100, eval_iters=1,
            dtype="float64", sample_tokens=0, warmup=1, lr=3e-2, optimizer="adamw")
PROMPT, NEW_TOKENS, SEED = "The ", 40, 3


@pytest.fixture(scope="module")
def reference(data_dir):
    """One process: train, then the reference ``GPT.generate`` (temperature 0.8, top-k 20, as sample)."""
    model, _ = train(TrainConfig(**TINY, data_dir=data_dir), progress=False)
    model.eval()
    tok = ByteTokenizer()
    out = model.generate(tok.encode(PROMPT).astype(np.int64)[None, :], NEW_TOKENS, temperature=0.8, top_k=20,
                         rng=np.random.default_rng(SEED))
    return tok.decode(out[0])


def texts(cfg):
    """Every rank's sample after training ``cfg`` on dp * pp * cp * tp in-process ranks."""
    def rank(group):
        model, _ = train(cfg, progress=False, world=group)
        pp_group = DeviceMesh(group, dp=cfg.dp, pp=cfg.pp, tp=cfg.tp, cp=cfg.cp, ep=cfg.ep).pp_group if cfg.pp > 1 else None
        model.eval()
        return sample(model, PROMPT, NEW_TOKENS, seed=SEED, pp_group=pp_group)
    return run_local(rank, cfg.dp * cfg.pp * cfg.cp * cfg.tp)


@pytest.mark.parametrize("changes", [
    dict(dp=2), dict(tp=2), dict(tp=2, sequence_parallel=True), dict(dp=2, zero=3),
    dict(pp=2, schedule="1f1b", micro_batches=2),
    dict(pp=2, schedule="interleaved", virtual_stages=2, micro_batches=2, n_layer=4),
    dict(pp=2, schedule="zbv", virtual_stages=2, micro_batches=2, n_layer=4), dict(pp=2, schedule="zb-h1", micro_batches=2),
    dict(dp=2, tp=2, pp=2, zero=1, schedule="1f1b", micro_batches=2),
    dict(cp=2), dict(cp=2, cp_algorithm="zigzag", tp=2, sequence_parallel=True),
    dict(cp=2, cp_algorithm="ulysses", pp=2, micro_batches=2), dict(dp=2, cp=4, cp_algorithm="zigzag", zero=3),
], ids=["dp2", "tp2", "tp2-sp", "zero3", "pp2-1f1b", "pp2-interleaved", "pp2-zbv", "pp2-zb-h1", "3d", "cp2-ring", "cp2-zigzag-tp2-sp",
        "cp2-ulysses-pp2", "dp2-cp4-zigzag-zero3"])
def test_every_layout_generates_the_text_of_one_process(data_dir, reference, changes):
    if changes.get("n_layer") == 4:  # its own one-process reference: a 4-layer model
        model, _ = train(TrainConfig(**dict(TINY, n_layer=4), data_dir=data_dir), progress=False)
        model.eval()
        reference = sample(model, PROMPT, NEW_TOKENS, seed=SEED)
    cfg = dataclasses.replace(TrainConfig(**TINY, data_dir=data_dir), **changes)
    got = texts(cfg)
    assert len(reference) == len(PROMPT) + NEW_TOKENS
    assert got == [reference] * len(got), changes


@pytest.mark.parametrize("changes", [dict(dp=2, ep=2), dict(dp=2, ep=2, tp=2, sequence_parallel=True, zero=3),
                                     dict(dp=2, ep=2, pp=2, micro_batches=2, cp=2)],
                         ids=["dp2-ep2", "dp2-ep2-tp2-sp-zero3", "dp2-ep2-pp2-cp2"])
def test_every_expert_parallel_layout_generates_the_text_of_one_process(data_dir, changes):
    """The ep ranks generate together (each sends its tokens to the ranks holding their experts,
    every step), and write one process's mixture-of-experts text."""
    moe = dict(TINY, n_experts=4, top_k=2)
    model, _ = train(TrainConfig(**moe, data_dir=data_dir), progress=False)
    model.eval()
    reference = sample(model, PROMPT, NEW_TOKENS, seed=SEED)
    got = texts(dataclasses.replace(TrainConfig(**moe, data_dir=data_dir), **changes))
    assert got == [reference] * len(got), changes


def test_sample_of_a_whole_model_is_its_generate(data_dir, reference):
    model, _ = train(TrainConfig(**TINY, data_dir=data_dir), progress=False)
    model.eval()
    assert sample(model, PROMPT, NEW_TOKENS, seed=SEED) == reference


def test_the_sampling_rule():
    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]]))  # (B, V)
    np.testing.assert_array_equal(sample_token(logits, np.array([[0.0], [0.0]])), [0, 0])
    np.testing.assert_array_equal(sample_token(logits, np.array([[0.25], [0.75]])), [1, 2])  # inverse CDF
    np.testing.assert_array_equal(sample_token(logits, np.array([[0.0], [0.99]]), top_k=1), [3, 0])  # greedy
    np.testing.assert_array_equal(sample_token(logits, np.array([[0.5], [0.5]]), top_k=2), [3, 0])  # 3/7, 4/7
    assert np.isfinite(logits).all()  # the caller's logits are not touched


def test_a_pipeline_stage_without_its_pp_group_is_refused_before_anything_is_sent():
    config = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8)

    def rank(group):
        stage = PipelineStage(GPT(config, seed=0, dtype="float64"), group.rank, 2)
        with pytest.raises(ValueError, match="pass pp_group"):
            generate(stage, np.zeros((1, 2), dtype=np.int64), 3)
        return True

    assert run_local(rank, 2) == [True, True]


@pytest.mark.parametrize("pp, tp, sequence_parallel", [(1, 2, False), (2, 2, True), (2, 1, False)])
def test_a_batch_of_prompts_generates_one_process_rows(pp, tp, sequence_parallel):
    """Several rows at once (each row its own draws), straight from the models: a GPT against its
    tensor-parallel shards and pipeline stages, from the same initial weights. top-k 20 of 31 keeps
    the padded vocabulary column (logit 0) in play, had the gather not dropped it."""
    config = GPTConfig(vocab_size=31, block_size=8, n_layer=2, n_head=2, n_embd=8)  # 31: padded to 32 by tp
    prompts = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=np.int64)  # (B, T)
    expected = GPT(config, seed=1, dtype="float64").generate(prompts, 12, top_k=20, rng=np.random.default_rng(0))

    def rank(group):
        mesh = DeviceMesh(group, pp=pp, tp=tp)
        model = GPT(config, seed=1, dtype="float64")
        if tp > 1:
            tensor_parallel(model, mesh.tp_group, sequence_parallel)
        if pp > 1:
            model = PipelineStage(model, mesh.pp_rank, pp)
        return generate(model, prompts, 12, top_k=20, rng=np.random.default_rng(0), pp_group=mesh.pp_group)

    for out in run_local(rank, pp * tp):
        np.testing.assert_array_equal(out, expected, strict=True)


def test_what_each_token_sends_under_pp_and_tp():
    """pp2 x tp2, 3 prompts, k tokens, measured from the trace: per token one all-gather over tp of
    the last position's logits (B x V_pad values) on the last stage, one (B, T, C) activation from
    stage 0 to stage 1, one broadcast of the B tokens (int64) over pp; nothing else but the model's
    own tensor-parallel all-reduces."""
    config = GPTConfig(vocab_size=31, block_size=8, n_layer=2, n_head=2, n_embd=8)  # padded to 32 by tp
    prompts, k = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=np.int64), 7  # (B, T): 3 + 7 > block_size
    B, V_pad, C = 3, 32, 8

    def rank(group):
        mesh = DeviceMesh(group, pp=2, tp=2)
        stage = PipelineStage(tensor_parallel(GPT(config, 1, "float64"), mesh.tp_group), mesh.pp_rank, 2)
        with group.trace.capture() as events:
            generate(stage, prompts, k, rng=np.random.default_rng(0), pp_group=mesh.pp_group)
        return mesh.pp_rank, [(e.op, e.group.split("[")[0], e.nbytes) for e in events]

    lengths = [min(3 + i, config.block_size) for i in range(k)]  # the context each token is computed from
    for pp_rank, events in run_local(rank, 4):
        ops = {(op, group) for op, group, _ in events}
        assert ops <= {("all_reduce", "tp"), ("all_gather", "tp"), ("broadcast", "pp"), ("isend", "pp"),
                       ("irecv", "pp")}, ops
        assert [n for op, _, n in events if op == "broadcast"] == [B * 8] * k
        assert [n for op, _, n in events if op == "all_gather"] == ([B * V_pad * 8] * k if pp_rank == 1 else [])
        sent = [n for op, _, n in events if op == ("isend" if pp_rank == 0 else "irecv")]
        assert sent == [B * T * C * 8 for T in lengths]
        assert not [op for op, _, _ in events if op == ("irecv" if pp_rank == 0 else "isend")]
