"""Dropout (``--dropout P``, minidist/nn/dropout.py): nanoGPT's placement, a mask that is a function of
the element's global coordinates, and therefore every layout equal to one process with dropout on.

- The mask: the same coordinates give the same draws, whatever part of the batch, the sequence or the
  heads a rank holds; the drop rate is p; kept values are scaled by exactly 1/(1-p); the masks of two
  steps, layers or sites are unrelated.
- The model drops where nanoGPT drops (embeddings, attention probabilities, both output projections):
  its loss equals a NumPy forward written here with those four masks; without a key (evaluation,
  sampling) nothing is dropped; the attention Function's backward passes the finite-difference check.
- Trained with dropout in float64, every layout (dp, micro-batches, tp, tp + sp, cp ring / zig-zag /
  Ulysses, pp under every schedule, recompute, ZeRO 1-3, experts) equals one process on the full
  batch to 1e-10 relative (loss and gradient norm per step, every weight at the end; the default run
  trains one layout per way of cutting, ``--slow`` the rest, and tests/test_composition.py's grid has
  a dropout axis); a run of N steps equals N/2 steps then ``--resume`` to N, bitwise.
"""
import dataclasses
import math
import shutil

import numpy as np
import pytest

from minidist import run_local
from minidist.autograd import Tensor
from minidist.autograd.attention import scaled_dot_product_attention
from minidist.checkpoint import step_dir
from minidist.checkpoint.identity import run_identity
from minidist.model import GPT, GPTConfig, dropout_of
from minidist.nn.dropout import SITES, Dropout, DropoutKey, uniform
from minidist.parallel.context.ring_attention import ring_attention, sequence_chunks
from minidist.parallel.context.ulysses import ulysses_attention
from minidist.train import train
from minidist.train.config import ConfigError, TrainConfig, check_config
from tests.gradcheck import check_gradients

P = 0.2
RUN = dict(n_layer=4, n_head=4, n_embd=16, block_size=16, batch_size=8, steps=3, eval_every=100, eval_iters=1,
           sample_tokens=0, warmup=1, lr=1e-2, grad_clip=0.5, dtype="float64", optimizer="sgd", momentum=0.9,
           dropout=P, bucket_mb=0.01)
LAYOUTS = {  # the default run's: each way a layout cuts the batch, the sequence, the heads or the layers
    "dp2": dict(dp=2),
    "micro-batches 4": dict(micro_batches=4),
    "recompute": dict(recompute="full"),
    "tp2 sp": dict(tp=2, sequence_parallel=True),
    "cp2 ring": dict(cp=2),
    "cp2 ulysses": dict(cp=2, cp_algorithm="ulysses"),
    "pp2 zbv": dict(pp=2, schedule="zbv", virtual_stages=2, micro_batches=2),
    "dp2 tp2 zero3 recompute": dict(dp=2, tp=2, zero=3, recompute="full"),
    "dp2 ep2 moe": dict(dp=2, ep=2, n_experts=4, moe_every=2),
}
SLOW_LAYOUTS = {
    "tp2": dict(tp=2),
    "cp2 zigzag": dict(cp=2, cp_algorithm="zigzag"),
    "pp2 gpipe": dict(pp=2, schedule="gpipe", micro_batches=2),
    "pp2 1f1b recompute": dict(pp=2, micro_batches=4, recompute="full"),
    "pp2 interleaved": dict(pp=2, schedule="interleaved", virtual_stages=2, micro_batches=2),
    "pp2 zb-h1": dict(pp=2, schedule="zb-h1", micro_batches=2),
    "dp2 zero1": dict(dp=2, zero=1),
    "dp2 zero2 micro-batches": dict(dp=2, zero=2, micro_batches=2),
    "cp2 zigzag tp2 sp": dict(cp=2, cp_algorithm="zigzag", tp=2, sequence_parallel=True),
    "pp2 tp2 cp2 ulysses": dict(pp=2, tp=2, cp=2, cp_algorithm="ulysses", micro_batches=2),
    "dp2 pp2 moe zero1": dict(dp=2, pp=2, n_experts=4, moe_every=2, zero=1, micro_batches=2),
}


def key(rows=range(4), step=3, p=P, seq_len=8, seed=5):
    return DropoutKey(p, seed, step, tuple(rows), seq_len)


