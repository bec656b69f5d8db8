"""Context parallelism in the trainer: each algorithm at cp 2 and 4, alone and with dp, tp (with
sequence parallelism at cp 2) and pp, trains like one process on the full batch in float64: the
loss of every step, the gradient norm, and every gradient (one SGD step at lr 1 without momentum,
clipping or decay moves each weight by exactly its gradient) to 1e-10 relative. Activation memory
per rank falls with cp; the trainer refuses what cannot be cut, on every rank, before sending."""
import dataclasses
from functools import lru_cache

import numpy as np
import pytest

from minidist import run_local
from minidist.model import GPT, GPTConfig
from minidist.inspect.accounting import activation_bytes
from minidist.parallel.context.context_parallel import context_parallel
from minidist.train import train
from minidist.train.config import ConfigError, TrainConfig, check_config

BASE = TrainConfig(n_layer=2, n_head=8, n_embd=16, block_size=16, batch_size=4, steps=2, eval_every=100,
                   eval_iters=1, sample_tokens=0, warmup=0, lr=1.0, min_lr=1.0, optimizer="sgd", momentum=0.0,
                   weight_decay=0.0, grad_clip=0.0, dtype="float64")
LAYOUTS = {"alone": {}, "dp2": dict(dp=2), "tp2": dict(tp=2), "pp2": dict(pp=2, micro_batches=2)}


def fit(cfg):
    """(losses and grad norms per step, the gradient of the first step, the final weights)."""
    first = dataclasses.replace(cfg, steps=1, export=cfg.export + ".1.npz")
    world = cfg.dp * cfg.pp * cfg.cp * cfg.tp
    run_local(lambda group: train(first, progress=False, world=group), world)
    histories = run_local(lambda group: train(cfg, progress=False, world=group)[1], world)
    assert all([r["loss"] for r in h] == [r["loss"] for r in histories[0]] for h in histories)  # every rank
    init = GPT(GPTConfig(vocab_size=256, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                         n_embd=cfg.n_embd), seed=cfg.seed, dtype="float64").state_dict()
    after_one = dict(np.load(first.export))
    gradient = {name: init[name] - after_one[name] for name in init}  # lr 1: w1 = w0 - g
    rows = [(r["loss"], r["grad_norm"]) for r in histories[0]]
    return rows, gradient, dict(np.load(cfg.export))


@lru_cache(maxsize=None)
def reference(data_dir):
    return fit(dataclasses.replace(BASE, data_dir=data_dir, export=f"{data_dir}/ref.npz"))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("algorithm", ["ring", "zigzag", "ulysses"])
def test_context_parallel_trains_like_one_process(algorithm, cp, layout, data_dir, tmp_path):
    extra = dict(LAYOUTS[layout])
    if layout == "tp2" and cp == 2:
        extra["sequence_parallel"] = True
    cfg = dataclasses.replace(BASE, **extra, cp=cp, cp_algorithm=algorithm, data_dir=data_dir,
                              export=str(tmp_path / "w.npz"))
    rows, gradient, weights = fit(cfg)
    ref_rows, ref_gradient, ref_weights = reference(data_dir)
    for (loss, norm), (ref_loss, ref_norm) in zip(rows, ref_rows):
        assert abs(loss - ref_loss) <= 1e-10 * abs(ref_loss)
        assert abs(norm - ref_norm) <= 1e-10 * ref_norm
    for name, ref in ref_gradient.items():
        assert np.abs(gradient[name] - ref).max() <= 1e-10 * np.abs(ref).max(), name
        assert np.abs(weights[name] - ref_weights[name]).max() <= 1e-10 * np.abs(ref_weights[name]).max(), name


def test_activation_memory_per_rank_falls_with_cp():
    """The arrays one rank's graph keeps for backward (accounting.activation_bytes), T = 64: at cp 2
    and 4 a rank keeps at most 1/cp of one process's (the ring keeps no T x T scores at all, so
    less; Ulysses keeps the scores of its nh/cp heads)."""
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=32)
    idx = np.random.default_rng(0).integers(0, 256, (2, 64))

    def kept(world, algorithm):
        model = GPT(config, dtype="float64")
        weights = [p.data for p in model.parameters()]
        if world is not None:
            context_parallel(model, world, algorithm)
        _, loss = model(idx, idx)
        return activation_bytes(loss, exclude=weights)

    one = kept(None, None)
    for algorithm in ("ring", "zigzag", "ulysses"):
        for cp in (2, 4):
            per_rank = run_local(lambda w: kept(w, algorithm), cp)
            assert len(set(per_rank)) == 1  # every rank keeps the same
            assert per_rank[0] <= one / cp, (algorithm, cp, per_rank[0], one)


@pytest.mark.parametrize("overrides, message", [
    (dict(cp=3, block_size=16), "the sequence of 16 tokens is not divisible by 3"),
    (dict(cp=2, cp_algorithm="zigzag", block_size=18), "the sequence of 18 tokens is not divisible by 4"),
    (dict(cp=2, tp=4, sequence_parallel=True, block_size=12), "the sequence of 12 tokens / cp 2 = 6 tokens per cp rank"),
    (dict(cp=4, tp=2, cp_algorithm="ulysses", n_head=4), "the 2 heads of each tp rank .* do not divide by cp 4"),
    (dict(cp=2, cp_algorithm="tree"), "--cp-algorithm must be one of ring, zigzag, ulysses"),
    (dict(cp=0), "--cp must be >= 1"),
])
def test_what_context_parallelism_cannot_cut_is_refused_before_anything_is_sent(overrides, message):
    cfg = dataclasses.replace(BASE, **overrides)
    with pytest.raises(ConfigError, match=message):
        check_config(cfg, max(1, cfg.cp) * cfg.tp)


def test_the_world_size_names_the_cp_axis():
    with pytest.raises(ConfigError, match=r"world size 2 != dp \* cp \* tp = 1 \* 2 \* 2 = 4"):
        check_config(dataclasses.replace(BASE, cp=2, tp=2), 2)


def test_every_cp_rank_reports_the_whole_sequences_loss():
    """The loss is averaged over cp in forward, so each rank reports one process's loss."""
    config = GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=8)
    idx = np.random.default_rng(1).integers(0, 256, (2, 16))
    ref = GPT(config, dtype="float64")(idx, idx)[1].item()

    def fn(world):
        model = context_parallel(GPT(config, dtype="float64"), world, "zigzag")
        return model(idx, idx)[1].item()
    for loss in run_local(fn, 4):
        assert abs(loss - ref) <= 1e-12 * ref
