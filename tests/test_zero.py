"""ZeRO stages 0-3, in-process (ranks as threads): the specification.

1. Every stage, on 2 and 4 dp ranks, with SGD+momentum and AdamW, trains exactly like one process on
   the full batch (float64, 1e-10 relative), gradient clipping active, with gradient accumulation too.
2. Each rank holds the bytes the ZeRO paper says: stage 1 P + G + O/N, 2 P + (G + O)/N, 3 (P + G + O)/N;
   in mixed precision the paper's 2 + 2 + K bytes per parameter (K = 12 for Adam: float32 masters
   and moments), sharded the same way.
3. Stages 1 and 2 send what plain data parallelism sends; stage 3 sends 1.5x.
4. Stage 3 computes what stage 2 computes: weights are gathered again for backward through
   saved-tensor hooks, activations are kept as without ZeRO, nothing is recomputed unless asked.
5. An overflow on one rank skips the step on every rank and lowers the scale there too.
6. A stage outside 0-3 is refused before anything is sent.
"""
import numpy as np
import pytest

import minidist
from minidist.model import GPTConfig
from minidist.inspect import accounting
from minidist.parallel.compose.gradients import apply_gradients
from minidist.parallel.zero.full_state import full_parameters
from minidist.parallel.zero.optimizer import ZeroOptimizer
from minidist.inspect import zero_memory
from tests.mpi.zero_reference import CLIP, CONFIG, batch, max_relative_error, reference, zero_rank

REFERENCE = {opt: reference(opt) for opt in ("sgd", "adamw")}


def test_reference_run_clips_so_the_parity_tests_exercise_clipping():
    for losses, norms, _ in REFERENCE.values():
        assert max(norms) > CLIP  # the clipping code path runs


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_matches_one_process_on_the_full_batch(stage, dp, optimizer):
    ref_losses, ref_norms, ref_state = REFERENCE[optimizer]
    runs = minidist.run_local(lambda g: zero_rank(g, stage, optimizer)[:3], dp)
    losses = np.mean([r[0] for r in runs], axis=0)  # the step loss: mean over dp ranks
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0)
    for _, norms, state in runs:
        np.testing.assert_allclose(norms, ref_norms, rtol=1e-10, atol=0)
        assert max_relative_error(state, ref_state) <= 1e-10


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradient_accumulation_over_micro_batches_matches_one_process(stage):
    ref_losses, _, ref_state = REFERENCE["sgd"]
    runs = minidist.run_local(lambda g: zero_rank(g, stage, "sgd", micro_batches=2)[:3], 2)
    np.testing.assert_allclose(np.mean([r[0] for r in runs], axis=0), ref_losses, rtol=1e-10, atol=0)
    assert max(max_relative_error(state, ref_state) for _, _, state in runs) <= 1e-10


def one_step(group, stage, optimizer="adamw", config=CONFIG):
    """A ZeroOptimizer after one forward/backward (gradients reduced, not yet stepped)."""
    from minidist.model import GPT
    model = GPT(config, seed=0, dtype="float64")
    zero = ZeroOptimizer(model, group, stage, optimizer, lr=1e-3)
    idx, targets = batch(0)
    rows = np.array_split(np.arange(len(idx)), group.size)[group.rank]
    group.trace.clear()
    model(idx[rows], targets[rows])[1].backward()
    zero.reduce()
    zero.unscale(1.0)
    return zero, model


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_held_per_rank_are_the_zero_paper_formulas(stage, dp, optimizer):
    def run(group):
        zero, _ = one_step(group, stage, optimizer)
        return zero_memory.model_state_bytes(zero), zero_memory.formula(zero)
    for held, formula in minidist.run_local(run, dp):
        assert held == formula  # every unit of CONFIG divides by 4: the shards are exactly 1/N


def test_stage_3_holds_only_shards_between_uses_and_gathers_on_request():
    def run(group):
        zero, model = one_step(group, 3)
        between = [p.data.size for p in model.parameters()]
        with full_parameters(zero):
            inside = {name: p.data.shape for name, p in model.named_parameters()}
        return between, inside, [p.data.size for p in model.parameters()]
    for between, inside, after in minidist.run_local(run, 2):
        assert set(between) == {0} and set(after) == {0}
        assert inside["transformer.h.0.attn.c_attn.weight"] == (3 * CONFIG.n_embd, CONFIG.n_embd)