# ---- the mask --------------------------------------------------------------------------------------------

def test_the_mask_is_a_function_of_the_global_coordinates_only():
    whole = key(rows=range(8)).scaled_keep(2, "attention", np.arange(4)[:, None, None], np.arange(8)[None, :, None],
                                           np.arange(8)[None, None, :], like=np.zeros(1))  # (B, nh, T, T)
    again = key(rows=range(8)).scaled_keep(2, "attention", np.arange(4)[:, None, None], np.arange(8)[None, :, None],
                                           np.arange(8)[None, None, :], like=np.zeros(1))
    assert np.array_equal(whole, again)
    # micro-batches (consecutive rows), a tp rank's heads, a cp rank's (zig-zag) queries and its keys: slices
    for part, rows in zip(key(rows=range(8)).split(4), np.array_split(np.arange(8), 4)):
        assert part.rows == tuple(rows)
        mine = part.scaled_keep(2, "attention", np.arange(2, 4)[:, None, None], np.array([1, 6])[None, :, None],
                                np.array([0, 7])[None, None, :], like=np.zeros(1))
        assert np.array_equal(mine, whole[rows][:, 2:4][:, :, [1, 6]][:, :, :, [0, 7]])
    residual = Dropout(key(rows=range(8)), np.arange(8), range(4))
    x = Tensor(np.ones((8, 8, 6)))
    mine = Dropout(key(rows=[5, 6]), np.array([2, 3, 4]), range(4)).residual(Tensor(np.ones((2, 3, 6))), 1,
                                                                            "mlp output")
    assert np.array_equal(mine.data, residual.residual(x, 1, "mlp output").data[5:7, 2:5])
    # every word of the draw matters: another seed, step, layer, site or coordinate draws afresh
    u = uniform((5, 3, 2, 1), np.arange(4096))
    for words in [(6, 3, 2, 1), (5, 4, 2, 1), (5, 3, 1, 1), (5, 3, 2, 0)]:
        assert abs(np.corrcoef(u, uniform(words, np.arange(4096)))[0, 1]) < 0.06
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.06


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_the_drop_rate_is_p_and_kept_values_are_scaled_by_one_over_one_minus_p(p):
    mask = key(rows=range(16), p=p, seq_len=64).scaled_keep(0, "mlp output", np.arange(64)[:, None],
                                                            np.arange(256)[None, :], like=np.zeros(1, np.float64))
    n = mask.size  # 16 x 64 x 256 = 262,144 draws: the rate within 5 standard deviations
    assert abs(np.mean(mask == 0) - p) <= 5 * math.sqrt(p * (1 - p) / n)
    assert set(np.unique(mask)) == {0.0, 1.0 / (1.0 - p)}
    assert abs(mask.mean() - 1) <= 5 * math.sqrt(p / (1 - p) / n)  # inverted dropout keeps the expectation
    assert key(p=p).scaled_keep(0, "embedding", np.arange(3), like=np.zeros(1, np.float32)).dtype == np.float32


# ---- the model -------------------------------------------------------------------------------------------

def layer_norm(x, w, b):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * w + b


def nanogpt_loss(model, idx, targets, k):
    """nanoGPT's forward in NumPy with its four dropouts (model.py: self.drop, attn_dropout,
    resid_dropout in the attention and dropout in the MLP), masks drawn for the global coordinates."""
    w = {name: p.data for name, p in model.named_parameters()}
    B, T = idx.shape
    C, nh = model.config.n_embd, model.config.n_head
    hs, pos, chan, heads = C // nh, np.arange(T), np.arange(C), np.arange(nh)

    def drop(x, layer, site, *coords):
        return x * k.scaled_keep(layer, site, *coords, like=x)
    x = drop(w["transformer.wte.weight"][idx] + w["transformer.wpe.weight"][:T], -1, "embedding", pos[:, None],
             chan[None, :])
    for layer in range(model.config.n_layer):
        g = lambda name: w[f"transformer.h.{layer}.{name}"]  # noqa: E731
        h = layer_norm(x, g("ln_1.weight"), g("ln_1.bias")) @ g("attn.c_attn.weight").T + g("attn.c_attn.bias")
        q, k_, v = (a.reshape(B, T, nh, hs).transpose(0, 2, 1, 3) for a in np.split(h, 3, axis=2))
        att = q @ k_.transpose(0, 1, 3, 2) / math.sqrt(hs) + np.triu(np.full((T, T), -np.inf), 1)
        att = np.exp(att - att.max(-1, keepdims=True))
        att = drop(att / att.sum(-1, keepdims=True), layer, "attention", heads[:, None, None], pos[None, :, None],
                   pos[None, None, :])
        y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C) @ g("attn.c_proj.weight").T + g("attn.c_proj.bias")
        x = x + drop(y, layer, "attention output", pos[:, None], chan[None, :])
        h = layer_norm(x, g("ln_2.weight"), g("ln_2.bias")) @ g("mlp.c_fc.weight").T + g("mlp.c_fc.bias")
        h = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
        x = x + drop(h @ g("mlp.c_proj.weight").T + g("mlp.c_proj.bias"), layer, "mlp output", pos[:, None],
                     chan[None, :])
    logits = layer_norm(x, w["transformer.ln_f.weight"], w["transformer.ln_f.bias"]) @ w["transformer.wte.weight"].T  # tied
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, targets[..., None], -1).mean()


