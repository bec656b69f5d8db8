"""Parameter-server training, in-process (ranks as threads): the rules it must keep.

Synchronous: k servers and W workers train to the same losses and weights as one process on the
full batch, and as all-reduce data parallelism (float64 to 1e-10, float32 to 1e-5), with SGD +
momentum and AdamW, with gradient clipping active. Asynchronous: with one worker it IS synchronous;
with several, no update is staler than the bound and no worker runs more than s steps ahead of the
slowest (without the bound a fast worker does run ahead, so the check can fail). The trace shows
who waits for whom, and bad layouts fail on every rank before a message is sent.
"""
import threading
import types

import numpy as np
import pytest

import minidist
from minidist.data import get_batch, inputs_and_targets
from minidist.optim import clip_grad_norm, lr_at
from minidist.parallel.ps.param_server import check_parameter_server, staleness_bound, train_parameter_server
from minidist.train import train
from minidist.train.build import build_model, build_optimizer, load_data
from minidist.train.config import TrainConfig

STEPS = 10


def config(**overrides):
    """A tiny GPT for 10 steps; grad_clip 1.0 is active on some steps (gradient norms ~0.9-1.4)."""
    base = dict(steps=STEPS, batch_size=6, dtype="float64", optimizer="sgd", lr=0.1, warmup=2, n_layer=1,
                n_embd=16, n_head=2, block_size=16, eval_iters=1, sample_tokens=0, grad_clip=1.0)
    return TrainConfig(**{**base, **overrides})


def run_ps(cfg, world, **kwargs):
    """Train with parameter servers on ``world`` threads; returns (rank 0's history, every rank's
    final state_dict, every rank's trace)."""
    tokens = load_data(cfg)[1].train

    def rank(group):
        model = build_model(cfg)
        history = train_parameter_server(group, model, cfg, tokens, **kwargs)
        return history, model.state_dict(), group.trace

    results = minidist.run_local(rank, world)
    return results[0][0], [r[1] for r in results], [r[2] for r in results]


def run_allreduce_dp(cfg, world):
    """All-reduce data parallelism, written out: each rank takes its rows, averages every gradient
    over the ranks (group.all_reduce op "avg"), clips, steps. Returns (losses, final state_dict)."""
    tokens = load_data(cfg)[1].train

    def rank(group):
        model = build_model(cfg)
        optimizer = build_optimizer(model, cfg)
        rows = np.array_split(np.arange(cfg.batch_size), group.size)[group.rank]
        losses = []
        for step in range(cfg.steps):
            idx, targets = inputs_and_targets(get_batch(tokens, step, cfg.batch_size, cfg.block_size, cfg.seed)[rows])
            optimizer.zero_grad()
            _, loss = model(idx, targets)
            loss.backward()
            for p in model.parameters():
                group.all_reduce(p.grad, op="avg")
            clip_grad_norm(model.parameters(), cfg.grad_clip)
            optimizer.lr = lr_at(step, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr)
            optimizer.step()
            losses.append(group.all_reduce(np.array([loss.item()]), op="avg")[0])
        return losses, model.state_dict()

    return minidist.run_local(rank, world)[0]


