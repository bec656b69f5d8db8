"""nanoGPT's knobs with nanoGPT's meanings: ``--beta1``, ``--beta2`` (AdamW's decays) and ``--no-bias``
(no biases in the Linear and LayerNorm layers), in every layout as in one process.

Each layout here trains 3 steps of AdamW with beta2 0.99 and no biases, in float64, and equals one
process on the full batch to 1e-10 relative (loss and gradient norm per step, every weight at the
end), as every layout does without the knobs (tests/test_composition.py).
"""
import numpy as np
import pytest

from minidist import run_local
from minidist.checkpoint.identity import run_identity
from minidist.model import GPT, GPTConfig
from minidist.train import train
from minidist.train.build import optimizer_settings
from minidist.train.config import ConfigError, TrainConfig, check_config

KNOBS = dict(beta1=0.8, beta2=0.99, no_bias=True)
RUN = dict(n_layer=4, n_head=4, n_embd=16, block_size=16, batch_size=8, steps=3, eval_every=100, eval_iters=1,
           sample_tokens=0, warmup=1, lr=1e-2, grad_clip=0.5, dtype="float64", optimizer="adamw", **KNOBS)
LAYOUTS = {
    "dp2 zero1": dict(dp=2, zero=1),
    "tp2 sp": dict(tp=2, sequence_parallel=True),
    "pp2 zbv": dict(pp=2, schedule="zbv", virtual_stages=2, micro_batches=2),
    "cp2 ulysses": dict(cp=2, cp_algorithm="ulysses"),
    "dp2 tp2 zero3 recompute": dict(dp=2, tp=2, zero=3, recompute="full"),
    "dp2 ep2 moe": dict(dp=2, ep=2, n_experts=4, moe_every=2),
    "pp2 tp2 interleaved": dict(pp=2, tp=2, schedule="interleaved", virtual_stages=2, micro_batches=2),
}


def fit(cfg):
    ranks = cfg.dp * cfg.tp * cfg.pp * cfg.cp
    out = run_local(lambda group: train(cfg, progress=False, world=group), ranks) if ranks > 1 else [train(cfg, progress=False)]
    model, history = out[0]
    return history, out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    cache = {}

    def get(**model):
        key = tuple(sorted(model.items()))
        if key not in cache:
            cfg = TrainConfig(**{**RUN, **model}, export=str(tmp_path_factory.mktemp("one") / "w.npz"))
            cache[key] = fit(cfg)[0], dict(np.load(cfg.export))
        return cache[key]
    return get


def close(a, b):
    return abs(a - b) <= 1e-10 * max(abs(b), 1e-300)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_with_the_knobs_equals_one_process(tmp_path, one_process, name):
    layout = dict(LAYOUTS[name])
    model = {k: layout.pop(k) for k in ("n_experts", "moe_every") if k in layout}
    history_ref, weights_ref = one_process(**model)
    cfg = TrainConfig(**{**RUN, **model, **layout}, export=str(tmp_path / "w.npz"))
    history, _ = fit(cfg)
    for row, ref in zip(history, history_ref):
        assert close(row["loss"], ref["loss"]) and close(row["grad_norm"], ref["grad_norm"]), (row, ref)
    weights = dict(np.load(cfg.export))
    assert weights.keys() == weights_ref.keys()
    for key, ref in weights_ref.items():
        assert np.abs(weights[key] - ref).max() <= 1e-10 * np.abs(ref).max(), key


def test_no_bias_builds_nanogpts_model_and_the_betas_change_the_math(one_process):
    with_bias = set(dict(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=8)).named_parameters()))
    without = set(dict(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=8, bias=False)).named_parameters()))
    assert with_bias - without == {n for n in with_bias if n.endswith(".bias")} != set()
    assert optimizer_settings(TrainConfig(**RUN))["betas"] == (0.8, 0.99)
    history, weights = one_process()
    assert not any(name.endswith(".bias") for name in weights)
    # the knobs are not ignored: nanoGPT's defaults give other numbers (so the layouts above, equal to
    # one process, honour them too)
    default = fit(TrainConfig(**{**RUN, "beta1": 0.9, "beta2": 0.95}))[0]
    assert default[-1]["loss"] != history[-1]["loss"]


def test_the_knobs_are_part_of_the_runs_identity_once_set():
    base = dict(optimizer="adamw")
    plain = run_identity(TrainConfig(**base), {})
    assert not {"beta1", "beta2", "no_bias"} & plain.keys()  # a checkpoint written before the knobs resumes
    knobs = run_identity(TrainConfig(**base, beta2=0.99, no_bias=True), {})
    assert knobs["beta2"] == 0.99 and knobs["no_bias"] is True and "beta1" not in knobs
    assert "beta2" not in run_identity(TrainConfig(optimizer="sgd", beta2=0.99), {})  # SGD has none


@pytest.mark.parametrize("flags, words", [
    (dict(beta2=1.0), "--beta2 must be in [0, 1)"),
    (dict(beta1=-0.1), "--beta1 must be in [0, 1)"),
    (dict(beta2=float("nan")), "--beta2"),
    (dict(no_bias=True, export_hf="hf"), "always has biases: use --export for a model built with --no-bias"),
])
def test_bad_knobs_are_refused_before_anything_runs(flags, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        check_config(TrainConfig(**flags), 1)