def sent_per_step(stage, dp, config):
    """Bytes each rank sends on the dp group for one step without clipping, from its trace."""
    from minidist.model import GPT

    def run(group):
        model = GPT(config, seed=0, dtype="float64")
        zero = ZeroOptimizer(model, group, stage, "sgd", lr=1e-3, momentum=0.9)
        idx, targets = batch(0)
        rows = np.array_split(np.arange(len(idx)), group.size)[group.rank]
        group.trace.clear()
        model(idx[rows], targets[rows])[1].backward()
        zero.reduce()  # the pipeline's steps that are ZeRO's own (no clipping: nothing else is sent)
        zero.unscale(1.0)
        zero.update(1e-3)
        param_bytes = sum(s.unit.numel for s in zero.shards) * 8
        return accounting.bus_bytes(group.trace.events, group.name, group.size), param_bytes
    return minidist.run_local(run, dp)[0]


@pytest.mark.parametrize("dp", [2, 4])
def test_stages_1_and_2_send_what_data_parallelism_sends_and_stage_3_one_and_a_half_times(dp):
    untied = GPTConfig(**{**vars(CONFIG), "tie_embeddings": False})
    sent = {stage: sent_per_step(stage, dp, untied) for stage in range(4)}
    (dp_bytes, P) = sent[0]
    assert dp_bytes["all_reduce"] == dp_bytes["total"] == 2 * (dp - 1) / dp * P
    for stage in (1, 2):
        assert sent[stage][0]["reduce_scatter"] == sent[stage][0]["all_gather"] == (dp - 1) / dp * P
        assert sent[stage][0]["total"] == dp_bytes["total"]
    assert sent[3][0]["all_gather"] == 2 * sent[3][0]["reduce_scatter"] == 2 * (dp - 1) / dp * P
    assert sent[3][0]["total"] == 1.5 * dp_bytes["total"]


def test_stage_3_gathers_the_tied_embedding_for_embed_and_head_and_keeps_it_across_backward():
    # forward gathers wte for the embedding and again for the head; backward gathers it once, at the
    # head, and keeps it until the embedding's gradient completes it: 3 gathers + 1 reduce-scatter of P,
    # plus one more gather of wte
    (sent, P) = sent_per_step(3, 2, CONFIG)
    wte = CONFIG.vocab_size * CONFIG.n_embd * 8
    assert sent["all_gather"] == (1 / 2) * (2 * P + wte)
    assert sent["total"] == (1 / 2) * (3 * P + wte)


def test_unsupported_stages_are_refused_up_front():
    def stage_4(group):
        from minidist.model import GPT
        ZeroOptimizer(GPT(CONFIG, dtype="float64"), group, 4, "sgd", lr=0.1)
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        minidist.run_local(stage_4, 1)


