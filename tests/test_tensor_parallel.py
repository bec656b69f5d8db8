"""The GPT made tensor parallel (Megatron, optionally with sequence parallelism, by ``tensor_parallel``
applied to the one-process model) computes what one process computes: the same loss on every rank, the same logits once the vocabulary slices are joined, and
every parameter's gradient equal to the single-process gradient once the shards are joined
(float64, 1e-10 relative). The trace proves the communication formulas: per transformer layer
2 all-reduces forward and 2 backward, or with sequence parallelism 2 all-gathers + 2
reduce-scatters each way, and exactly 3 small all-reduces in the vocab-parallel cross-entropy."""
from collections import Counter

import numpy as np
import pytest

import minidist
from minidist.model import GPT, GPTConfig
from minidist.optim import SGD, AdamW
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.tensor.apply import tensor_parallel
from minidist.parallel.compose.complete import sync_sequence_parallel_grads
from minidist.parallel.tensor.tensor_parallel import unshard

# 12 heads and T = 12 split over tp = 1, 2, 3, 4; vocab 11 divisible by none of 2, 3, 4 (padded)
CONFIG = GPTConfig(vocab_size=11, block_size=12, n_layer=2, n_head=12, n_embd=24)


def batch(config, B=2, T=12, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, config.vocab_size, (B, T)), rng.integers(0, config.vocab_size, (B, T))


