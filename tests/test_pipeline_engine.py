"""The pipeline engine, in-process (ranks as threads): every schedule trains exactly like one process
on the whole batch, holds as many micro-batches as the formulas say, and stages split by cost."""
import numpy as np
import pytest

import minidist
from minidist.data import get_batch, inputs_and_targets
from minidist.model import GPT, GPTConfig
from minidist.optim import SGD, AdamW
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.pipeline import (Action, PipelineEngine, PipelineStage, compute_spans, estimate_layer_costs,
                                        executed_timeline, partition_layers, placement_of, split_micro_batches)
from minidist.parallel.pipeline.known_costs import sleeping_gpt

TOKENS = np.random.default_rng(0).integers(0, 256, size=4000)
B, STEPS = 8, 10


def config(n_layer):
    return GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, block_size=8)


def make_optimizer(name, named_parameters):
    if name == "sgd":
        return SGD(named_parameters, lr=0.1, momentum=0.9, weight_decay=0.1)
    return AdamW(named_parameters, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def one_process(n_layer, optimizer, steps=STEPS):
    """Losses and final weights of the single-process run on the full batch."""
    model = GPT(config(n_layer), seed=1, dtype="float64")
    opt = make_optimizer(optimizer, model.named_parameters())
    losses = []
    for step in range(steps):
        idx, targets = inputs_and_targets(get_batch(TOKENS, step, B, 8, seed=3))
        opt.zero_grad()
        _, loss = model(idx, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def pipelined(p, schedule, m, v, n_layer, optimizer, steps=STEPS):
    """Per rank: (losses, the stage's state_dict, peak in-flight micro-batches) of the pipelined run."""
    def rank(world):
        mesh = DeviceMesh(world, pp=p)
        stage = PipelineStage(GPT(config(n_layer), seed=1, dtype="float64"), mesh.pp_rank, p, v,
                              placement=placement_of(schedule))
        engine = PipelineEngine(stage, mesh, schedule, m, v)
        opt = make_optimizer(optimizer, stage.named_parameters())
        losses = []
        for step in range(steps):
            opt.zero_grad()
            losses.append(engine.forward_backward(split_micro_batches(get_batch(TOKENS, step, B, 8, seed=3), m)))
            engine.all_reduce_tied_grads()
            opt.step()
        return losses, stage.state_dict(), engine.peak_in_flight
    return minidist.run_local(rank, p)


def assert_matches_one_process(results, reference):
    ref_losses, ref_weights = reference
    merged = {}
    for losses, weights, _ in results:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0)  # every rank reports the loss
        assert not merged.keys() & weights.keys(), "two stages hold the same parameter name"
        merged.update(weights)
    tied = ref_weights.keys() - merged.keys()
    assert tied <= {"lm_head.weight"}  # on one rank with all stages the tied matrix has one name
    assert merged.keys() | tied == ref_weights.keys()
    for name, value in merged.items():
        np.testing.assert_allclose(value, ref_weights[name], rtol=1e-10, atol=1e-13, err_msg=name)


CONFIGS = [  # (p, schedule, m, v, n_layer)
    (2, "gpipe", 4, 1, 4), (2, "1f1b", 2, 1, 4), (2, "1f1b", 8, 1, 4), (2, "interleaved", 4, 2, 4),
    (4, "gpipe", 4, 1, 4), (4, "1f1b", 8, 1, 4), (4, "interleaved", 4, 2, 8),
    (2, "zb-h1", 4, 1, 4), (4, "zb-h1", 8, 1, 4), (2, "zbv", 4, 2, 4), (4, "zbv", 8, 2, 8),
]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("p,schedule,m,v,n_layer", CONFIGS)
def test_every_schedule_trains_like_one_process(p, schedule, m, v, n_layer, optimizer):
    assert_matches_one_process(pipelined(p, schedule, m, v, n_layer, optimizer),
                               one_process(n_layer, optimizer))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 2), (4, 8)])
def test_measured_in_flight_micro_batches_follow_the_formulas(p, m):
    peaks_1f1b = [peak for _, _, peak in pipelined(p, "1f1b", m, 1, 4, "sgd", steps=1)]
    peaks_gpipe = [peak for _, _, peak in pipelined(p, "gpipe", m, 1, 4, "sgd", steps=1)]
    assert peaks_1f1b == [min(p - stage, m) for stage in range(p)]
    assert peaks_gpipe == [m] * p
    peaks_zb = [peak for _, _, peak in pipelined(p, "zb-h1", m, 1, 4, "sgd", steps=1)]
    assert max(peaks_zb) == max(peaks_1f1b)  # ZB-H1: 1F1B's peak activation memory, held until W


def test_tied_embedding_copies_stay_equal_and_get_the_summed_gradient():
    def rank(world):
        mesh = DeviceMesh(world, pp=2)
        stage = PipelineStage(GPT(config(2), seed=1, dtype="float64"), mesh.pp_rank, 2)
        engine = PipelineEngine(stage, mesh, "1f1b", 2)
        engine.forward_backward(split_micro_batches(get_batch(TOKENS, 0, B, 8, seed=3), 2))
        weight = stage.transformer.wte.weight if mesh.is_first_stage else stage.lm_head.weight
        partial = weight.grad.copy()
        engine.all_reduce_tied_grads()
        return partial, weight.grad, getattr(weight, "tied_copy", False)

    (embed_part, first, first_is_copy), (head_part, last, last_is_copy) = minidist.run_local(rank, 2)
    model = GPT(config(2), seed=1, dtype="float64")
    model(*inputs_and_targets(get_batch(TOKENS, 0, B, 8, seed=3)))[1].backward()
    np.testing.assert_array_equal(first, last)
    np.testing.assert_allclose(first, model.transformer.wte.weight.grad, rtol=1e-12, atol=1e-15)
    assert np.abs(embed_part).sum() > 0 and np.abs(head_part).sum() > 0  # each copy had only its part
    assert (first_is_copy, last_is_copy) == (False, True)  # global-norm clipping counts the copy once


