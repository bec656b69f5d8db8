"""--explain: every rank's account of one step, gathered as text and printed by rank 0, rank by rank.

The rules: text crosses ranks as bytes without pickling, whatever its length (empty too) and
characters; the blocks come in rank order, one per rank; rank 0's story is told whole and every
other rank's as what differs from it; a tensor-parallel shard names its full shape; every call names
its group, the global ranks at the other end and its purpose (which block, which of the
cross-entropy's three all-reduces, which gradient bucket); activations show their shape.
"""
import io
import re

import numpy as np

import minidist
from minidist.train.explain import differences, explaining, format_stories, gather_lines
from minidist.model import GPT, GPTConfig
from minidist.optim import SGD
from minidist.parallel.data.data_parallel import DataParallel
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.pipeline import PipelineEngine, PipelineStage, split_micro_batches
from minidist.parallel.compose.step import train_step
from minidist.train.build import build_model, build_optimizer
from minidist.train.config import TrainConfig


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


def calls(lines):
    """The call lines of a story (indented under a heading)."""
    return [line.strip() for line in lines if line.startswith("  ")]


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
    rank0 = "\n".join(story[0])
    assert re.search(r"holds transformer\.h\.\{0,1\}\.attn\.c_attn\.weight +\(48, 32\) +qkv shard of \(96, 32\)", rank0)
    assert re.search(r"holds transformer\.h\.\{0,1\}\.mlp\.c_proj\.weight +\(32, 64\) +row shard of \(32, 128\)", rank0)
    assert re.search(r"holds transformer\.wte\.weight +\(128, 32\) +vocab shard of \(256, 32\)", rank0)
    # every other rank plays rank 0's part with its own groups: its groups, then "the same step"
    for r in (1, 2, 3):
        assert story[r][1:] == ["the same step as rank 0, with its own groups and partners (above)"], story[r]
    assert story[3][0] == "groups: tp[dp1,pp0] = ranks [2, 3]; dp[pp0,tp1] = ranks [1, 3]"
    # every call says why it was made
    lines = story[0]
    assert all(" — " in line and line.split(" — ")[1] for line in calls(lines)), lines
    forward = lines.index(next(line for line in lines if line.startswith("forward")))
    backward = lines.index(next(line for line in lines if line.startswith("backward")))
    act = "all_reduce 8.0 KiB (4, 16, 32) {} on tp[dp0,pp0] with rank 1 (doubling) — "
    # Megatron: the vocab-parallel embedding's all-reduce, then per block g after attn and after mlp
    assert lines[forward + 1].strip() == act.format("activation") + (
        "vocab-parallel embedding: sum of the tp ranks' vocabulary-shard lookups")
    assert lines[forward + 2].strip() == "4 x " + act.format("activation") + (
        "TP g all-reduce: sum of the row-parallel c_proj's partial outputs [h.0 attn, h.0 mlp, h.1 attn, h.1 mlp]")
    # the vocab-parallel cross-entropy's three all-reduces of (b, T) floats, each named
    ce = [line.strip() for line in lines[forward + 3:forward + 6]]
    assert ce == [f"all_reduce 256 B on tp[dp0,pp0] with rank 1 (doubling) — vocab-parallel cross-entropy {k}/3: {what}"
                  for k, what in ((1, "max logit"), (2, "sum of exp(logit - max)"), (3, "target logit"))]
    # backward: the head's f, then each block's f in reverse (mlp before attn)
    assert lines[backward + 1].strip() == act.format("gradient") + (
        "TP f all-reduce: gradient of the vocab-parallel lm_head's input")
    assert lines[backward + 2].strip().endswith("[h.1 mlp, h.1 attn, h.0 mlp, h.0 attn]")
    after = "\n".join(lines[lines.index("after backward:"):])
    assert f"all_reduce {param_bytes / 1024:.1f} KiB on dp[pp0,tp0] with rank 2 (doubling) — DP gradient bucket" in after
    assert "all_reduce 8 B on dp[pp0,tp0] with rank 2 (doubling) — loss average over dp" in after
    assert "all_reduce 8 B on tp[dp0,pp0] with rank 1 (doubling) — grad-norm² sum over tp" in after
    assert "all_reduce 8 B on pp[dp0,tp0] (this rank alone: nothing sent) (doubling) — grad-norm² sum over pp" in after


