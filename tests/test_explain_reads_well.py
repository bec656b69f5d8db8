"""``--explain`` as a learner reads it (issue 36): never wrong, and nothing in it that is noise.

- ZeRO-3 (with offload too) shows each parameter's shard, the elements this rank keeps between uses,
  never ``(0,) whole`` (the released parameter), and one line says what ZeRO keeps; so do ZeRO-1 and 2.
- A call on a group of this rank alone names no algorithm (none ran); a pipeline's tied-embedding sum
  names its partner; a call before any compute has a heading of its own.
- The spans a pass records inside itself (an MoE layer's dispatch and combine) are not passes: their
  calls stay under the forward or backward that made them.
- Two ranks that made the same calls in another order (concurrent calls start as the threads and cores
  let them) tell the same story: a reordering is counted, not listed as differences.
"""
import contextlib
import io
import re

import minidist
from minidist.comm import Event
from minidist.data import grammar_text
from minidist.train import train
from minidist.train.config import TrainConfig
from minidist.train.explain import step_story
from minidist.train.stories import differences

TINY = dict(n_layer=2, n_head=4, n_embd=16, block_size=16, batch_size=8, steps=1, eval_every=100, eval_iters=1,
            sample_tokens=0, explain=True)


def explained(tmp_path, **layout) -> dict[int, list[str]]:
    """{rank: its block} of ``--explain`` for TINY trained one step in ``layout`` on threads."""
    data = tmp_path / "corpus.txt"
    data.write_text(grammar_text(2_000, seed=1))
    cfg = TrainConfig(**TINY, data=str(data), **layout)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        minidist.run_local(lambda group: train(cfg, progress=False, world=group), world_size=4)
    text = out.getvalue()
    parts = re.split(r"^=== rank (\d+): .*$", text, flags=re.M)[1:]
    return {int(parts[i]): parts[i + 1].strip().splitlines() for i in range(0, len(parts), 2)}


def test_zero_3_with_offload_shows_each_parameters_shard_not_whole(tmp_path):
    blocks = explained(tmp_path, dp=2, tp=2, zero=3, offload="optimizer", offload_dir=str(tmp_path / "offload"))
    rank0 = blocks[0]
    holds = [line for line in rank0 if line.startswith("holds ")]
    assert holds and not any("(0,)" in line or line.endswith(" whole") for line in holds), holds
    for line in holds:
        m = re.fullmatch(r"holds \S+ +\((\d+),\) +ZeRO-3 shard: elements (\d+)-(\d+) of \([\d, ]+\).*", line)
        assert m and int(m[3]) - int(m[2]) + 1 == int(m[1]), line
    zero = [line for line in rank0 if line.startswith("ZeRO-3: ")]
    assert zero == [next(line for line in rank0 if line.startswith("ZeRO-3: this rank keeps its shard of each unit's "
                                                                    "parameters, gradients and optimizer state, "))]
    assert "of the 5,712 elements of its 5 units (shards over dp[pp0,tp0] (2 ranks))" in zero[0]
    assert any(line.startswith("offload: its optimizer shard") for line in rank0)


def test_zero_2_says_what_it_shards_and_a_group_of_one_names_no_algorithm(tmp_path):
    blocks = explained(tmp_path, dp=2, pp=2, micro_batches=2, zero=2)
    for rank in (0, 1):  # the two pipeline stages, each a story of its own
        story = blocks[rank]
        assert sum(line.startswith("ZeRO-2: this rank keeps its shard of each unit's gradients and optimizer state")
                   and line.endswith("its parameters stay whole (below)") for line in story) == 1
        alone = [line for line in story if "this rank alone" in line]
        assert alone and all(re.fullmatch(r"  all_reduce 8 B on tp\[[^\]]+\], this rank alone \(nothing sent\) — .*",
                                          line) for line in alone), alone
        assert any(re.fullmatch(rf"  all_reduce .* on pp\[dp0,tp0\]/embedding with rank {1 - rank} \(doubling\) — "
                                r"gradient: tied embedding copies \(shards\)", line) for line in story), story
    step = [line for line in blocks[1] if not line.startswith(("groups", "reads", "ZeRO", "holds"))]
    assert step[0] == "before its first compute:" and "irecv" in step[1]  # the last stage waits for its input