@pytest.mark.parametrize("optimizer, k", [("adamw", 12), ("sgd", 8)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mixed_precision_bytes_per_rank_are_the_papers_2_2_k_formulas(stage, optimizer, k):
    # the paper's mixed-precision model: parameters and gradients in float16 (2 bytes each), the
    # optimizer's float32 masters and moments K bytes per parameter (Adam: 4 + 4 + 4 = 12), sharded
    # per stage over the N = 4 dp ranks
    from minidist.amp import DynamicLossScaler
    from minidist.model import GPT

    def run(group):
        model = GPT(CONFIG, seed=0, dtype="float16")
        zero = ZeroOptimizer(model, group, stage, optimizer, lr=1e-3, mixed_precision="float16",
                             scaler=DynamicLossScaler(group=group))
        idx, targets = batch(0)
        rows = np.array_split(np.arange(len(idx)), group.size)[group.rank]
        model(idx[rows], targets[rows])[1].backward()
        zero.reduce()
        zero.unscale(zero.scaler.scale)
        psi = sum(s.unit.numel for s in zero.shards)
        return zero_memory.model_state_bytes(zero), zero_memory.formula(zero), psi
    for held, formula, psi in minidist.run_local(run, 4):
        n = {"parameters": 4 if stage >= 3 else 1, "gradients": 4 if stage >= 2 else 1, "optimizer": 4 if stage else 1}
        assert formula == {"parameters": 2 * psi / n["parameters"], "gradients": 2 * psi / n["gradients"],
                           "optimizer": k * psi / n["optimizer"]}
        assert held == formula


def count_forwards(stage, recompute=False, micro_batches=1):
    """(Linear forwards run in one step on rank 0, bytes its graph keeps for backward after forward)."""
    from minidist.autograd import ops_nn
    from minidist.model import GPT
    from minidist.nn.recompute import recompute_blocks
    calls = []
    original = ops_nn.Linear.forward

    def counted(ctx, *args):
        calls.append(1)
        return original(ctx, *args)

    def run(group):
        model = GPT(CONFIG, seed=0, dtype="float64")
        if recompute:
            recompute_blocks(model)
        zero = ZeroOptimizer(model, group, stage, "sgd", lr=1e-3)
        idx, targets = batch(0)
        rows = np.array_split(np.arange(len(idx)), group.size)[group.rank]
        loss = model(idx[rows], targets[rows])[1]
        kept = zero_memory.activation_bytes(zero, loss)
        loss.backward()
        apply_gradients(zero, 1e-3)
        return kept
    ops_nn.Linear.forward = staticmethod(counted)
    try:
        kept = minidist.run_local(run, 2)[0]
    finally:
        ops_nn.Linear.forward = original
    return len(calls) // 2, kept


def test_zero_3_computes_what_zero_2_computes_and_keeps_the_activations_no_zero_keeps():
    # ZeRO-3 gathers the weights again for backward through saved-tensor hooks: no block runs its
    # forward twice (only --recompute does that), and the graph keeps the activations of plain training
    (linears_2, kept_0), (linears_3, kept_3) = count_forwards(2), count_forwards(3)
    assert linears_3 == linears_2 == 4 * CONFIG.n_layer + 1  # c_attn, c_proj, c_fc, mlp.c_proj per block; lm_head
    assert kept_3 == kept_0 > 0
    linears_r, kept_r = count_forwards(3, recompute=True)
    assert linears_r == linears_2 + 4 * CONFIG.n_layer and kept_r < kept_3  # recompute: a choice, not forced


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(stage):
    from minidist.amp import DynamicLossScaler
    from minidist.model import GPT

    def run(group):
        model = GPT(CONFIG, seed=0, dtype="float16")
        scaler = DynamicLossScaler(init_scale=1024.0, group=group)
        zero = ZeroOptimizer(model, group, stage, "adamw", lr=1e-3, mixed_precision="float16", scaler=scaler)
        before = [s.param.data.copy() for s in zero.shards]
        idx, targets = batch(0)
        rows = np.array_split(np.arange(len(idx)), group.size)[group.rank]
        loss = model(idx[rows], targets[rows])[1]
        with np.errstate(over="ignore", invalid="ignore"):  # rank 1 overflows, on purpose
            loss.backward(np.full_like(loss.data, 1e30 if group.rank == 1 else 1.0))
        skipped = apply_gradients(zero, 1e-3, scaler=scaler) is None
        same = all(np.array_equal(a, s.param.data) for a, s in zip(before, zero.shards))
        return skipped, scaler.scale, scaler.skipped_steps, same
    assert minidist.run_local(run, 2) == [(True, 512.0, 1, True)] * 2


def test_mixed_precision_weight_decay_is_applied_to_the_float32_masters_at_its_rate():
    # The decay mask was made in the model's dtype: under float16, 1 - lr * 0.1 was rounded to
    # float16, whose spacing below 1 is 2**-11, so a decay of 1e-4 per step vanished (and 3e-4 became
    # 4.9e-4). The masters are float32; their decay must be float32's: p * (1 - lr * rate). (bfloat16
    # is emulated in float32 storage, so its mask was float32 already.)
    from minidist.amp import DynamicLossScaler
    from minidist.model import GPT

    def run(group):
        model = GPT(CONFIG, seed=0, dtype="float16")
        scaler = DynamicLossScaler(group=group)
        zero = ZeroOptimizer(model, group, 1, "adamw", lr=1e-3, weight_decay=0.1, mixed_precision="float16",
                             scaler=scaler)
        before = [s.param.data.copy() for s in zero.shards]
        idx, targets = batch(0)
        loss = model(idx, targets)[1]
        loss.backward(np.zeros_like(loss.data))  # zero gradients: AdamW's step is the decay alone
        assert apply_gradients(zero, 1e-3, scaler=scaler) is not None
        return [(b, s.param.data, np.asarray(s.decay, bool)) for b, s in zip(before, zero.shards)]
    for b, after, decays in minidist.run_local(run, 2)[0]:
        assert after.dtype == np.float32
        np.testing.assert_array_equal(after[~decays], b[~decays])
        np.testing.assert_allclose(after[decays], b[decays] * (1 - 1e-3 * 0.1), rtol=2 ** -23)