def test_evaluate_runs_forwards_only_and_gives_the_full_batch_loss():
    batch = get_batch(TOKENS, 0, B, 8, seed=3)

    def rank(world):
        mesh = DeviceMesh(world, pp=2)
        stage = PipelineStage(GPT(config(4), seed=1, dtype="float64"), mesh.pp_rank, 2, 2)
        engine = PipelineEngine(stage, mesh, "interleaved", 4, 2)
        loss = engine.evaluate(split_micro_batches(batch, 4))
        return loss, [p.grad for p in stage.parameters()]

    model = GPT(config(4), seed=1, dtype="float64")
    expected = model(*inputs_and_targets(batch))[1].item()
    for loss, grads in minidist.run_local(rank, 2):
        assert loss == pytest.approx(expected, rel=1e-12)
        assert all(g is None for g in grads)


# ---- stages ----------------------------------------------------------------------------------------

def test_partition_balances_cost_not_count():
    assert partition_layers([1.0] * 8, 4) == [2, 2, 2, 2]
    assert partition_layers([1.0] * 8, 3, last_extra=5.0) == [3, 4, 1]  # the head is worth 5 blocks
    embed, blocks, head = estimate_layer_costs(config(8))  # C = 16, V = 256: the head costs > a block
    assert head > blocks[0]
    assert partition_layers(blocks, 2, embed, head) == [5, 3]
    with pytest.raises(ValueError, match="at least one of 2 blocks"):
        partition_layers([1.0, 1.0], 4)


def test_a_stage_keeps_only_its_own_layers_under_their_gpt_names():
    model = GPT(config(4), seed=1)
    first = PipelineStage(model, 0, 2, 2, layers_per_stage=[1, 1, 1, 1])  # stages 0 and 2
    last = PipelineStage(model, 1, 2, 2, layers_per_stage=[1, 1, 1, 1])  # stages 1 and 3
    assert first.layers == [range(0, 1), range(2, 3)] and last.layers == [range(1, 2), range(3, 4)]
    first_names = {name.split(".")[1] if name.startswith("transformer.h") else name
                   for name, _ in first.named_parameters()}
    assert {n for n in first_names if n.startswith("transformer")} == {"transformer.wte.weight",
                                                                        "transformer.wpe.weight"}
    assert "lm_head.weight" in dict(last.named_parameters())
    assert {n.split(".")[2] for n, _ in last.named_parameters() if n.startswith("transformer.h")} == {"1", "3"}
    with pytest.raises(ValueError, match="at least one block, 4 in all"):
        PipelineStage(model, 0, 2, layers_per_stage=[4, 0])


# ---- the bubble, measured --------------------------------------------------------------------------

def sleepy_gpt(n_layer, seconds):
    """A balanced model whose blocks sleep (T_F = T_B = T_W = ``seconds``): threads measure the
    schedule, not the machine (minidist/parallel/pipeline/known_costs.py)."""
    return sleeping_gpt(config(n_layer), seconds, seed=1)


def as_scheduled(executed, ideal):
    """What differs, exactly, between an executed timeline and the simulator's: each rank's compute
    actions in the order they started, and any F (B, W) that started before the F of the stage
    before it (the B of the stage after it, the B of its own stage) had ended, on the shared clock.
    Empty: the engine ran the schedule, in order and with every dependency kept. (How long each
    action took, and so the measured bubble, is a measurement: benchmarks, not tests.)"""
    def order(spans):
        return [s.action for s in sorted(spans, key=lambda s: s.start)]

    problems = [f"rank {r} ran {order(e)}, scheduled {order(i)}"
                for r, (e, i) in enumerate(zip(executed.spans, ideal.spans)) if order(e) != order(i)]
    ends = {s.action: s.end for spans in executed.spans for s in spans}
    for s in (s for spans in executed.spans for s in spans):
        a = s.action
        after = {"F": Action("F", a.stage - 1, a.microbatch), "B": Action("B", a.stage + 1, a.microbatch),
                 "W": Action("B", a.stage, a.microbatch)}[a.op]
        if after in ends and s.start < ends[after]:
            problems.append(f"{a} started before {after} ended")
    return problems


@pytest.mark.parametrize("schedule,p,m,v", [("gpipe", 4, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2),
                                             ("zb-h1", 4, 8, 1), ("zbv", 2, 4, 2), ("zbv", 4, 8, 2)])
def test_the_executed_timeline_is_the_simulators(schedule, p, m, v):
    def rank(world):
        mesh = DeviceMesh(world, pp=p)
        # 20 ms per stage forward (B and W as much), shared by the stage's blocks; embed and head
        # cost next to nothing
        stage = PipelineStage(sleepy_gpt(p * v, 0.02 / v), mesh.pp_rank, p, v, layers_per_stage=[1] * (p * v),
                              placement=placement_of(schedule))
        engine = PipelineEngine(stage, mesh, schedule, m, v)
        world.trace.clear()
        engine.forward_backward(split_micro_batches(get_batch(TOKENS, 0, B, 8), m))
        return compute_spans(world.trace), engine.ideal

    results = minidist.run_local(rank, p)
    executed, ideal = executed_timeline([spans for spans, _ in results]), results[0][1]
    if schedule in ("gpipe", "1f1b", "interleaved"):
        assert ideal.bubble() == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)  # the classic formula
    assert as_scheduled(executed, ideal) == []