def test_the_model_drops_where_nanogpt_drops_and_only_when_training():
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=8, vocab_size=32), seed=1, dtype="float64")
    rng = np.random.default_rng(0)
    idx, targets = rng.integers(0, 32, (4, 8)), rng.integers(0, 32, (4, 8))
    k = key(rows=[3, 4, 5, 6], seq_len=8)
    _, loss = model(idx, targets, k)
    assert abs(loss.item() - nanogpt_loss(model, idx, targets, k)) <= 1e-12 * loss.item()
    _, plain = model(idx, targets)  # evaluation and sampling: no key, nothing dropped
    assert abs(plain.item() - nanogpt_loss(model, idx, targets, key(p=0.0, seq_len=8))) <= 1e-12 * plain.item()
    assert plain.item() != loss.item()
    assert model(idx, targets, key(p=0.0, rows=[3, 4, 5, 6]))[1].item() == plain.item()  # p = 0: the plain model
    assert dropout_of(model, None) is None and dropout_of(model, key(p=0.0)) is None
    assert SITES == ("embedding", "attention", "attention output", "mlp output")


def test_attention_with_dropout_passes_the_gradient_check():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 2, 5, 3)) for _ in range(3))
    drop = Dropout(key(rows=[0, 1], p=0.3, seq_len=5), np.arange(5), range(2)).attention(1)
    assert (drop.scaled_keep(range(5), range(5), q) == 0).any()
    check_gradients(lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True, dropout=drop), q, k, v)


@pytest.mark.parametrize("algorithm", ["ring", "zigzag", "ulysses"])
def test_context_parallel_attention_drops_what_one_process_drops(algorithm):
    rng = np.random.default_rng(2)
    B, nh, T, hs, n = 2, 4, 8, 3, 2
    q, k, v, dy = (rng.standard_normal((B, nh, T, hs)) for _ in range(4))
    drop = Dropout(key(rows=[4, 5], p=0.3, seq_len=T), np.arange(T), range(nh)).attention(0)
    ts = [Tensor(a.copy(), requires_grad=True) for a in (q, k, v)]
    ref = scaled_dot_product_attention(*ts, is_causal=True, dropout=drop)
    ref.backward(dy)

    def rank(group):
        pos = np.concatenate([np.arange(a, b) for a, b in sequence_chunks(T, n, group.rank, algorithm == "zigzag")])
        mine = [Tensor(a[:, :, pos].copy(), requires_grad=True) for a in (q, k, v)]
        attend = ulysses_attention if algorithm == "ulysses" else ring_attention
        extra = {} if algorithm == "ulysses" else {"zigzag": algorithm == "zigzag"}
        y = attend(*mine, group, dropout=drop, **extra)
        y.backward(dy[:, :, pos])
        return pos, y.data, [t.grad for t in mine]
    for pos, y, grads in run_local(rank, n):
        assert np.allclose(y, ref.data[:, :, pos], rtol=1e-12, atol=1e-13)
        for g, t in zip(grads, ts):
            assert np.allclose(g, t.grad[:, :, pos], rtol=1e-12, atol=1e-13)


# ---- every layout ----------------------------------------------------------------------------------------