def assert_close(actual, expected, rtol):
    """Relative error of every loss / weight array against its reference, scaled by its max."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    err = np.abs(actual - expected).max() / np.abs(expected).max()
    assert err <= rtol, f"relative error {err:.3g} > {rtol:g}"


def assert_same_weights(state, reference, rtol):
    assert state.keys() == reference.keys()
    for name in reference:
        assert_close(state[name], reference[name], rtol)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("servers, workers", [(1, 2), (2, 3), (3, 1)])
def test_sync_equals_one_process_on_the_full_batch(optimizer, servers, workers):
    cfg = config(optimizer=optimizer, lr=0.1 if optimizer == "sgd" else 3e-3)
    reference_model, reference = train(cfg, progress=False)
    history, states, _ = run_ps(cfg, servers + workers, servers=servers)
    assert [r["step"] for r in history] == list(range(STEPS))
    assert_close([r["loss"] for r in history], [r["loss"] for r in reference], 1e-10)
    assert_close([r["grad_norm"] for r in history], [r["grad_norm"] for r in reference], 1e-10)
    assert max(r["grad_norm"] for r in history) > cfg.grad_clip  # clipping was active
    for state in [states[0]] + states[servers:]:  # rank 0 gathered the shards; workers pulled them
        assert_same_weights(state, reference_model.state_dict(), 1e-10)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_sync_equals_allreduce_data_parallel(optimizer):
    cfg = config(optimizer=optimizer, lr=0.1 if optimizer == "sgd" else 3e-3, batch_size=8)
    dp_losses, dp_state = run_allreduce_dp(cfg, 4)
    history, states, _ = run_ps(cfg, 6, servers=2)
    assert_close([r["loss"] for r in history], dp_losses, 1e-10)
    assert_same_weights(states[0], dp_state, 1e-10)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_sync_float32_matches_one_process_to_1e_5(optimizer):
    """float32: losses and weights to 1e-5. SGD meets it per parameter. AdamW is held to 1e-5 of the
    model's largest weight: the attention KEY bias has a gradient that is exactly zero in exact
    arithmetic (softmax ignores a shift shared by all keys), so in float32 it is pure rounding noise
    (~1e-9), which Adam divides by its own size plus eps (1e-8) and turns into steps of ~lr/10. Any
    change of summation order (averaging workers) moves those noise-driven weights by ~1e-6."""
    cfg = config(dtype="float32", optimizer=optimizer, lr=0.1 if optimizer == "sgd" else 3e-3)
    reference_model, reference = train(cfg, progress=False)
    history, states, _ = run_ps(cfg, 4, servers=2)
    state, expected = states[0], reference_model.state_dict()
    assert state["transformer.h.0.attn.c_attn.weight"].dtype == np.float32
    assert_close([r["loss"] for r in history], [r["loss"] for r in reference], 1e-5)
    if optimizer == "sgd":
        assert_same_weights(state, expected, 1e-5)
    else:
        assert_close(np.concatenate([state[k].ravel() for k in expected]),
                     np.concatenate([expected[k].ravel() for k in expected]), 1e-5)


def test_sync_with_one_worker_and_no_clipping_is_bitwise_one_process():
    """One worker computes exactly what one process does and the servers apply the same element-wise
    update to slices of the same numbers: nothing may differ, not even in float32."""
    cfg = config(dtype="float32", optimizer="adamw", lr=3e-3, grad_clip=0.0)
    reference_model, reference = train(cfg, progress=False)
    history, states, _ = run_ps(cfg, 3, servers=2)
    assert [r["loss"] for r in history] == [r["loss"] for r in reference]
    for name, value in reference_model.state_dict().items():
        np.testing.assert_array_equal(states[0][name], value)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_async_with_one_worker_is_synchronous(optimizer):
    """One worker: every gradient is applied on the version it was computed on (staleness 0), and
    the 1/W scale is 1, so asynchronous training equals one process exactly."""
    cfg = config(optimizer=optimizer, lr=0.1 if optimizer == "sgd" else 3e-3)
    reference_model, reference = train(cfg, progress=False)
    history, states, _ = run_ps(cfg, 3, servers=2, staleness=3)
    assert [r["staleness"] for r in history] == [0] * STEPS
    assert_close([r["loss"] for r in history], [r["loss"] for r in reference], 1e-10)
    assert_same_weights(states[0], reference_model.state_dict(), 1e-10)


def steps_ahead_of_slowest(history, workers):
    """For each update in arrival order: how many steps its worker was ahead of the slowest worker
    when it started that step (its step minus the fewest steps any worker had pushed before)."""
    pushed = dict.fromkeys(workers, 0)
    ahead = []
    for r in history:
        ahead.append(r["step"] - min(pushed.values()))
        pushed[r["worker"]] += 1
    return ahead


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_async_staleness_bound_holds_with_a_straggler(staleness):
    cfg = config(steps=12)
    servers, workers = 2, 3
    ranks = range(servers, servers + workers)
    history, _, _ = run_ps(cfg, servers + workers, servers=servers, staleness=staleness, straggler=0.01)
    assert workers * cfg.steps <= len(history) < workers * (cfg.steps + 1)  # the budget, + last pushes
    assert max(steps_ahead_of_slowest(history, ranks)) <= staleness
    assert max(r["staleness"] for r in history) <= staleness_bound(workers, staleness)
    assert max(r["staleness"] for r in history) > 0  # the straggler made some updates stale
    done = [[r["step"] for r in history if r["worker"] == w] for w in ranks]
    assert all(steps == list(range(len(steps))) for steps in done)  # each worker's steps, in order
    assert max(map(len, done)) - min(map(len, done)) <= staleness + 1


def test_async_without_a_tight_bound_fast_workers_run_ahead(monkeypatch):
    """The checks above can fail: with a loose bound the fast worker leaves the straggler behind and
    does most of the updates (the throughput asynchronous training buys), on staler parameters.
    The straggler's delay is not a sleep here but a wait for the fast worker to stop, so the outcome
    is exact, whatever the machine's speed: 24 updates by the fast worker, then 1 by the straggler."""
    cfg = config(steps=12)
    stopped = threading.Event()
    monkeypatch.setattr("minidist.parallel.ps.worker.time",  # the straggler's (rank 1's) delay only
                        types.SimpleNamespace(sleep=lambda seconds: stopped.wait(timeout=60)))  # 60 s: a safety net
    tokens = load_data(cfg)[1].train

    def rank(group):
        history = train_parameter_server(group, build_model(cfg), cfg, tokens, servers=1, staleness=100,
                                         straggler=0.02)
        if group.rank == 2:  # the fast worker has been told to stop: the budget is spent
            stopped.set()
        return history

    history = minidist.run_local(rank, 3)[0]
    assert [r["worker"] for r in history] == [2] * 24 + [1]  # the budget, 2 x 12, then the straggler's last
    assert max(steps_ahead_of_slowest(history, [1, 2])) == 23 > 2
    assert history[-1]["staleness"] == 24 > staleness_bound(2, 0)  # computed on version 0, applied on 24


