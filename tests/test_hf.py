"""Hugging Face's GPT-2 format in and out (--init-from-hf, --export-hf; minidist/checkpoint/hf.py).

The folders here are written by hand from Hugging Face's documented GPT-2 layout (GPT2LMHeadModel's
state_dict: Conv1D weights (in, out), lm_head (vocab, C); GPT2Config's fields), with NumPy,
safetensors and json only, so the proof needs no torch: minidist's logits equal a float64 forward
written here directly on those Conv1D weights, import -> export gives the same tensors in every
layout, and every layout starts from the same first-step loss as one process. The last test, run
only where torch and transformers are installed, asks transformers itself.
"""
import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from minidist import run_local
from minidist.checkpoint.hf import HFFormatError, from_hf, write_hf
from minidist.data import get_batch, grammar_text, inputs_and_targets
from minidist.model import GPT
from minidist.parallel.mesh import DeviceMesh
from minidist.train import train
from minidist.train.build import build_parallel, load_data, load_full_state, with_hf_model
from minidist.train.config import ConfigError, TrainConfig, check_config
from minidist.train.outputs import write_outputs

L, H, C, T, V = 2, 4, 16, 16, 259  # V: bytes fit, and 259 is not a multiple of tp = 2 (padding)
RUN = dict(steps=1, batch_size=4, eval_every=100, eval_iters=1, sample_tokens=0, warmup=0, seed=3,
           optimizer="sgd", lr=0.1, dtype="float64")


def hf_tensors(seed=0, tied=True) -> dict:
    """A GPT2LMHeadModel state_dict as Hugging Face lays it out, random float32 values."""
    rng = np.random.default_rng(seed)

    def r(*shape, mean=0.0, std=0.2):
        return (mean + std * rng.standard_normal(shape)).astype(np.float32)

    t = {"transformer.wte.weight": r(V, C), "transformer.wpe.weight": r(T, C)}
    for i in range(L):
        h = f"transformer.h.{i}."
        t.update({h + "ln_1.weight": r(C, mean=1), h + "ln_1.bias": r(C),
                  h + "attn.c_attn.weight": r(C, 3 * C), h + "attn.c_attn.bias": r(3 * C),  # Conv1D: (in, out)
                  h + "attn.c_proj.weight": r(C, C), h + "attn.c_proj.bias": r(C),
                  h + "ln_2.weight": r(C, mean=1), h + "ln_2.bias": r(C),
                  h + "mlp.c_fc.weight": r(C, 4 * C), h + "mlp.c_fc.bias": r(4 * C),
                  h + "mlp.c_proj.weight": r(4 * C, C), h + "mlp.c_proj.bias": r(C)})
    t.update({"transformer.ln_f.weight": r(C, mean=1), "transformer.ln_f.bias": r(C)})
    if not tied:
        t["lm_head.weight"] = r(V, C)  # nn.Linear: (out, in)
    return t


def hf_config_json(tied=True, **changes) -> dict:
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": V, "n_positions": T,
           "n_ctx": T, "n_embd": C, "n_layer": L, "n_head": H, "activation_function": "gelu_new",
           "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
           "tie_word_embeddings": tied}
    cfg.update(changes)
    return cfg


def write_folder(path, tensors, config) -> str:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text(grammar_text(3_000, seed=1))
    return str(path)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def folder(request, tmp_path_factory):
    tied = request.param
    path = tmp_path_factory.mktemp("tied" if tied else "untied")
    return write_folder(path, hf_tensors(seed=int(tied), tied=tied), hf_config_json(tied))