def fit(cfg):
    ranks = cfg.dp * cfg.tp * cfg.pp * cfg.cp
    out = run_local(lambda group: train(cfg, progress=False, world=group)[1], ranks) if ranks > 1 else \
        [train(cfg, progress=False)[1]]
    return out[0], dict(np.load(cfg.export)) if cfg.export else None


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, data_dir):
    cache = {}

    def get(**model):
        name = tuple(sorted(model.items()))
        if name not in cache:
            cfg = TrainConfig(**{**RUN, **model}, data_dir=data_dir,
                              export=str(tmp_path_factory.mktemp("one") / "w.npz"))
            cache[name] = fit(cfg)
        return cache[name]
    return get


def close(a, b):
    return abs(a - b) <= 1e-10 * abs(b)


@pytest.mark.parametrize("name", list(LAYOUTS) + [pytest.param(n, marks=pytest.mark.slow) for n in SLOW_LAYOUTS])
def test_every_layout_with_dropout_equals_one_process(tmp_path, data_dir, one_process, name):
    layout = dict({**LAYOUTS, **SLOW_LAYOUTS}[name])
    model = {k: layout.pop(k) for k in ("n_experts", "moe_every") if k in layout}
    history_ref, weights_ref = one_process(**model)
    history, weights = fit(TrainConfig(**{**RUN, **model, **layout}, data_dir=data_dir,
                                       export=str(tmp_path / "w.npz")))
    for row, ref in zip(history, history_ref, strict=True):
        assert close(row["loss"], ref["loss"]) and close(row["grad_norm"], ref["grad_norm"]), (row, ref)
    assert weights.keys() == weights_ref.keys()
    for k, ref in weights_ref.items():
        assert np.abs(weights[k] - ref).max() <= 1e-10 * np.abs(ref).max(), k


def test_dropout_changes_the_training_and_not_the_evaluation(data_dir, one_process):
    dropped, _ = one_process()
    plain, _ = fit(TrainConfig(**{**RUN, "dropout": 0.0, "steps": 1}, data_dir=data_dir))
    # step 0 starts from the same weights: its loss differs (the masks), its validation loss after the
    # same update would not; a different step's masks are different masks
    assert dropped[0]["loss"] != plain[0]["loss"]
    again, _ = fit(TrainConfig(**{**RUN, "steps": 1}, data_dir=data_dir))
    assert again[0]["loss"] == dropped[0]["loss"]  # the same run draws the same masks


def test_resume_continues_the_same_masks_bitwise(data_dir, tmp_path):
    cfg = TrainConfig(**{**RUN, "steps": 6, "optimizer": "adamw", "dtype": "float32"}, dp=2, tp=2, data_dir=data_dir,
                      ckpt_dir=str(tmp_path / "ckpt"), save_every=3, export=str(tmp_path / "a.npz"))
    whole, whole_weights = fit(dataclasses.replace(cfg, ckpt_dir=None, save_every=0, export=str(tmp_path / "w.npz")))
    fit(cfg)
    shutil.rmtree(step_dir(cfg.ckpt_dir, 6))  # the job died after step 3's checkpoint
    resumed, weights = fit(dataclasses.replace(cfg, resume=True))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[3:]]
    for k, v in whole_weights.items():
        assert np.array_equal(weights[k], v), k


def test_dropout_is_part_of_the_runs_identity_once_set_and_leaves_exports_alone(tmp_path):
    assert "dropout" not in run_identity(TrainConfig(), {})  # a checkpoint written before the knob resumes
    assert run_identity(TrainConfig(dropout=0.2), {})["dropout"] == 0.2
    check_config(TrainConfig(dropout=0.2, export_hf=str(tmp_path / "hf")), 1)  # Hugging Face's GPT-2: dropout 0


@pytest.mark.parametrize("flags, words", [
    (dict(dropout=1.0), r"--dropout must be in \[0, 1\)"),
    (dict(dropout=-0.1), r"--dropout must be in \[0, 1\)"),
    (dict(dropout=float("nan")), "--dropout"),
    (dict(dropout=0.1, mode="ps"), "--mode ps trains whole models on its workers: --dropout do"),
])
def test_bad_dropout_is_refused_before_anything_runs(flags, words):
    with pytest.raises(ConfigError, match=words):
        check_config(TrainConfig(**flags), 2)
