"""--explain: every rank's account of one step, gathered as text and printed by rank 0, rank by rank.

The rules: text crosses ranks as bytes without pickling, whatever its length (empty too) and
characters; the blocks come in rank order, one per rank; rank 0's story is told whole and every
other rank's as what differs from it; a tensor-parallel shard names its full shape, a ZeRO-3 shard
the elements it keeps; every call names its group, the global ranks at the other end and why it was
made: the label its call site gave, printed as given ("(unlabelled)" when it gave none), with the
module spans it was made in; nothing is guessed from sizes.
"""
import io
import re

import numpy as np

import minidist
from minidist.comm import Event
from minidist.comm.trace import PURPOSES
from minidist.train.explain import holdings, step_story
from minidist.train.stories import differences, explaining, format_stories, gather_lines
from minidist.model import GPT, GPTConfig
from minidist.optim import SGD
from minidist.parallel.data.data_parallel import DataParallel
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.pipeline import PipelineEngine, PipelineStage, split_micro_batches
from minidist.parallel.state import WholeState
from minidist.parallel.step import train_step
from minidist.train.build import build_model, build_optimizer, build_parallel
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


CALL = re.compile(r"(?:(\d+) x )?(\w+) [\d.]+ (?:B|KiB|MiB) .* — (.*?)(?: \[during ([^\]]*)\])?$")


def told(line):
    """(count, op, label, module spans) of a call line."""
    count, op, label, places = CALL.fullmatch(line).groups()
    return int(count or 1), op, label, places.split(", ") if places else []


def assert_labels_as_recorded(lines, events):
    """Every call line says its label as the trace recorded it, or "(unlabelled)" for a call
    recorded without one; a label's purpose is one of PURPOSES."""
    recorded = {e.label or "(unlabelled)" for e in events if e.kind in ("collective", "p2p")}
    for line in calls(lines):
        label = told(line)[2]
        assert label in recorded, (line, recorded)
        assert label == "(unlabelled)" or label.split(":")[0] in PURPOSES, line


def test_data_and_tensor_parallel_step():
    def rank_main(world):
        mesh = DeviceMesh(world, dp=2, tp=2)
        model = build_model(CFG, mesh.tp_group)
        dp = DataParallel(model, mesh.dp_group)
        optimizer = build_optimizer(model, CFG)
        batch = np.random.default_rng(mesh.dp_rank).integers(0, 256, (4, 17))  # (B/dp, T+1)
        out = io.StringIO()
        with world.trace.capture() as events, explaining(mesh, model, file=out, batch_shape=batch.shape):
            train_step(model, WholeState(model, optimizer, dp), batch, 1e-3, 1.0, mesh=mesh, trace=world.trace)
        return out.getvalue(), events
    (text, events), *others = minidist.run_local(rank_main, 4)
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
    lines = story[0]
    assert_labels_as_recorded(lines, events)
    forward = lines.index(next(line for line in lines if line.startswith("forward")))
    backward = lines.index(next(line for line in lines if line.startswith("backward")))
    after = lines.index("after backward:")
    tp = "all_reduce 8.0 KiB on tp[dp0,pp0] with rank 1 (doubling) — activation: "
    # Megatron: the vocab-parallel embedding's g, then per block g after attn and after mlp
    assert lines[forward + 1].strip() == tp + (
        "the vocab-parallel embedding lookup, partial sums added over tp (g) [during embedding]")
    g = [told(line) for line in calls(lines[forward + 2:backward]) if "(g)" in line]
    assert [place for _, _, _, places in g for place in places] == ["h.0", "h.0", "h.1", "h.1"]
    assert sum(count for count, *_ in g) == 4 and all(label.startswith("activation: ") for _, _, label, _ in g)
    # the vocab-parallel cross-entropy's three all-reduces of (b, T) floats, each named, in the head
    ce = calls(lines[forward + 2:backward])[-3:]
    assert ce == [f"all_reduce 256 B on tp[dp0,pp0] with rank 1 (doubling) — activation: cross-entropy {k}/3, "
                  f"each token's {what} [during head]" for k, what in ((1, "largest logit over the vocabulary shards"),
                                                                 (2, "softmax denominator summed over the vocabulary "
                                                                     "shards"),
                                                                 (3, "target logit from the rank holding it"))]
    # backward: the head's f, then each block's f in reverse (mlp before attn)
    f = [told(line) for line in calls(lines[backward + 1:after])]
    assert [place for *_, places in f for place in places] == ["head", "h.1", "h.1", "h.0", "h.0"]
    assert all(op == "all_reduce" and label.startswith("activation: ") and label.endswith("summed over tp (f)")
               for _, op, label, _ in f)
    # after backward: the gradient pipeline, none of it an activation
    assert all(told(line)[2].split(":")[0] in ("gradient", "metric", "(unlabelled)") for line in calls(lines[after:]))
    assert any(line.startswith("all_reduce 68.6 KiB on dp[pp0,tp0] with rank 2 (doubling) — gradient: ")
               for line in calls(lines[after:]))