def reference_logits(t: dict, idx) -> np.ndarray:
    """GPT-2's forward in float64, straight on Hugging Face's tensors (Conv1D: y = x @ W + b)."""
    t = {k: v.astype(np.float64) for k, v in t.items()}

    def ln(x, w, b):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * w + b

    def gelu_new(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    B, n = idx.shape
    hs = C // H
    x = t["transformer.wte.weight"][idx] + t["transformer.wpe.weight"][:n]  # (B, T, C)
    mask = np.triu(np.ones((n, n), bool), 1)
    for i in range(L):
        h = f"transformer.h.{i}."
        a = ln(x, t[h + "ln_1.weight"], t[h + "ln_1.bias"]) @ t[h + "attn.c_attn.weight"] + t[h + "attn.c_attn.bias"]
        q, k, v = (z.reshape(B, n, H, hs).transpose(0, 2, 1, 3) for z in np.split(a, 3, axis=-1))  # (B, H, T, hs)
        att = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hs)
        att = np.exp(np.where(mask, -np.inf, att) - att.max(-1, keepdims=True))
        y = (att / att.sum(-1, keepdims=True)) @ v  # (B, H, T, hs)
        x = x + y.transpose(0, 2, 1, 3).reshape(B, n, C) @ t[h + "attn.c_proj.weight"] + t[h + "attn.c_proj.bias"]
        m = ln(x, t[h + "ln_2.weight"], t[h + "ln_2.bias"])
        m = gelu_new(m @ t[h + "mlp.c_fc.weight"] + t[h + "mlp.c_fc.bias"])
        x = x + m @ t[h + "mlp.c_proj.weight"] + t[h + "mlp.c_proj.bias"]
    x = ln(x, t["transformer.ln_f.weight"], t["transformer.ln_f.bias"])
    return x @ t.get("lm_head.weight", t["transformer.wte.weight"]).T  # (B, T, V)


def reference_loss(logits, targets) -> float:
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, targets[..., None], -1).mean())


def test_imported_model_computes_the_reference_logits(folder):
    state, config = from_hf(folder)
    model = GPT(config, dtype="float64")
    load_full_state(model, state)
    idx = np.random.default_rng(0).integers(0, V, size=(2, T))
    logits, _ = model(idx)
    np.testing.assert_allclose(logits.data, reference_logits(load_file(folder + "/model.safetensors"), idx),
                               rtol=1e-10, atol=1e-10)


def test_export_writes_hugging_face_layout_and_round_trips_exactly(folder, tmp_path):
    state, config = from_hf(folder)
    write_hf(tmp_path, state, config)
    original, written = load_file(folder + "/model.safetensors"), load_file(str(tmp_path / "model.safetensors"))
    assert written.keys() == original.keys()
    for name in original:
        assert written[name].dtype == original[name].dtype and np.array_equal(written[name], original[name]), name
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["tie_word_embeddings"] == config.tie_embeddings == ("lm_head.weight" not in original)
    assert {k: hf[k] for k in ("model_type", "architectures", "activation_function", "layer_norm_epsilon",
                               "n_positions", "n_ctx", "vocab_size", "n_layer", "n_head", "n_embd")} == {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5, "n_positions": T, "n_ctx": T, "vocab_size": V, "n_layer": L, "n_head": H,
        "n_embd": C}
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}


def test_a_minidist_state_dict_exports_with_transposed_conv1d_weights(tmp_path):
    model = GPT(from_hf(write_folder(tmp_path / "src", hf_tensors(), hf_config_json()))[1], seed=5)
    state = model.state_dict()
    write_hf(tmp_path / "out", state, model.config)
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    name = "transformer.h.1.attn.c_proj.weight"  # square: only the values tell the layout
    assert np.array_equal(written[name], state[name].T) and not np.array_equal(written[name], state[name])
    assert "lm_head.weight" not in written


@pytest.mark.parametrize("layout", [dict(dp=2), dict(tp=2), dict(pp=2), dict(dp=2, zero=3),
                                    dict(tp=2, dtype="bfloat16")], ids=["dp2", "tp2", "pp2", "zero3", "tp2-bf16"])
def test_import_then_export_is_lossless_in_every_layout(folder, text, tmp_path, layout):
    run = dict(RUN, data=text, init_from_hf=folder, export_hf=str(tmp_path), dtype="float32")
    cfg = TrainConfig(**dict(run, **layout))

    def fn(group):
        c = with_hf_model(cfg)
        mesh = DeviceMesh(group, dp=c.dp, pp=c.pp, tp=c.tp)
        model, state, _ = build_parallel(c, mesh)
        write_outputs(c, model, state, mesh)

    run_local(fn, world_size=cfg.dp * cfg.pp * cfg.tp)
    original, written = load_file(folder + "/model.safetensors"), load_file(str(tmp_path / "model.safetensors"))
    assert written.keys() == original.keys()
    for name in original:
        assert written[name].dtype == np.float32 and np.array_equal(written[name], original[name]), name


