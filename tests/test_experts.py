"""Mixture of experts and expert parallelism (minidist/moe.py, minidist/parallel/expert/experts.py).

The rules, each proven here:
- the ops: grouped linear, grouped bias, take_rows, combine and softmax have the gradients of their
  definitions;
- routing: the top-k probabilities, ties to the lower expert; a capacity keeps each sequence's first
  choices before its second ones, earlier tokens first;
- the one-process MoE GPT's gradient (with its balance loss) is the derivative of cross-entropy +
  aux, by finite differences;
- expert parallelism with ep 2 and 4, alone and with tp, pp and ZeRO-1, equals one process on the
  full batch to 1e-10 in float64: the loss and every gradient (router and experts included), read as
  the step of one SGD update with learning rate 1;
- every all-to-all moves exactly the rows the routing sends (bytes = rows x C x itemsize);
- checkpoints reshard across ep sizes; the trainer refuses what it cannot run, with exit 2.
"""
import dataclasses
import re
import shutil

import numpy as np
import pytest

from minidist import run_local
from minidist.autograd import Tensor, combine, grouped_bias, grouped_linear, no_grad, softmax, take_rows
from minidist.checkpoint import step_dir
from minidist.inspect.tables import format_expert_load
from minidist.model import GPT, GPTConfig
from minidist.moe import capacity, capacity_keep, route
from minidist.parallel.expert.experts import expert_parallel, moe_layers, regroup_by_expert
from minidist.parallel.mesh import DeviceMesh
from minidist.train import main, train
from minidist.train.config import ConfigError, TrainConfig, check_config

MOE = dict(n_layer=2, n_head=4, n_embd=16, block_size=16, batch_size=8, n_experts=4, top_k=2, dtype="float64",
           eval_every=100, eval_iters=1, sample_tokens=0)
ONE_SGD_STEP = dict(steps=1, warmup=0, lr=1.0, min_lr=0.0, optimizer="sgd", momentum=0.0, weight_decay=0.0,
                    grad_clip=0.0, bucket_mb=0.01)


def numeric_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + eps
        a = f()
        x[i] = old - eps
        b = f()
        x[i] = old
        g[i] = (a - b) / (2 * eps)
    return g


def test_grouped_linear_combine_and_softmax_have_the_gradients_of_their_definitions():
    rng = np.random.default_rng(0)
    x, w, b = rng.normal(size=(7, 3)), rng.normal(size=(3, 4, 3)), rng.normal(size=(3, 4))
    counts = [2, 0, 5]  # an expert with no tokens
    y = rng.normal(size=(5, 4))
    weights, slot = rng.random((3, 2)), np.array([[0, 3], [1, -1], [4, 2]])  # one dropped choice
    up = rng.normal(size=(7, 4))

    def loss_grouped():
        with no_grad():
            return float((grouped_linear(Tensor(x), Tensor(w), Tensor(b), counts).data * up).sum())
    tx, tw, tb = (Tensor(a, requires_grad=True) for a in (x, w, b))
    (grouped_linear(tx, tw, tb, counts) * Tensor(up)).sum().backward()
    expected = np.concatenate([x[:2] @ w[0].T + b[0], x[2:] @ w[2].T + b[2]])
    assert np.allclose(grouped_linear(Tensor(x), Tensor(w), Tensor(b), counts).data, expected, rtol=1e-14)
    for t, a in ((tx, x), (tw, w), (tb, b)):
        assert np.allclose(t.grad, numeric_grad(loss_grouped, a), rtol=1e-6, atol=1e-8)
    assert not tw.grad[1].any()  # no tokens, no gradient

    up = rng.normal(size=(3, 4))
    ty, tweights = Tensor(y, requires_grad=True), Tensor(weights, requires_grad=True)
    out = combine(ty, tweights, slot)
    assert np.allclose(out.data, [weights[0, 0] * y[0] + weights[0, 1] * y[3], weights[1, 0] * y[1],
                                  weights[2, 0] * y[4] + weights[2, 1] * y[2]], rtol=1e-14)
    (out * Tensor(up)).sum().backward()

    def loss_combine():
        with no_grad():
            return float((combine(Tensor(y), Tensor(weights), slot).data * up).sum())
    for t, a in ((ty, y), (tweights, weights)):
        assert np.allclose(t.grad, numeric_grad(loss_combine, a), rtol=1e-6, atol=1e-8)
    nothing = combine(Tensor(np.zeros((0, 4)), requires_grad=True), tweights, np.full((3, 2), -1))
    assert not nothing.data.any()  # every choice dropped (a cp rank whose tokens came after the capacity)

    # take_rows: the dispatch's gather (each of 3 rows twice over, 4 of the 6 slots kept) and a permutation
    x, slots, up = rng.normal(size=(3, 4)), np.array([5, 0, 2, 3]), rng.normal(size=(4, 4))
    tx = Tensor(x, requires_grad=True)
    (take_rows(tx, slots, 2) * Tensor(up)).sum().backward()
    assert np.array_equal(take_rows(Tensor(x), slots, 2).data, x[[2, 0, 1, 1]])
    assert np.allclose(tx.grad, [up[1], up[2] + up[3], up[0]], rtol=1e-15)
    tx = Tensor(x, requires_grad=True)
    (take_rows(tx, np.array([2, 0, 1])) * Tensor(up[:3])).sum().backward()
    assert np.array_equal(tx.grad, up[[1, 2, 0]])

    # grouped_bias: consecutive groups of rows, each with its expert's bias
    y, b, up = rng.normal(size=(5, 3)), rng.normal(size=(3, 3)), rng.normal(size=(5, 3))
    tb = Tensor(b, requires_grad=True)
    out = grouped_bias(Tensor(y), tb, [2, 0, 3])
    assert np.array_equal(out.data, y + b[[0, 0, 2, 2, 2]])
    (out * Tensor(up)).sum().backward()
    assert np.allclose(tb.grad, [up[:2].sum(0), np.zeros(3), up[2:].sum(0)], rtol=1e-15)

    z, up = rng.normal(size=(4, 5)), rng.normal(size=(4, 5))
    tz = Tensor(z, requires_grad=True)
    (softmax(tz) * Tensor(up)).sum().backward()

    def loss_softmax():
        with no_grad():
            return float((softmax(Tensor(z)).data * up).sum())
    assert np.allclose(tz.grad, numeric_grad(loss_softmax, z), rtol=1e-6, atol=1e-8)