def rel_err(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


def single_process(config, idx, targets, dtype="float64"):
    model = GPT(config, seed=0, dtype=dtype)
    logits, loss = model(idx, targets)
    loss.backward()
    return model, logits.data, loss.item()


def tp_ranks(config, tp, idx, targets, sequence_parallel, dtype="float64"):
    """Per rank: (loss, logits shard, {name: grad shard}, {name: param shard}) after one backward."""
    def rank(world):
        group = DeviceMesh(world, tp=tp).tp_group
        model = tensor_parallel(GPT(config, seed=0, dtype=dtype), group, sequence_parallel=sequence_parallel)
        logits, loss = model(idx, targets)
        loss.backward()
        sync_sequence_parallel_grads(model, group)
        params = dict(model.named_parameters())
        return loss.item(), logits.data, {n: p.grad for n, p in params.items()}, {n: p.data for n, p in params.items()}
    return minidist.run_local(rank, tp)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_loss_logits_and_every_gradient_match_one_process(tp, sequence_parallel, tie):
    assert_matches_one_process(GPTConfig(**{**CONFIG.__dict__, "tie_embeddings": tie}), tp, sequence_parallel)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_a_mixture_of_experts_matches_one_process(sequence_parallel):
    """Router split by experts (its logits all-gathered), every expert's hidden units split, with a
    capacity that drops some assignments and the balance loss's gradient in the router's."""
    config = GPTConfig(**{**CONFIG.__dict__, "n_experts": 4, "top_k": 2, "capacity_factor": 1.0})
    assert_matches_one_process(config, 2, sequence_parallel)


def test_the_shard_is_the_same_model_in_place():
    """No twin model: tensor_parallel cuts the GPT it is given, whose modules keep their classes."""
    def rank(world):
        model = GPT(CONFIG, seed=0, dtype="float64")
        before = [(name, type(m)) for name, m in model.named_modules()]
        assert tensor_parallel(model, world, sequence_parallel=True) is model
        return before == [(name, type(m)) for name, m in model.named_modules()]
    assert minidist.run_local(rank, 2) == [True, True]


def assert_matches_one_process(config, tp, sequence_parallel):
    """One forward and backward on ``tp`` ranks: the loss bitwise the same on every rank and equal to
    one process's, the logits and every gradient joined from the shards equal to its (1e-10)."""
    idx, targets = batch(config)
    ref, ref_logits, ref_loss = single_process(config, idx, targets)
    ranks = tp_ranks(config, tp, idx, targets, sequence_parallel)

    assert len({loss for loss, *_ in ranks}) == 1  # bitwise the same on every rank
    assert abs(ranks[0][0] - ref_loss) <= 1e-10 * abs(ref_loss)
    logits = np.concatenate([r[1] for r in ranks], axis=-1)  # (B, T, V_pad): vocab slices side by side
    assert logits.shape[-1] == -(-config.vocab_size // tp) * tp
    assert rel_err(logits[..., :config.vocab_size], ref_logits) <= 1e-10
    ref_params = dict(ref.named_parameters())
    assert list(ranks[0][2]) == list(ref_params)  # GPT-2 names, same order (lm_head only when untied)
    for name, p in ref_params.items():
        full_grad = unshard(name, [r[2][name] for r in ranks], config.vocab_size)
        assert full_grad.shape == p.shape, name
        assert rel_err(full_grad, p.grad) <= 1e-10, name


def test_initial_shards_slice_the_single_process_weights_exactly():
    ref = GPT(CONFIG, seed=0, dtype="float64")
    ranks = tp_ranks(CONFIG, 3, *batch(CONFIG), sequence_parallel=False)
    for name, p in ref.named_parameters():
        np.testing.assert_array_equal(unshard(name, [r[3][name] for r in ranks], CONFIG.vocab_size), p.data)
    padded_rows = ranks[-1][3]["transformer.wte.weight"][-1]  # vocab 11 padded to 12: the last row
    np.testing.assert_array_equal(padded_rows, 0.0)


def test_float32_matches_to_1e_5():
    idx, targets = batch(CONFIG)
    ref, _, ref_loss = single_process(CONFIG, idx, targets, dtype="float32")
    ranks = tp_ranks(CONFIG, 2, idx, targets, sequence_parallel=True, dtype="float32")
    assert abs(ranks[0][0] - ref_loss) <= 1e-5 * abs(ref_loss)
    for name, p in ref.named_parameters():
        assert rel_err(unshard(name, [r[2][name] for r in ranks], CONFIG.vocab_size), p.grad) <= 1e-5, name


def test_a_rank_holding_only_padding_still_matches():
    config = GPTConfig(vocab_size=5, block_size=12, n_layer=1, n_head=4, n_embd=8)  # tp 4: rows 2+2+1(+1)+0(+2)
    idx, targets = batch(config)
    ref, _, ref_loss = single_process(config, idx, targets)
    ranks = tp_ranks(config, 4, idx, targets, sequence_parallel=False)
    assert abs(ranks[0][0] - ref_loss) <= 1e-10 * abs(ref_loss)
    for name, p in ref.named_parameters():
        assert rel_err(unshard(name, [r[2][name] for r in ranks], config.vocab_size), p.grad) <= 1e-10, name
    np.testing.assert_array_equal(ranks[3][2]["transformer.wte.weight"], 0.0)  # padding gets no gradient


@pytest.mark.parametrize("make_optimizer", [
    lambda params: SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
    lambda params: AdamW(params, lr=1e-2, weight_decay=0.1),
], ids=["sgd-momentum", "adamw"])
def test_training_steps_match_one_process(make_optimizer):
    tokens = np.random.default_rng(1).integers(0, CONFIG.vocab_size, (10, 2, 13))  # 10 steps of (B, T+1)
    ref = GPT(CONFIG, seed=0, dtype="float64")
    opt = make_optimizer(ref.named_parameters())
    ref_losses = []
    for step in tokens:
        opt.zero_grad()
        _, loss = ref(step[:, :-1], step[:, 1:])
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())

    def rank(world):
        model = tensor_parallel(GPT(CONFIG, seed=0, dtype="float64"), world, sequence_parallel=True)
        opt = make_optimizer(model.named_parameters())
        losses = []
        for step in tokens:
            opt.zero_grad()
            _, loss = model(step[:, :-1], step[:, 1:])
            loss.backward()
            sync_sequence_parallel_grads(model, world)
            opt.step()
            losses.append(loss.item())
        return losses, {n: p.data for n, p in model.named_parameters()}

    ranks = minidist.run_local(rank, 3)
    for losses, _ in ranks:  # every tp rank reports the full loss
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0)
    for name, p in ref.named_parameters():
        assert rel_err(unshard(name, [r[1][name] for r in ranks], CONFIG.vocab_size), p.data) <= 1e-10, name
    padded_row = ranks[-1][1]["transformer.wte.weight"][-1]  # vocab 11 padded to 12 over 3 ranks
    np.testing.assert_array_equal(padded_row, 0.0)  # no gradient ever, and decay keeps zero at zero


