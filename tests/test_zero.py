"""ZeRO stages 0-3, in-process (ranks as threads): the specification.

1. Every stage, on 2 and 4 dp ranks, with SGD+momentum and AdamW, trains exactly like one process on
   the full batch (float64, 1e-10 relative), gradient clipping active, with gradient accumulation too.
2. Each rank holds the bytes the ZeRO paper says: stage 1 P + G + O/N, 2 P + (G + O)/N, 3 (P + G + O)/N.
3. Stages 1 and 2 send what plain data parallelism sends; stage 3 sends 1.5x.
4. Unsupported layouts are refused before anything is sent.
"""
import numpy as np
import pytest

import minidist
from minidist.model import GPTConfig
from minidist.parallel import accounting
from minidist.parallel.zero import ZeroOptimizer, check_zero_layout
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
    zero.reduce_gradients()
    return zero, model


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_held_per_rank_are_the_zero_paper_formulas(stage, dp, optimizer):
    def run(group):
        zero, _ = one_step(group, stage, optimizer)
        return zero.model_state_bytes(), zero.formula()
    for held, formula in minidist.run_local(run, dp):
        assert held == formula  # every unit of CONFIG divides by 4: the shards are exactly 1/N


def test_stage_3_holds_only_shards_between_uses_and_gathers_on_request():
    def run(group):
        zero, model = one_step(group, 3)
        between = [p.data.size for p in model.parameters()]
        with zero.full_parameters():
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
        zero.step()
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


def test_stage_3_pays_the_tied_embedding_twice_it_is_used_by_embed_and_head():
    (sent, P) = sent_per_step(3, 2, CONFIG)
    wte = CONFIG.vocab_size * CONFIG.n_embd * 8
    assert sent["total"] == 3 * (1 / 2) * (P + wte)


def test_unsupported_layouts_are_refused_up_front():
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        check_zero_layout(4, pp=1)
    for stage in (2, 3):
        with pytest.raises(ValueError, match="pipeline parallelism"):
            check_zero_layout(stage, pp=2)
    check_zero_layout(1, pp=2)  # stage 1 works per pipeline stage

    def recompute_then_zero3(group):
        from minidist.model import GPT
        from minidist.parallel.recompute import recompute_blocks
        model = GPT(CONFIG, dtype="float64")
        recompute_blocks(model)
        ZeroOptimizer(model, group, 3, "sgd", lr=0.1)
    with pytest.raises(ValueError, match="already recomputes"):
        minidist.run_local(recompute_then_zero3, 1)