def event(op, start, end, kind="collective", label="", group="ep[dp0-1]", algorithm="scattered", nbytes=8):
    return Event(op, group, algorithm, nbytes, start, end, 0, 0, kind=kind, label=label)


def test_spans_inside_a_pass_are_not_headings():
    """An MoE layer records "moe dispatch" and "moe combine" inside forward: their calls are the
    forward's, during their block; nothing reads "after moe combine"."""
    events = [event("forward", 0, 10, "compute", group="world", algorithm=""),
              event("h.0", 1, 9, "compute", group="module", algorithm="forward"),
              event("all_to_all", 1.5, 1.6, label="activation: how many token rows go to each expert"),
              event("moe dispatch", 2, 3, "compute"), event("all_to_all", 2.1, 2.9, label="activation: tokens"),
              event("moe combine", 4, 5, "compute"), event("all_to_all", 4.1, 4.9, label="activation: outputs back"),
              event("all_to_all", 6, 6.1, label="activation: how many token rows go to each expert")]
    members = {"ep[dp0-1]": [0, 1]}
    assert step_story(events, members, 0) == [
        "forward  10000.0 ms",
        "  all_to_all 8 B on ep[dp0-1] with rank 1 (scattered) — activation: how many token rows go to each expert "
        "[during h.0]",
        "  all_to_all 8 B on ep[dp0-1] with rank 1 (scattered) — activation: tokens [during h.0]",
        "  all_to_all 8 B on ep[dp0-1] with rank 1 (scattered) — activation: outputs back [during h.0]",
        "  all_to_all 8 B on ep[dp0-1] with rank 1 (scattered) — activation: how many token rows go to each expert "
        "[during h.0]"]


def test_repeated_calls_during_one_module_name_it_once():
    label = "activation: ring attention dK/dV sums"
    events = [event("backward", 0, 10, "compute", group="world", algorithm=""),
              event("h.1", 1, 4, "compute", group="module", algorithm="backward"),
              event("sendrecv", 2, 2.1, label=label, algorithm="ring"),
              event("sendrecv", 3, 3.1, label=label, algorithm="ring"),
              event("h.0", 5, 9, "compute", group="module", algorithm="backward"),
              event("sendrecv", 6, 6.1, label=label, algorithm="ring")]
    members = {"ep[dp0-1]": [0, 1]}
    assert step_story(events[:4], members, 0)[1] == f"  2 x sendrecv 8 B on ep[dp0-1] with rank 1 (ring) — {label} " \
                                                   "[during h.1]"
    assert step_story(events, members, 0)[1] == f"  3 x sendrecv 8 B on ep[dp0-1] with rank 1 (ring) — {label} " \
                                                "[during h.1 (2), h.0]"


def test_the_same_calls_in_another_order_are_not_differences():
    like = ["forward  3.1 ms", "  all_reduce 8 B on tp[dp0] with rank 1 (doubling) — a",
            "  reduce_scatter 8 B on dp[tp0] with rank 2 (halving) — b", "  all_reduce 8 B on tp[dp0] with rank 1 "
            "(doubling) — c"]
    swapped = [like[0], like[2].replace("rank 2", "rank 3"), like[1], like[3]]
    assert differences(swapped, like) == [
        "the same step as rank 0, with its own groups and partners (above); 1 of its lines in another order than on "
        "rank 0: the same calls, started in whichever order the threads and cores let them"]
    extra = swapped + ["  w"]
    told = differences(extra, like)
    assert told[1:] == ["+   w", "  (1 of its lines in another order than on rank 0: the same calls, started in "
                                "whichever order the threads and cores let them)"]