def test_other_ranks_print_what_differs_from_rank_0():
    first = ["=== rank 0: A ===", "groups: tp[dp0] = ranks [0, 1]", "forward  3.1 ms",
             "  all_reduce 8 B on tp[dp0] with rank 1 (doubling) — x", "  isend 8 B to rank 2 (pp[dp0] rank 1) — y"]
    same = ["=== rank 1: B ===", "groups: tp[dp0] = ranks [0, 1]", "forward  2.9 ms",
            "  all_reduce 8 B on tp[dp0] with rank 0 (doubling) — x", "  isend 8 B to rank 3 (pp[dp0] rank 1) — y"]
    other = ["=== rank 2: C ===", "groups: tp[dp1] = ranks [2, 3]", "forward  2.9 ms",
             "  all_reduce 8 B on tp[dp1] with rank 3 (doubling) — x", "  irecv 8 B from rank 0 (pp[dp0] rank 0) — z"]
    assert differences(same[2:], first[2:]) == ["the same step as rank 0, with its own groups and partners (above)"]
    assert differences(other[2:], first[2:])[1:] == ["~   irecv 8 B from rank 0 (pp[dp0] rank 0) — z"]
    assert differences(other[2:4], first[2:])[1:] == ["-   isend 8 B to rank 2 (pp[dp0] rank 1) — y"]
    assert differences(other[2:] + ["  w"], first[2:])[1:] == ["-   isend 8 B to rank 2 (pp[dp0] rank 1) — y",
                                                                "+   irecv 8 B from rank 0 (pp[dp0] rank 0) — z",
                                                                "+   w"]
    printed = format_stories([first, same, other]).split("\n")
    assert printed[:5] == first and printed[6:8] == same[:2] and printed[10:12] == other[:2]
    assert printed[8] == "the same step as rank 0, with its own groups and partners (above)"
    assert printed[12].startswith("as rank 0, with its own groups and partners (above), except")
    # a story less than half alike (another pipeline stage) is told whole, and later ranks compare to it
    stage = ["=== rank 3: D ===", "groups: none", "backward  1.0 ms", "  a", "  b", "  c"]
    like_stage = ["=== rank 4: E ===", "groups: none", "backward  2.0 ms", "  a", "  b", "  c"]
    printed = format_stories([first, stage, like_stage]).split("\n\n")
    assert printed[1] == "\n".join(stage)
    assert printed[2].endswith("the same step as rank 1, with its own groups and partners (above)")


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
    first, last = "\n".join(story[0]), "\n".join(story[1])  # another stage: a whole story of its own
    assert "holds transformer.wte.weight" in first and "transformer.ln_f" not in first
    assert "holds transformer.ln_f.weight" in last and "transformer.h.{1}" in last
    for lines in story.values():  # every call of either stage says why
        assert calls(lines) and all(line.split(" — ")[1] for line in calls(lines)), lines
    assert "— pipeline: micro-batch 1's activation to the next stage" in first
    assert "— pipeline: micro-batch 1's gradient from the next stage" in first
    assert "— pipeline: micro-batch 0's gradient to the previous stage" in last
    assert "— tied embedding grad sum" in first and "— tied embedding grad sum" in last
    assert "— the mean loss, from the last stage to every stage" in first
    assert re.search(r"forward micro-batch 0 of stage 0 .* ms, then:\n  isend 1.0 KiB \(2, 8, 16\) activation to rank 1 "
                     r"\(pp\[dp0,tp0\] rank 1\)", first)
    assert re.search(r"irecv 1.0 KiB \(2, 8, 16\) activation from rank 0", last)
    assert re.search(r"isend 1.0 KiB \(2, 8, 16\) gradient to rank 0", last)  # backward flows upstream
    assert re.search(r"irecv 1.0 KiB \(2, 8, 16\) gradient from rank 1", first)


def test_holdings_name_a_pipelines_tied_copy_of_the_embedding():
    from minidist.train.explain import holdings
    config = GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=8)
    for rank, placement in ((1, "loop"), (0, "v")):  # 1F1B's last stage; ZB-V's rank 0 holds both ends
        stage = PipelineStage(GPT(config, seed=1), rank, 2, 1 if placement == "loop" else 2, placement=placement)
        lines = holdings(stage, tp_size=1)
        assert any(line.startswith("holds lm_head.weight") and line.endswith("tied copy of transformer.wte.weight")
                   for line in lines), lines