def test_routing_takes_the_largest_probabilities_and_ties_go_to_the_lower_expert():
    probs = np.array([[0.1, 0.4, 0.4, 0.1], [0.7, 0.1, 0.05, 0.15]])
    assert route(probs, 2).tolist() == [[1, 2], [0, 3]]
    assert route(probs, 1).tolist() == [[1], [0]]


def test_a_capacity_keeps_first_choices_before_second_choices_and_earlier_tokens_first():
    # one sequence of 4 tokens, top-2 of 2 experts: every token wants both experts
    experts = np.array([[[0, 1], [1, 0], [0, 1], [0, 1]]])  # (B, T, k)
    assert capacity(1.0, 4, 2, 2) == 4  # ceil(c k T / E)
    keep = capacity_keep(experts, 2, 2)  # expert 0's queue: first choices t0, t2, t3, then t1's second
    assert keep[0].tolist() == [[True, True], [True, False], [True, False], [False, False]]
    # expert 1: t1's first choice, then the second choices of t0 (kept), t2, t3 (over capacity)
    assert capacity_keep(experts[:, :1], 1, 2)[0].tolist() == [[True, True]]


def test_regrouping_takes_rows_by_source_to_rows_by_expert():
    counts = np.array([[1, 2], [3, 0]])  # from rank 0: 1 row for my expert 0, 2 for expert 1; rank 1: 3, 0
    assert regroup_by_expert(counts).tolist() == [0, 3, 4, 5, 1, 2]


def test_the_moe_gradient_is_the_derivative_of_cross_entropy_plus_the_balance_loss():
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8, n_experts=4, top_k=2,
                       moe_every=2, capacity_factor=1.0, aux_loss_coef=0.1)
    model = GPT(config, seed=0, dtype="float64")
    idx = np.random.default_rng(1).integers(0, 32, (3, 9))
    layers = moe_layers(model)
    assert [type(b.mlp).__name__ for b in model.transformer.h] == ["MLP", "MoE"] and len(layers) == 1

    def objective():
        with no_grad():
            _, loss = model(idx[:, :-1], idx[:, 1:])
        return loss.item()  # no graph: no aux value either, add it below
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    aux = layers[0].aux_loss
    assert 0.1 <= aux < 0.2 and layers[0].dropped > 0  # coef * (>= 1); capacity 1.0 drops some

    def total():
        ce = objective()
        layers[0].reset_stats()
        model(idx[:, :-1], idx[:, 1:])  # with a graph: the aux value of these weights
        return ce + layers[0].aux_loss
    for name in ("transformer.h.1.mlp.router.weight", "transformer.h.1.mlp.experts.c_fc.weight",
                 "transformer.h.1.mlp.experts.c_proj.bias"):
        p = dict(model.named_parameters())[name]
        index = (slice(0, 2),) * min(p.data.ndim, 2)
        sub = p.data[index]
        numeric = np.zeros_like(sub)
        for i in np.ndindex(sub.shape):
            old = sub[i]
            sub[i] = old + 1e-6
            a = total()
            sub[i] = old - 1e-6
            b = total()
            sub[i] = old
            numeric[i] = (a - b) / 2e-6
        assert np.allclose(p.grad[index], numeric, rtol=1e-5, atol=1e-9), name