def test_a_call_without_a_label_says_so_and_folds_by_module():
    def event(op, start, end, kind="collective", label="", group="tp[dp0]", algorithm="ring", nbytes=8):
        return Event(op, group, algorithm, nbytes, start, end, 0, 0, kind=kind, label=label)
    g = "activation: the row-parallel output, partial sums added over tp (g)"
    events = [event("forward", 0, 10, "compute", group="world", algorithm="", nbytes=0),
              event("h.0", 1, 3, "compute", group="module", algorithm="forward", nbytes=64),
              event("all_reduce", 2, 2.5, label=g), event("h.1", 3, 5, "compute", group="module",
                                                           algorithm="forward", nbytes=64),
              event("all_reduce", 4, 4.5, label=g), event("all_reduce", 11, 12, group="dp[tp0]")]
    members = {"tp[dp0]": [0, 1], "dp[tp0]": [0, 2]}
    assert step_story(events, members, 0) == [
        "forward  10000.0 ms", f"  2 x all_reduce 8 B on tp[dp0] with rank 1 (ring) — {g} [during h.0, h.1]",
        "after forward:", "  all_reduce 8 B on dp[tp0] with rank 2 (ring) — (unlabelled)"]


def test_holdings_under_zero_3_are_the_elements_each_rank_keeps(tmp_path):
    """ZeRO-3 releases every parameter between uses: what a rank holds is its shard of each unit,
    elements of some parameters; the dp ranks' shards tile every parameter once (with offload too:
    the parameter shards are in files, the elements are the same)."""
    cfg = TrainConfig(dp=2, tp=2, n_layer=2, n_head=4, n_embd=32, block_size=16, batch_size=8, zero=3,
                      offload="optimizer,params", offload_dir=str(tmp_path))

    def rank_main(world):
        mesh = DeviceMesh(world, dp=2, tp=2)
        model, state, _ = build_parallel(cfg, mesh)
        return holdings(model, 2, shards=state.shards)
    ranks = minidist.run_local(rank_main, 4)
    held = {}  # (name, full shape on this tp rank) -> element ranges of every dp rank
    for lines in ranks[0], ranks[2]:  # tp rank 0 of dp replicas 0 and 1
        for line in lines:
            m = re.fullmatch(r"holds (\S+) +\((\d+),\) +ZeRO-3 shard: elements (\d+)-(\d+) of (\([\d, ]*\)).*", line)
            assert m, line
            name, n, first, last, shape = m.groups()
            assert int(last) - int(first) + 1 == int(n)
            held.setdefault((name, shape), []).append((int(first), int(last) + 1))
    assert "holds transformer.h.{0,1}.attn.c_attn.weight" in "\n".join(ranks[0])
    assert any("qkv shard of (96, 32)" in line for line in ranks[0])
    for (name, shape), ranges in held.items():
        ranges = sorted(ranges)
        ends = [0] + [b for _, b in ranges]  # each range starts where the one before ends
        numel = np.prod([int(d) for d in re.findall(r"\d+", shape)])
        assert [a for a, _ in ranges] == ends[:-1] and ends[-1] == numel, (name, ranges)


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


def test_pipeline_step_tells_the_messages_between_stages():
    config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8)

    def rank_main(world):
        mesh = DeviceMesh(world, pp=2)
        stage = PipelineStage(GPT(config, seed=0), mesh.pp_rank, 2)
        engine = PipelineEngine(stage, mesh, "1f1b", micro_batches=2)
        optimizer = SGD(stage.named_parameters(), lr=0.1)
        batch = np.random.default_rng(0).integers(0, 256, (4, 9))  # (B, T+1)
        out = io.StringIO()
        with world.trace.capture() as events, explaining(mesh, stage, file=out):
            engine.forward_backward(split_micro_batches(batch, 2))
            engine.all_reduce_tied_grads()
            optimizer.step()
        return out.getvalue(), events
    (text, first_events), (_, last_events) = minidist.run_local(rank_main, 2)
    story = blocks(text)
    first, last = "\n".join(story[0]), "\n".join(story[1])  # another stage: a whole story of its own
    assert "holds transformer.wte.weight" in first and "transformer.ln_f" not in first
    assert "holds transformer.ln_f.weight" in last and "transformer.h.{1}" in last
    assert_labels_as_recorded(story[0], first_events)
    assert_labels_as_recorded(story[1], last_events)
    # a micro-batch's activation goes up after its forward, its gradient comes down before its backward
    assert re.search(r"forward micro-batch 0 of stage 0 .* ms, then:\n  isend 1.0 KiB to rank 1 "
                     r"\(pp\[dp0,tp0\] rank 1\) — ", first)
    assert re.search(r"irecv 1.0 KiB from rank 0 \(pp\[dp0,tp0\] rank 0\) — ", last)
    assert re.search(r"isend 1.0 KiB to rank 0 \(pp\[dp0,tp0\] rank 0\) — ", last)  # backward flows upstream
    assert re.search(r"irecv 1.0 KiB from rank 1 \(pp\[dp0,tp0\] rank 1\) — ", first)
    for story, other in (first, 1), (last, 0):  # the tied embedding's gradients, after the step's passes
        assert f"  all_reduce 16.0 KiB on pp[dp0,tp0]/embedding with rank {other} (doubling) — " in story


def test_holdings_name_a_pipelines_tied_copy_of_the_embedding():
    from minidist.train.explain import holdings
    config = GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=8)
    for rank, placement in ((1, "loop"), (0, "v")):  # 1F1B's last stage; ZB-V's rank 0 holds both ends
        stage = PipelineStage(GPT(config, seed=1), rank, 2, 1 if placement == "loop" else 2, placement=placement)
        lines = holdings(stage, tp_size=1)
        assert any(line.startswith("holds lm_head.weight") and line.endswith("tied copy of transformer.wte.weight")
                   for line in lines), lines
