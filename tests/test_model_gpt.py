"""The GPT: GPT-2 names and layouts, initial values fixed by (seed, name, shape), exact gradients
(every parameter against finite differences), causality, and generation."""
import math

import numpy as np
import pytest

from minidist.autograd import no_grad
from minidist.model import GPT, GPTConfig, gpt2_init

TINY = GPTConfig(vocab_size=11, block_size=5, n_layer=2, n_head=2, n_embd=4)


def batch(config, B=2, T=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, config.vocab_size, (B, T)), rng.integers(0, config.vocab_size, (B, T))


def test_state_dict_has_gpt2_names_and_pytorch_shapes():
    c = GPTConfig(vocab_size=50, block_size=8, n_layer=2, n_head=2, n_embd=6)
    C, V = c.n_embd, c.vocab_size
    expected = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (8, C)}
    for i in range(2):
        p = f"transformer.h.{i}."
        expected.update({
            p + "ln_1.weight": (C,), p + "ln_1.bias": (C,),
            p + "attn.c_attn.weight": (3 * C, C), p + "attn.c_attn.bias": (3 * C,),
            p + "attn.c_proj.weight": (C, C), p + "attn.c_proj.bias": (C,),
            p + "ln_2.weight": (C,), p + "ln_2.bias": (C,),
            p + "mlp.c_fc.weight": (4 * C, C), p + "mlp.c_fc.bias": (4 * C,),
            p + "mlp.c_proj.weight": (C, 4 * C), p + "mlp.c_proj.bias": (C,),
        })
    expected.update({"transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,), "lm_head.weight": (V, C)})
    model = GPT(c)
    sd = model.state_dict()
    assert list(sd) == list(expected)
    assert {k: v.shape for k, v in sd.items()} == expected
    assert all(v.dtype == np.float32 for v in sd.values())
    names = [n for n, _ in model.named_parameters()]  # the tied head is listed once, as wte
    assert names == [n for n in expected if n != "lm_head.weight"]
    assert model.lm_head.weight is model.transformer.wte.weight
    np.testing.assert_array_equal(sd["lm_head.weight"], sd["transformer.wte.weight"])


def test_untied_and_bias_free_variants():
    model = GPT(GPTConfig(vocab_size=11, block_size=5, n_layer=1, n_head=2, n_embd=4, bias=False,
                          tie_embeddings=False))
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" in names and not any(n.endswith(".bias") for n in names)
    assert not np.array_equal(model.lm_head.weight.data, model.transformer.wte.weight.data)


def test_state_dict_round_trip():
    a, b = GPT(TINY, seed=1), GPT(TINY, seed=2)
    idx, targets = batch(TINY)
    b.load_state_dict(a.state_dict())
    for name, value in b.state_dict().items():
        np.testing.assert_array_equal(value, a.state_dict()[name])
    assert a(idx, targets)[1].item() == b(idx, targets)[1].item()


def test_initial_values_depend_only_on_seed_name_and_shape():
    small = GPT(TINY, seed=3)
    other = GPT(GPTConfig(vocab_size=23, block_size=9, n_layer=2, n_head=2, n_embd=4), seed=3, dtype="float64")
    shared = ["transformer.h.1.attn.c_attn.weight", "transformer.h.0.mlp.c_proj.weight", "transformer.ln_f.weight"]
    for (name, p), (name2, p2) in zip(small.named_parameters(), other.named_parameters()):
        assert name == name2
        np.testing.assert_array_equal(p.data, gpt2_init(name, p.shape, 3, 2).astype(np.float32))
        if name in shared:  # same name and shape, different model around it
            np.testing.assert_array_equal(p.data, p2.data.astype(np.float32))
    assert not np.array_equal(GPT(TINY, seed=4).transformer.wte.weight.data, small.transformer.wte.weight.data)
    h = small.transformer.h
    assert not np.array_equal(h[0].attn.c_attn.weight.data, h[1].attn.c_attn.weight.data)


def test_gpt2_init_statistics():
    n_layer = 3
    w = gpt2_init("transformer.h.0.mlp.c_fc.weight", (400, 100), 0, n_layer)
    proj = gpt2_init("transformer.h.0.mlp.c_proj.weight", (400, 100), 0, n_layer)
    assert abs(w.std() - 0.02) < 0.001 and abs(w.mean()) < 0.001
    assert abs(proj.std() - 0.02 / math.sqrt(2 * n_layer)) < 0.0005
    assert not gpt2_init("transformer.h.0.attn.c_attn.bias", (7,), 0, n_layer).any()
    assert (gpt2_init("transformer.h.2.ln_2.weight", (7,), 0, n_layer) == 1).all()
    assert not gpt2_init("transformer.ln_f.bias", (7,), 0, n_layer).any()


def test_loss_at_init_is_close_to_uniform():
    config = GPTConfig()
    idx, targets = batch(config, B=4, T=config.block_size)
    logits, loss = GPT(config)(idx, targets)
    assert logits.shape == (4, config.block_size, config.vocab_size) and loss.dtype == np.float32
    assert abs(loss.item() - math.log(config.vocab_size)) < 0.05
    assert GPT(config)(idx)[1] is None


@pytest.mark.parametrize("config", [TINY, GPTConfig(vocab_size=7, block_size=4, n_layer=1, n_head=2, n_embd=4,
                                                     bias=False, tie_embeddings=False)])
def test_every_parameter_gradient_matches_finite_differences(config):
    model = GPT(config, seed=0, dtype="float64")
    rng = np.random.default_rng(0)
    for _, p in model.named_parameters():  # move LayerNorms and biases off their special values
        p.data += rng.standard_normal(p.shape) * 0.1
    idx, targets = batch(config)
    targets[0, 1] = -1  # one ignored position
    model(idx, targets)[1].backward()
    eps = 1e-6
    for name, p in model.named_parameters():
        numeric = np.zeros_like(p.data)
        for i in np.ndindex(p.shape):
            saved = p.data[i]
            p.data[i] = saved + eps
            up = model(idx, targets)[1].item()
            p.data[i] = saved - eps
            down = model(idx, targets)[1].item()
            p.data[i] = saved
            numeric[i] = (up - down) / (2 * eps)
        np.testing.assert_allclose(p.grad, numeric, rtol=1e-5, atol=1e-8, err_msg=name)


def test_grad_ready_hooks_fire_once_per_parameter_including_the_tied_embedding():
    model = GPT(TINY)
    idx, targets = batch(TINY)
    fired = []
    for name, p in model.named_parameters():
        p.register_grad_ready_hook(lambda p, name=name: fired.append((name, p.grad.copy())))
    model(idx, targets)[1].backward()
    assert sorted(n for n, _ in fired) == sorted(n for n, _ in model.named_parameters())
    params = dict(model.named_parameters())
    for name, grad in fired:
        np.testing.assert_array_equal(grad, params[name].grad, err_msg=name)
    assert fired[0][0] == "transformer.ln_f.weight" and fired[-1][0] in ("transformer.wte.weight",
                                                                         "transformer.wpe.weight")


def test_embed_blocks_head_is_forward():
    model = GPT(TINY)
    idx, targets = batch(TINY)
    x = model.embed(idx)
    for block in model.transformer.h:
        x = block(x)
    logits, loss = model.head(x, targets)
    ref_logits, ref_loss = model(idx, targets)
    np.testing.assert_array_equal(logits.data, ref_logits.data)
    assert loss.item() == ref_loss.item()


def test_logits_never_depend_on_future_tokens():
    model = GPT(TINY, dtype="float64")
    idx, _ = batch(TINY, T=5)
    changed = idx.copy()
    changed[:, 3:] = (changed[:, 3:] + 1) % TINY.vocab_size
    a, b = model(idx)[0].data, model(changed)[0].data
    np.testing.assert_array_equal(a[:, :3], b[:, :3])
    assert not np.allclose(a[:, 3:], b[:, 3:])
    with pytest.raises(ValueError, match="block_size"):
        model(np.zeros((1, 6), dtype=np.int64))


def test_sgd_overfits_one_batch():
    model = GPT(TINY, dtype="float64")
    idx, targets = batch(TINY)
    losses = []
    for _ in range(60):
        model.zero_grad()
        _, loss = model(idx, targets)
        loss.backward()
        losses.append(loss.item())
        for p in model.parameters():
            p.data -= 0.5 * p.grad
    assert losses[-1] < 0.2 * losses[0]


def test_generate_greedy_and_sampled():
    model = GPT(TINY)
    idx, _ = batch(TINY, B=2, T=3)
    out = model.generate(idx, 6, top_k=1)  # top_k=1 is greedy, whatever the rng
    assert out.shape == (2, 9) and np.array_equal(out[:, :3], idx)
    expected = idx
    with no_grad():
        for _ in range(6):
            logits, _ = model(expected[:, -TINY.block_size:])
            expected = np.concatenate([expected, logits.data[:, -1].argmax(-1)[:, None]], axis=1)
    np.testing.assert_array_equal(out, expected)

    a = model.generate(idx, 6, temperature=2.0, rng=np.random.default_rng(7))
    b = model.generate(idx, 6, temperature=2.0, rng=np.random.default_rng(7))
    np.testing.assert_array_equal(a, b)
    assert a.min() >= 0 and a.max() < TINY.vocab_size
    assert model(idx)[0].requires_grad  # generate restored grad mode
