"""--explain: every rank's account of one step, gathered as text and printed by rank 0, rank by rank.

The rules: text crosses ranks as bytes without pickling, whatever its length (empty too) and
characters; the blocks come in rank order, one per rank; a tensor-parallel shard names its full
shape; every call names its group and the global ranks at the other end; activations show their shape.
"""
import io
import re

import numpy as np

import minidist
from minidist.explain import explaining, gather_lines
from minidist.model import GPT, GPTConfig
from minidist.optim import SGD
from minidist.parallel.data_parallel import DataParallel
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.pipeline import PipelineEngine, PipelineStage, split_micro_batches
from minidist.parallel.step import train_step
from minidist.train_build import build_model, build_optimizer
from minidist.train_config import TrainConfig


def test_lines_of_any_length_reach_rank_0():
    def rank_main(group):
        mine = [] if group.rank == 1 else [f"rank {group.rank} µs"] * (group.rank + 1) + ["", "end"]
        return gather_lines(group, mine)
    expected = [["rank 0 µs", "", "end"], [], ["rank 2 µs"] * 3 + ["", "end"]]
    assert minidist.run_local(rank_main, 3) == [expected, None, None]


def blocks(text):
    """{rank: its lines}, checking that each rank's block comes once, in rank order."""
    heads = re.findall(r"^=== rank (\d+): ", text, flags=re.M)
    assert heads == [str(r) for r in range(len(heads))]
    parts = re.split(r"^=== rank \d+: .*$", text, flags=re.M)[1:]
    return {r: part.strip().splitlines() for r, part in enumerate(parts)}


CFG = TrainConfig(dp=2, tp=2, n_layer=2, n_head=4, n_embd=32, block_size=16, batch_size=8)


def test_data_and_tensor_parallel_step():
    def rank_main(world):
        mesh = DeviceMesh(world, dp=2, tp=2)
        model = build_model(CFG, mesh.tp_group)
        dp = DataParallel(model, mesh.dp_group)
        optimizer = build_optimizer(model, CFG)
        batch = np.random.default_rng(mesh.dp_rank).integers(0, 256, (4, 17))  # (B/dp, T+1)
        out = io.StringIO()
        with explaining(mesh, model, file=out, activation_shape=(4, 16, 32), batch_shape=batch.shape):
            train_step(model, optimizer, batch, 1e-3, 1.0, dp=dp, mesh=mesh, trace=world.trace)
        return out.getvalue(), sum(p.data.nbytes for p in model.parameters())
    (text, param_bytes), *others = minidist.run_local(rank_main, 4)
    assert all(t == "" for t, _ in others)  # only rank 0 prints
    story = blocks(text)
    rank3 = "\n".join(story[3])
    assert "groups: tp[dp1,pp0] = ranks [2, 3]; dp[pp0,tp1] = ranks [1, 3]" in rank3
    assert re.search(r"holds transformer\.h\.\{0,1\}\.attn\.c_attn\.weight +\(48, 32\) +qkv shard of \(96, 32\)", rank3)
    assert re.search(r"holds transformer\.h\.\{0,1\}\.mlp\.c_proj\.weight +\(32, 64\) +row shard of \(32, 128\)", rank3)
    assert re.search(r"holds transformer\.wte\.weight +\(128, 32\) +vocab shard of \(256, 32\)", rank3)
    # Megatron: per block 2 all-reduces of activations forward (g) and 2 backward (f), plus the
    # vocab-parallel embedding's forward and the head's f backward
    act = "5 x all_reduce 8.0 KiB (4, 16, 32) {} on tp[dp1,pp0] with rank 2"
    lines = story[3]
    forward = next(i for i, line in enumerate(lines) if line.startswith("forward"))
    backward = next(i for i, line in enumerate(lines) if line.startswith("backward"))
    assert lines[forward + 1].strip().startswith(act.format("activation"))
    assert lines[backward + 1].strip().startswith(act.format("gradient"))
    after = lines.index("after backward:")
    assert lines[after + 1].strip().startswith(f"all_reduce {param_bytes / 1024:.1f} KiB on dp[pp0,tp1] with rank 1")


def test_pipeline_step_names_the_activations_sent_between_stages():
    config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8)

    def rank_main(world):
        mesh = DeviceMesh(world, pp=2)
        stage = PipelineStage(GPT(config, seed=0), mesh.pp_rank, 2)
        engine = PipelineEngine(stage, mesh, "1f1b", micro_batches=2)
        optimizer = SGD(stage.named_parameters(), lr=0.1)
        batch = np.random.default_rng(0).integers(0, 256, (4, 9))  # (B, T+1)
        out = io.StringIO()
        with explaining(mesh, stage, file=out, activation_shape=(2, 8, 16)):
            engine.forward_backward(split_micro_batches(batch, 2))
            engine.all_reduce_tied_grads()
            optimizer.step()
        return out.getvalue()
    story = blocks(minidist.run_local(rank_main, 2)[0])
    first, last = "\n".join(story[0]), "\n".join(story[1])
    assert "holds transformer.wte.weight" in first and "transformer.ln_f" not in first
    assert "holds transformer.ln_f.weight" in last and "transformer.h.{1}" in last
    assert re.search(r"forward micro-batch 0 of stage 0 .* ms, then:\n  isend 1.0 KiB \(2, 8, 16\) activation to rank 1 "
                     r"\(pp\[dp0,tp0\] rank 1\)", first)
    assert re.search(r"irecv 1.0 KiB \(2, 8, 16\) activation from rank 0", last)
    assert re.search(r"isend 1.0 KiB \(2, 8, 16\) gradient to rank 0", last)  # backward flows upstream
    assert re.search(r"irecv 1.0 KiB \(2, 8, 16\) gradient from rank 1", first)


def test_holdings_name_a_pipelines_tied_copy_of_the_embedding():
    from minidist.explain import holdings
    config = GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=8)
    for rank, placement in ((1, "loop"), (0, "v")):  # 1F1B's last stage; ZB-V's rank 0 holds both ends
        stage = PipelineStage(GPT(config, seed=1), rank, 2, 1 if placement == "loop" else 2, placement=placement)
        lines = holdings(stage, tp_size=1)
        assert any(line.startswith("holds lm_head.weight") and line.endswith("tied copy of transformer.wte.weight")
                   for line in lines), lines