def test_shards_are_marked_for_clipping_and_sequence_parallel_sync():
    def rank(world):
        model = tensor_parallel(GPT(CONFIG, seed=0, dtype="float64"), world, sequence_parallel=True)
        return {n: (p.tensor_parallel, p.sequence_parallel) for n, p in model.named_parameters()}
    marks = minidist.run_local(rank, 2)[0]
    sharded = {n for n, (tp, _) in marks.items() if tp}
    assert sharded == {n for n in marks if n == "transformer.wte.weight" or ".c_attn." in n or ".c_fc." in n
                       or n.endswith("c_proj.weight")}
    assert all(sp == (not tp) for tp, sp in marks.values())  # everything replicated sees only my tokens


def communication(config, tp, sequence_parallel):
    """Collectives on the tp group per rank: (forward Counter, backward Counter, sync Counter)."""
    idx, targets = batch(config)

    def rank(world):
        group = DeviceMesh(world, tp=tp).tp_group
        model = tensor_parallel(GPT(config, seed=0, dtype="float64"), group, sequence_parallel=sequence_parallel)
        counts = []
        for phase in ("forward", "backward", "sync"):
            group.trace.clear()
            if phase == "forward":
                _, loss = model(idx, targets)
            elif phase == "backward":
                loss.backward()
            else:
                sync_sequence_parallel_grads(model, group)
            counts.append(Counter(e.op for e in group.trace.events if e.group == group.name))
        return counts
    ranks = minidist.run_local(rank, tp)
    assert all(r == ranks[0] for r in ranks)
    return ranks[0]


@pytest.mark.parametrize("n_layer", [1, 3])
def test_trace_counts_2_all_reduces_per_layer_each_way(n_layer):
    config = GPTConfig(**{**CONFIG.__dict__, "n_layer": n_layer})
    forward, backward, sync = communication(config, 2, sequence_parallel=False)
    # forward: g after attention and MLP per layer, g after the embedding, 3 in the cross-entropy
    assert forward == Counter(all_reduce=2 * n_layer + 1 + 3)
    # backward: f before attention and MLP per layer, f before the LM head; the cross-entropy sends nothing
    assert backward == Counter(all_reduce=2 * n_layer + 1)
    assert sync == Counter()  # nothing to sync without sequence parallelism


@pytest.mark.parametrize("n_layer", [1, 3])
def test_trace_sequence_parallel_swaps_all_reduce_for_gather_and_reduce_scatter(n_layer):
    config = GPTConfig(**{**CONFIG.__dict__, "n_layer": n_layer})
    forward, backward, sync = communication(config, 2, sequence_parallel=True)
    # forward: all-gather before attention, MLP and the head; reduce-scatter after attention, MLP and
    # the embedding; the cross-entropy's 3 all-reduces stay
    assert forward == Counter(all_gather=2 * n_layer + 1, reduce_scatter=2 * n_layer + 1, all_reduce=3)
    assert backward == Counter(all_gather=2 * n_layer + 1, reduce_scatter=2 * n_layer + 1)
    assert sync == Counter(all_reduce=1)  # all replicated gradients in one flat buffer


def test_invalid_layouts_fail_clearly():
    with pytest.raises(ValueError, match="n_head = 12 is not divisible by tp = 5"):
        minidist.run_local(lambda world: tensor_parallel(GPT(CONFIG, 0, "float64"), world), 5)

    def odd_sequence(world):
        model = tensor_parallel(GPT(CONFIG, 0, "float64"), world, sequence_parallel=True)
        model(*batch(CONFIG, T=7))
    with pytest.raises(ValueError, match="T = 7 is not divisible by tp = 2"):
        minidist.run_local(odd_sequence, 2)