def test_first_step_loss_is_the_reference_loss_in_one_process(folder, text):
    cfg = TrainConfig(**dict(RUN, data=text, init_from_hf=folder))
    loss = train(cfg, progress=False)[1][0]["loss"]
    train_tokens = load_data(with_hf_model(cfg))[1].train
    idx, targets = inputs_and_targets(get_batch(train_tokens, 0, cfg.batch_size, T, cfg.seed))
    expected = reference_loss(reference_logits(load_file(folder + "/model.safetensors"), idx), targets)
    assert loss == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("layout", [dict(dp=2), dict(tp=2), dict(pp=2, micro_batches=2), dict(dp=2, zero=3)],
                         ids=["dp2", "tp2", "pp2", "zero3"])
def test_every_layout_starts_from_the_one_process_losses(folder, text, layout):
    base = TrainConfig(**dict(RUN, steps=2, data=text, init_from_hf=folder))
    ref = [r["loss"] for r in train(base, progress=False)[1]]
    cfg = dataclasses.replace(base, **layout)
    runs = run_local(lambda group: [r["loss"] for r in train(cfg, progress=False, world=group)[1]],
                     world_size=cfg.dp * cfg.pp * cfg.tp)
    for losses in runs:
        np.testing.assert_allclose(losses, ref, rtol=1e-10)


def test_the_folder_decides_the_model_size_and_contradicting_flags_are_refused(folder, text):
    cfg = with_hf_model(TrainConfig(data=text, init_from_hf=folder, n_head=H))  # agreeing flags are fine
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size) == (L, H, C, T)
    with pytest.raises(ConfigError, match=r"--n-layer 3 \(the folder has 2\), --block-size 32 \(the folder has 16\)"):
        with_hf_model(TrainConfig(init_from_hf=folder, n_layer=3, block_size=32))


def broken(tmp_path, what):
    """A folder with one thing wrong."""
    tensors, config = hf_tensors(), hf_config_json()
    if what == "shape":
        tensors["transformer.h.0.attn.c_proj.weight"] = tensors["transformer.h.0.mlp.c_fc.weight"]
    elif what == "missing tensor":
        del tensors["transformer.h.1.mlp.c_fc.bias"]
    elif what == "integers":
        tensors["transformer.ln_f.bias"] = np.zeros(C, np.int64)
    elif what == "untied without lm_head":
        config["tie_word_embeddings"] = False
    else:
        config.update(what)
    path = write_folder(tmp_path / "bad", tensors, config)
    return path


@pytest.mark.parametrize("what, message", [
    ("shape", r"transformer.h.0.attn.c_proj.weight: shape \(16, 64\), the config needs \(16, 16\)"),
    ("missing tensor", "missing transformer.h.1.mlp.c_fc.bias"),
    ("untied without lm_head", "missing lm_head.weight"),
    ("integers", "tensors of dtype I64"),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "model_type is 'llama'"),
    ({"activation_function": "gelu"}, "activation_function 'gelu'"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon 1e-06"),
    ({"n_inner": 32}, "n_inner 32"),
    ({"n_head": 3}, "n_embd 16 is not divisible by n_head 3"),
])
def test_a_bad_folder_is_refused_before_anything_is_sent(tmp_path, text, what, message):
    cfg = TrainConfig(**dict(RUN, data=text, init_from_hf=broken(tmp_path, what), dp=2))

    def fn(group):
        with pytest.raises(ConfigError, match=message):
            train(cfg, progress=False, world=group)
        return group.seq

    assert run_local(fn, world_size=2) == [0, 0]