def test_async_training_reduces_the_loss():
    cfg = config(steps=40, optimizer="adamw", lr=3e-3)
    history, _, _ = run_ps(cfg, 3, servers=1, staleness=1)
    first, last = (np.mean([r["loss"] for r in history if r["step"] in steps]) for steps in (range(3), range(37, 40)))
    assert last < first - 0.5


def test_trace_shows_who_waits_for_whom_in_sync_mode():
    """With worker 0 (rank 1) delayed, every step the other workers' wait for parameters, and the
    server's wait for rank 1's gradient, end only after the straggler's delay has ended. Read from
    the traces' shared clock, this is cause and effect, so exact; how long each waits is a
    measurement (lesson 07 prints it), not asserted."""
    cfg = config(steps=5)
    _, _, traces = run_ps(cfg, 4, servers=1, straggler=0.05)
    server, straggler, fast = traces[0], traces[1], traces[2:]
    delays = [e.end for e in straggler.events if e.op == "straggler delay"]  # one per step
    assert len(delays) == cfg.steps
    for t in fast:
        got = [e.end for e in t.events if e.op == "wait parameters"][1:]  # the first is the initial pull
        assert len(got) == cfg.steps and all(g >= d for g, d in zip(got, delays))
    on_straggler = [e.end for e in server.events if e.op == "wait gradient" and e.peer == 1]
    assert len(on_straggler) == cfg.steps and all(g >= d for g, d in zip(on_straggler, delays))
    assert {e.op for e in straggler.events if e.kind == "compute"} == {"forward", "backward", "straggler delay"}
    assert {e.op for e in server.events if e.kind == "compute"} == {"optimizer"}


def test_trace_bytes_per_step_at_server_and_worker():
    """Per step a worker sends each server its gradient piece + loss + a 2-int64 header, and gets
    the parameter piece + a 2-int64 header back; a server moves W times that for its piece."""
    cfg = config(steps=3)
    servers, workers = 2, 3
    _, states, traces = run_ps(cfg, servers + workers, servers=servers)
    total = sum(v.size for k, v in states[0].items() if k != "lm_head.weight")  # tied to wte
    pieces = [len(c) for c in np.array_split(np.arange(total), servers)]

    def sent(trace, *, recv=False):
        ops = ("recv", "irecv") if recv else ("send", "isend")
        return sum(e.nbytes for e in trace.events if e.op in ops)

    # workers: one initial pull + per step a push and a pull
    assert sent(traces[servers]) == cfg.steps * sum(8 * (n + 1) + 16 for n in pieces)
    assert sent(traces[servers], recv=True) == (cfg.steps + 1) * sum(8 * n + 16 for n in pieces)
    for j, n in enumerate(pieces):
        gather = 8 * n if j > 0 else 0  # at the end every server sends its shard to server 0
        assert sent(traces[j]) == (cfg.steps + 1) * workers * (8 * n + 16) + gather
        assert sent(traces[j], recv=True) >= cfg.steps * workers * (8 * (n + 1) + 16)


@pytest.mark.parametrize("world, servers, staleness, straggler, batch, match", [
    (4, 0, None, 0.0, 6, "--servers"), (4, 4, None, 0.0, 6, "--servers"), (4, 1, -1, 0.0, 6, "--staleness"),
    (4, 1, None, -1.0, 6, "--straggler"), (5, 1, None, 0.0, 6, "divisible by the 4 workers")])
def test_bad_layouts_are_rejected(world, servers, staleness, straggler, batch, match):
    with pytest.raises(ValueError, match=match):
        check_parameter_server(world, servers, staleness, straggler, batch)


def test_bad_layout_fails_on_every_rank_before_any_message():
    cfg = config(batch_size=7)
    tokens = load_data(cfg)[1].train
    errors = []

    def rank(group):
        try:
            train_parameter_server(group, build_model(cfg), cfg, tokens, servers=1)
        except ValueError as e:
            errors.append(str(e))
        return [e for e in group.trace.events]

    events = minidist.run_local(rank, 3)
    assert len(errors) == 3 and all("divisible by the 2 workers" in e for e in errors)
    assert events == [[], [], []]