def one_step(cfg, data_dir):
    """(loss, {name: gradient}) of one SGD step with learning rate 1 on ``cfg``'s thread ranks: the
    exported weights after minus before are minus the full gradient the optimizer used."""
    n = cfg.dp * cfg.tp * cfg.pp * cfg.cp
    before = GPT(GPTConfig(vocab_size=256, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                           n_embd=cfg.n_embd, n_experts=cfg.n_experts, top_k=cfg.top_k), seed=cfg.seed,
                 dtype="float64").state_dict()
    history = run_local(lambda group: train(cfg, progress=False, world=group)[1], n)[0]
    after = dict(np.load(cfg.export))
    return history[0], {name: before[name] - after[name] for name in before}


LAYOUTS = [dict(dp=2, ep=2), dict(dp=4, ep=4), dict(dp=4, ep=2), dict(dp=2, ep=2, tp=2), dict(dp=2, ep=2, pp=2),
           dict(dp=2, ep=2, zero=1), dict(dp=4, ep=4, zero=1), dict(dp=2, ep=2, tp=2, pp=2, zero=1)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_expert_parallel_layouts_equal_one_process_in_the_loss_and_every_gradient(layout, data_dir, tmp_path):
    base = TrainConfig(**MOE, **ONE_SGD_STEP, data_dir=data_dir, micro_batches=2 if layout.get("pp") else 1)
    assert_one_step_like_one_process(base, layout, data_dir, tmp_path)


def assert_one_step_like_one_process(base, layout, data_dir, tmp_path):
    ref_row, ref = one_step(dataclasses.replace(base, export=str(tmp_path / "ref.npz")), data_dir)
    row, grads = one_step(dataclasses.replace(base, **layout, export=str(tmp_path / "ep.npz")), data_dir)
    assert abs(row["loss"] - ref_row["loss"]) <= 1e-10 * ref_row["loss"]
    assert (row["expert_load"], row["dropped"]) == (ref_row["expert_load"], ref_row["dropped"])
    for name, g in ref.items():
        assert np.abs(grads[name] - g).max() <= 1e-10 * np.abs(g).max(), name
    assert np.abs(ref["transformer.h.0.mlp.router.weight"]).max() > 0
    assert np.abs(ref["transformer.h.1.mlp.experts.c_fc.weight"]).max() > 0
    return ref_row


@pytest.mark.parametrize("layout", [dict(dp=2, ep=2, tp=2, sequence_parallel=True), dict(dp=4, ep=2, pp=2, zero=2),
                                    dict(cp=2, dp=2, ep=2), dict(cp=2, cp_algorithm="zigzag", tp=2, sequence_parallel=True)],
                         ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_a_capacity_drops_the_same_assignments_in_every_layout(layout, data_dir, tmp_path):
    """The capacity counts each sequence's own assignments, wherever the sequence and the experts
    are (under cp the ranks gather a sequence's choices first): the same assignments drop, and the
    loss and gradients equal one process's."""
    base = TrainConfig(**{**MOE, "top_k": 1}, **ONE_SGD_STEP, data_dir=data_dir, capacity_factor=1.0,
                       micro_batches=2 if layout.get("pp") else 1)
    row = assert_one_step_like_one_process(base, layout, data_dir, tmp_path)
    assert row["dropped"] > 0


def test_every_all_to_all_moves_the_rows_the_routing_sends(data_dir):
    """The routing of the full batch, computed in one process, says how many of each rank's tokens
    go to each rank's experts; the dispatch all-to-all of each rank sends exactly those rows (bytes
    = rows x C x 8) and the combine brings the same rows back; backward sends them again, reversed."""
    config = GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=4, n_embd=16, n_experts=4, top_k=2)
    ep, rows = 2, 3
    idx = np.random.default_rng(2).integers(0, 256, (ep * rows, 16))
    ref = GPT(config, seed=0, dtype="float64")
    with no_grad():
        x = ref.transformer.h[0].ln_2(ref.transformer.h[0].attn(ref.transformer.h[0].ln_1(ref.embed(idx)))
                                      + ref.embed(idx))
        probs = softmax(ref.transformer.h[0].mlp.router(x.reshape(-1, 16))).data
    chosen = route(probs, 2).reshape(ep, rows * 16 * 2)  # each rank's assignments
    expected = np.array([[np.isin(chosen[r], [2 * q, 2 * q + 1]).sum() for q in range(ep)] for r in range(ep)])

    def rank_fn(group):
        model = GPT(config, seed=0, dtype="float64")
        expert_parallel(model, group)
        with group.trace.capture() as events:
            mine = idx[group.rank * rows:(group.rank + 1) * rows]
            model(mine, mine)[1].backward()
        spans = {e.op: e for e in events if e.kind == "compute"}
        assert len(spans) == sum(e.kind == "compute" for e in events)  # one of each
        calls = [e for e in events if e.op == "all_to_all" and e.nbytes > 64]  # the rows, not the counts
        inside = {name: [e.nbytes for e in calls if spans[name].start <= e.start <= spans[name].end]
                  for name in ("moe dispatch", "moe combine", "moe dispatch backward", "moe combine backward")}
        return moe_layers(model)[0].expert_parallel.sent.sum(axis=1), inside
    for r, (sent, inside) in enumerate(run_local(rank_fn, ep)):
        assert sent.tolist() == expected[r].tolist()
        out, back = expected[r].sum() * 16 * 8, expected[:, r].sum() * 16 * 8  # my rows; the rows my experts got
        assert inside == {"moe dispatch": [out], "moe combine": [back], "moe dispatch backward": [back],
                          "moe combine backward": [out]}, inside


def test_a_checkpoint_reshards_across_expert_parallel_sizes(data_dir, tmp_path):
    """Saved by dp 2 x ep 2 under ZeRO-1 (each rank writes its experts' box), resumed by dp 4 x ep 4
    under ZeRO-3 and by one process: both continue as their uninterrupted runs."""
    first = TrainConfig(**{**MOE, "steps": 6, "warmup": 2, "lr": 1e-2, "grad_clip": 0.5, "bucket_mb": 0.01},
                        data_dir=data_dir, dp=2, ep=2, zero=1, ckpt_dir=str(tmp_path / "ckpt"), save_every=3,
                        export=str(tmp_path / "first.npz"))
    run_local(lambda group: train(first, progress=False, world=group), 2)
    shutil.rmtree(step_dir(first.ckpt_dir, 6))
    for then in (dataclasses.replace(first, dp=4, ep=4, zero=3), dataclasses.replace(first, dp=1, ep=1, zero=0)):
        then = dataclasses.replace(then, save_every=0, export=str(tmp_path / "resumed.npz"))
        n = then.dp
        rows = run_local(lambda group: train(dataclasses.replace(then, resume=True), progress=False, world=group)[1], n)[0]
        weights = dict(np.load(then.export))
        whole = dataclasses.replace(then, ckpt_dir=None, export=str(tmp_path / "whole.npz"))
        ref_rows = run_local(lambda group: train(whole, progress=False, world=group)[1], n)[0]
        reference = dict(np.load(whole.export))
        assert [r["step"] for r in rows] == [3, 4, 5]
        for row, ref in zip(rows, ref_rows[3:]):
            assert abs(row["loss"] - ref["loss"]) <= 1e-10 * ref["loss"]
            assert row["expert_load"] == ref["expert_load"]
        for name, ref in reference.items():
            assert np.abs(weights[name] - ref).max() <= 1e-10 * np.abs(ref).max(), name


def test_the_expert_load_counts_every_assignment_once_in_any_layout(data_dir, tmp_path):
    base = TrainConfig(**{**MOE, "steps": 2}, data_dir=data_dir)
    one = run_local(lambda group: train(base, progress=False, world=group)[1], 1)[0]
    split = dataclasses.replace(base, dp=2, ep=2, tp=2, micro_batches=2, recompute="full")
    many = run_local(lambda group: train(split, progress=False, world=group)[1], 4)[0]
    for a, b in zip(one, many):
        assert a["expert_load"] == b["expert_load"] and a["dropped"] == b["dropped"] == 0
        assert [sum(v) for v in a["expert_load"].values()] == [8 * 16 * 2] * 2  # every token, top-2, each block
        assert abs(a["aux_loss"] - b["aux_loss"]) <= 1e-12 and a["aux_loss"] >= 2 * 0.01  # >= coef per block
        assert a["expert_imbalance"] >= 1.0


@pytest.mark.parametrize("changes, message", [
    (dict(ep=2, dp=2), "--ep needs experts to split: add --n-experts"),
    (dict(n_experts=4, ep=2, dp=1), "--ep 2 must divide --dp 1"),
    (dict(n_experts=6, ep=4, dp=4), "--n-experts 6 is not divisible by ep 4"),
    (dict(n_experts=3, tp=2), "--n-experts 3 is not divisible by tp 2"),
    (dict(n_experts=4, top_k=5), "--top-k 5 is more than the 4 experts"),
    (dict(n_experts=4, moe_every=3), "--moe-every 3 leaves none of the 2 blocks with experts"),
    (dict(n_experts=4, export_hf="hf"), "Hugging Face's GPT-2, which has no experts"),
    (dict(n_experts=-1), "--n-experts must be >= 0"),
])
def test_what_experts_cannot_run_is_refused_before_anything_is_sent(changes, message):
    cfg = TrainConfig(**{**dict(n_layer=2, n_head=4, n_embd=16, block_size=16), **changes})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
        check_config(cfg, cfg.dp * cfg.tp * cfg.pp * cfg.cp)


def test_the_trainer_exits_with_status_2_on_a_bad_expert_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--n-experts", "4", "--ep", "2", "--steps", "1"])
    assert exit_.value.code == 2 and "--ep 2 must divide --dp 1" in capsys.readouterr().err


def test_the_ep_groups_cut_the_dp_axis():
    def rank_fn(group):
        mesh = DeviceMesh(group, dp=4, cp=2, ep=2)
        return mesh.ep_group.name, mesh.ep_group.size, mesh.expert_dp_group.name, mesh.expert_dp_group.size
    names = run_local(rank_fn, 8)
    # rank = dp * 2 + cp: the ep group of dp 0, cp 0 is ranks 0 and 2 (dp 0, 1); its expert-dp group
    # holds dp 0 and 2 with both cp ranks (4 ranks that hold experts 0-1)
    assert names[0] == ("ep[dp0-1,pp0,cp0,tp0]", 2, "edp[pp0,tp0,ep0]", 4)
    assert names[5] == ("ep[dp2-3,pp0,cp1,tp0]", 2, "edp[pp0,tp0,ep0]", 4)
    assert names[3] == ("ep[dp0-1,pp0,cp1,tp0]", 2, "edp[pp0,tp0,ep1]", 4)


def test_explain_says_which_experts_each_rank_holds_and_who_sends_which_tokens_where(data_dir, capsys):
    cfg = TrainConfig(**{**MOE, "steps": 1}, data_dir=data_dir, dp=2, ep=2, explain=True)
    run_local(lambda group: train(cfg, progress=False, world=group), 2)
    out = capsys.readouterr().out
    assert "experts: 4 per MoE block, top-2, split over ep groups of 2 dp ranks" in out
    assert "rank 1: dp 1 pp 0 tp 0  holds embeddings, blocks 0-1, ln_f, lm_head; experts 2-3 (ep 1)" in out
    assert "groups: ep[dp0-1,pp0,tp0] = ranks [0, 1]" in out
    assert "(2, 64, 16)  experts 2-3 of 4 (ep)" in out  # rank 1's c_fc: its 2 experts of (4, 64, 16)
    assert len(re.findall(r"routes transformer\.h\.[01]\.mlp: token rows \(last micro-batch\) \d+ to rank 0 "
                          r"\(experts 0-1: \d+/\d+\), \d+ to rank 1 \(experts 2-3: \d+/\d+\); its experts got", out)) == 4
    # each all-to-all with the purpose its call site gave, inside the block whose MoE sent it
    assert "— activation: tokens to their experts [during h.0]" in out, out
    assert "— activation: the tokens' gradients back from their experts [during h.0]" in out, out


def test_inspect_tables_the_load_per_rank_and_per_expert():
    metrics = [{"step": s, "expert_load": {"1": [30, 10, 20, 20]}, "expert_rows": [50, 30]} for s in range(2)]
    assert format_expert_load(metrics).split("\n") == [
        "rows each rank's experts computed per step (mean of 2 steps; max/mean 1.25):",
        "  rank 0: 50  rank 1: 30",
        "assignments per expert in step 1:",
        "  block 1:    30    10    20    20   max/mean 1.50"]
    assert format_expert_load([{"step": 0, "loss": 1.0}]) == "(not a mixture of experts)"