def test_parameter_servers_refuse_the_hugging_face_flags(folder):
    with pytest.raises(ConfigError, match="--export-hf, --init-from-hf do not apply"):
        check_config(TrainConfig(mode="ps", servers=1, batch_size=4, init_from_hf=folder, export_hf="out"), 2)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(HFFormatError, match="no such folder"):
        from_hf(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps(hf_config_json()))
    with pytest.raises(HFFormatError, match="no model.safetensors"):
        from_hf(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(HFFormatError, match="not a safetensors file"):
        from_hf(tmp_path)


def test_byte_tokens_outside_a_small_vocabulary_are_refused(tmp_path, text):
    tensors = hf_tensors()
    tensors["transformer.wte.weight"] = tensors["transformer.wte.weight"][:100]
    path = write_folder(tmp_path / "small", tensors, hf_config_json(vocab_size=100))
    largest = max(open(text, "rb").read())
    with pytest.raises(ConfigError, match=f"byte token id {largest} is outside the --init-from-hf model's vocabulary"):
        load_data(with_hf_model(TrainConfig(**dict(RUN, data=text, init_from_hf=path))))


def test_the_command_line_exits_2_on_a_bad_folder(tmp_path):
    result = subprocess.run([sys.executable, "-m", "minidist.train", "--init-from-hf", str(tmp_path / "nowhere")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "no such folder" in result.stderr


def test_a_tokenizer_json_in_the_folder_tokenizes_the_data(folder, text, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    words = sorted(set(open(text).read().split()))
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(["[UNK]"] + words)},
                                                                 unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "with-tokenizer"
    write_folder(path, load_file(folder + "/model.safetensors"), json.loads(open(folder + "/config.json").read()))
    tokenizer.save(str(path / "tokenizer.json"))
    corpus = load_data(with_hf_model(TrainConfig(**dict(RUN, data=text, init_from_hf=str(path)))))[1]
    train_tokens, val_tokens = corpus.train, corpus.val
    expected = tokenizer.encode(open(text).read()).ids
    assert train_tokens.dtype == np.uint16 and list(np.concatenate([train_tokens, val_tokens])) == expected
    assert max(expected) > 0 and len(expected) < len(open(text).read()) / 2  # words, not bytes


def test_transformers_loads_the_export_and_computes_the_same_logits(folder, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    state, config = from_hf(folder)
    model = GPT(config, seed=7)  # fresh weights: nothing borrowed from the folder's layout
    write_hf(tmp_path, model.state_dict(), config)
    hf_model, info = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    idx = np.random.default_rng(1).integers(0, V, size=(2, T))
    with torch.no_grad():
        expected = hf_model.eval()(torch.from_numpy(idx)).logits.numpy()
    np.testing.assert_allclose(model(idx)[0].data, expected, rtol=1e-5, atol=1e-5)


def test_a_folder_saved_by_transformers_imports_with_the_same_logits(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=C, n_layer=L, n_head=H)
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(str(tmp_path))
    hf_model = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
    state, gpt_config = from_hf(tmp_path)
    model = GPT(gpt_config, dtype="float32")
    load_full_state(model, state)
    idx = np.random.default_rng(2).integers(0, V, size=(2, T))
    with torch.no_grad():
        expected = hf_model(torch.from_numpy(idx)).logits.numpy()
    np.testing.assert_allclose(model(idx)[0].data, expected, rtol=1e-5, atol=1e-5)


def test_shards_tokenized_otherwise_than_the_init_from_hf_model_are_refused(tmp_path, text):
    from minidist.data.prepare import prepare
    folder = write_folder(tmp_path / "hf", hf_tensors(), hf_config_json())
    (tmp_path / "hf" / "tokenizer.json").write_text(prepare_bpe_json(tmp_path, text))
    shards = tmp_path / "shards"
    prepare([text], shards, workers=1)  # bytes
    with pytest.raises(ConfigError, match="was tokenized with bytes, not with .*tokenizer.json: its ids would mean other"):
        load_data(with_hf_model(TrainConfig(**dict(RUN, data=str(shards), init_from_hf=folder))))
    same = tmp_path / "same"
    prepare([text], same, tokenizer=str(tmp_path / "hf" / "tokenizer.json"), workers=1)  # the model's own: accepted
    assert load_data(with_hf_model(TrainConfig(**dict(RUN, data=str(same), init_from_hf=folder))))[1].kind == "prepared"


def prepare_bpe_json(tmp_path, text) -> str:
    """A small byte-level BPE's tokenizer.json learned from ``text`` (at most the model's vocabulary)."""
    from minidist.data.prepare import prepare
    prepare([text], tmp_path / "bpe", tokenizer=f"bpe:{V}", workers=1)
    return (tmp_path / "bpe" / "tokenizer.json").read_text()
