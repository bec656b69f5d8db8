"""Pipeline schedules as data: what GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZB-V ask each rank to
do, what the dry-run simulator says about them, and how validation rejects a broken schedule by naming
the action."""
import pytest

from minidist.parallel.pipeline import (SCHEDULES, Action, ScheduleError, build_schedule, format_timeline,
                                        placement_of, rank_stages, validate)
from minidist.parallel.pipeline.interleaved import interleaved_1f1b
from minidist.parallel.pipeline.one_f_one_b import add_communication, one_f_one_b
from minidist.parallel.pipeline.schedules import gpipe

CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)]


def compute_only(actions):
    return [str(a) for a in actions if a.is_compute]


def test_gpipe_runs_all_forwards_then_all_backwards():
    assert compute_only(gpipe(2, 3)[1]) == ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]


def test_1f1b_warms_up_p_minus_rank_minus_1_forwards_then_alternates():
    ranks = one_f_one_b(4, 6)
    assert compute_only(ranks[0]) == ["0F0", "0F1", "0F2", "0F3", "0B0", "0F4", "0B1", "0F5", "0B2", "0B3", "0B4",
                                      "0B5"]
    assert compute_only(ranks[3]) == ["3F0", "3B0", "3F1", "3B1", "3F2", "3B2", "3F3", "3B3", "3F4", "3B4", "3F5",
                                      "3B5"]


def test_interleaved_sends_groups_of_p_micro_batches_through_each_chunk():
    # p = 2, v = 2: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    rank0 = compute_only(interleaved_1f1b(2, 4, 2)[0])
    assert rank0[:4] == ["0F0", "0F1", "2F0", "2F1"]  # warm-up 2(p-1-0) + (v-1)p = 4 forwards
    assert rank0[4:6] == ["0F2", "2B0"]  # steady state: backwards run the chunks in reverse


def test_interleaved_needs_micro_batches_a_multiple_of_p():
    with pytest.raises(ValueError, match="multiple of the pipeline size"):
        build_schedule("interleaved", 4, 6, 2)


def test_lowering_puts_receives_before_and_sends_after_compute():
    lowered = add_communication([[Action("F", 1, 0), Action("B", 1, 0)]], n_stages=3, pp_size=3)[0]
    assert [str(a) for a in lowered] == ["1RECV_F0", "1F0", "1SEND_F0", "1RECV_B0", "1B0", "1SEND_B0"]


def test_each_receive_is_posted_in_the_round_its_message_is_sent_in():
    # 1F1B, p = 2, m = 3: rank 0 sends F1 when rank 1 starts B0, so rank 1 posts that receive before
    # B0; the gradient of micro-batch 0 reaches rank 0 during F1: received right after it, with F1's send
    schedule = build_schedule("1f1b", 2, 3)
    assert " ".join(map(str, schedule[0])) == ("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 "
                                               "0RECV_B2 0B2")
    assert " ".join(map(str, schedule[1])) == ("1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1RECV_F2 1F2 "
                                               "1B2 1SEND_B2")


@pytest.mark.parametrize("name", SCHEDULES)
def test_no_schedule_deadlocks_when_each_round_is_one_batch(name):
    """validate's NCCL dry run (check_rounds: a round completes only with all of its messages, and
    messages between two ranks match in posting order) passes for every schedule and size."""
    for p in range(1, 6):
        for m in range(1, 10):
            for v in (2, 3) if name == "interleaved" else (2,) if name == "zbv" else (1,):
                for costs in ((1.0, 1.0, 1.0), (1.0, 2.0, 0.5), (2.0, 1.0, 3.0)):
                    if name == "interleaved" and m % p:
                        continue
                    validate(build_schedule(name, p, m, v, costs=costs), p, m, v, placement=placement_of(name))


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8, 12])
@pytest.mark.parametrize("name,v", CASES)
def test_simulated_bubble_is_p_minus_1_over_vm_plus_p_minus_1(name, v, p, m):
    timeline = validate(build_schedule(name, p, m, v), p, m, v)
    assert timeline.bubble() == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 2), (4, 4), (4, 8)])
def test_peak_in_flight_micro_batches_is_m_for_gpipe_and_min_p_minus_rank_m_for_1f1b(p, m):
    assert validate(build_schedule("gpipe", p, m), p, m).peak_in_flight() == [m] * p
    assert validate(build_schedule("1f1b", p, m), p, m).peak_in_flight() == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("name,v", CASES)
def test_forward_only_schedules_validate(name, v):
    validate(build_schedule(name, 2, 4, v, forward_only=True), 2, 4, v, forward_only=True)


def test_the_schedule_prints_as_a_per_rank_timeline():
    text = format_timeline(validate(build_schedule("1f1b", 2, 3), 2, 3))
    assert text.splitlines() == [
        "rank 0 | F0 F1 .  .  B0 -- F2 B1 -- .  B2 --",
        "rank 1 | .  F0 B0 -- F1 B1 -- F2 B2 -- .  .",
        "bubble: 25.0% of the step idle",  # (p-1)/(m+p-1) = 1/4
    ]


# ---- validation names the offending action ---------------------------------------------------------

def broken(edit, name="1f1b", p=2, m=3):
    """A valid schedule changed by ``edit(schedule)``, then validated."""
    schedule = build_schedule(name, p, m)
    edit(schedule)
    validate(schedule, p, m)


def swap(actions, a, b):
    i, j = actions.index(a), actions.index(b)
    actions[i], actions[j] = actions[j], actions[i]


def test_backward_before_its_forward_is_rejected():
    def edit(s):  # on the last stage, B0 needs no gradient from anyone: only F0
        swap(s[1], Action("F", 1, 0), Action("B", 1, 0))
    with pytest.raises(ScheduleError, match=r"rank 1, action #\d+ 1B0 \(backward of micro-batch 0 on stage 1\): "
                                            r"comes before 1F0"):
        broken(edit)


def test_a_missing_backward_is_rejected():
    with pytest.raises(ScheduleError, match=r"rank 0 never runs 0B2 \(backward of micro-batch 2 on stage 0\)"):
        broken(lambda s: s[0].remove(Action("B", 0, 2)))


def test_an_action_on_the_wrong_rank_is_rejected():
    with pytest.raises(ScheduleError, match=r"rank 0, action #0 1F0 .*: stage 1 lives on rank 1"):
        broken(lambda s: s[0].insert(0, Action("F", 1, 0)))


def test_a_receive_without_its_send_is_rejected():
    with pytest.raises(ScheduleError, match=r"rank 1, action #\d+ 1RECV_F2 .*: rank 0 never sends the matching "
                                            r"0SEND_F2"):
        broken(lambda s: s[0].remove(Action("SEND_F", 0, 2)))


def test_receiving_in_another_order_than_sent_is_rejected():
    def edit(s):  # stage 1 asks for micro-batch 1 first: under MPI it would get micro-batch 0's tensor
        s[1] = [Action("RECV_F", 1, 1), Action("F", 1, 1), Action("RECV_F", 1, 0), Action("F", 1, 0)] + \
               [a for a in s[1] if a.op != "F" and a.op != "RECV_F"]
    with pytest.raises(ScheduleError, match=r"rank 1, action #0 1RECV_F1 .*: rank 0 sends micro-batch 0 first"):
        broken(edit, name="gpipe", m=2)


def test_two_edges_received_in_another_order_than_sent_are_rejected_for_nccl():
    def edit(s):  # rank 1's stages 1 and 3 both receive from rank 0: NCCL matches their messages by order
        swap(s[1], Action("RECV_F", 3, 1), Action("RECV_F", 1, 2))
    with pytest.raises(ScheduleError, match=r"rank 1 receives 1RECV_F2 where rank 0 sends 2SEND_F1: messages "
                                            r"between two ranks match in posting order over NCCL"):
        schedule = build_schedule("interleaved", 2, 4, 2)
        edit(schedule)
        validate(schedule, 2, 4, 2)


def test_a_deadlock_is_found_by_the_dry_run_and_names_the_stuck_receives():
    def edit(s):  # rank 0 waits for B0's gradient before it has sent F1; rank 1 waits for F1 before B0
        s[0] = [Action("F", 0, 0), Action("SEND_F", 0, 0), Action("RECV_B", 0, 0), Action("B", 0, 0),
                Action("F", 0, 1), Action("SEND_F", 0, 1), Action("RECV_B", 0, 1), Action("B", 0, 1)]
        s[1] = [Action("RECV_F", 1, 0), Action("F", 1, 0), Action("RECV_F", 1, 1), Action("F", 1, 1),
                Action("B", 1, 0), Action("SEND_B", 1, 0), Action("B", 1, 1), Action("SEND_B", 1, 1)]
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0, action #2 0RECV_B0 .* waits for rank 1; "
                                            r"rank 1, action #2 1RECV_F1 .* waits for rank 0"):
        broken(edit, name="gpipe", m=2)


def test_unknown_schedules_and_ops_fail_clearly():
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        build_schedule("zb", 2, 4)
    with pytest.raises(ValueError, match=r"runs 1 chunk\(s\) per rank"):
        build_schedule("1f1b", 2, 4, virtual_stages=2)
    with pytest.raises(ValueError, match="unknown action op 'X'"):
        Action("X", 0, 0)


# ---- zero-bubble schedules: B and W apart, W in the bubbles ----------------------------------------------

def zb_timeline(name, p, m, costs=(1.0, 1.0, 1.0)):
    """The simulated timeline of ``name`` placed for and run with (F, B, W) = ``costs`` per stage
    (zbv: per chunk, half)."""
    v = 2 if name == "zbv" else 1
    f, b, w = (c / v for c in costs)
    return validate(build_schedule(name, p, m, v, costs=costs), p, m, v, placement=placement_of(name),
                    forward_cost=f, backward_cost=b + w, weight_cost=w)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [8, 16])
@pytest.mark.parametrize("costs", [(1, 1, 1), (1, 1.5, 0.5), (2, 2, 1)])
def test_zb_h1_reaches_the_papers_bubble_at_1f1bs_memory(p, m, costs):
    f, b, w = costs
    one_f_one_b_step = zb_timeline("1f1b", p, m, costs)
    zb = zb_timeline("zb-h1", p, m, costs)
    assert one_f_one_b_step.makespan == pytest.approx(m * (f + b + w) + (p - 1) * (f + b + w))
    assert zb.makespan == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w))  # Qi et al.'s bubble
    assert zb.makespan < one_f_one_b_step.makespan
    assert max(zb.peak_in_flight()) == max(one_f_one_b_step.peak_in_flight()) == p


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("costs", [(1, 1, 2), (1, 2, 2), (1, 1, 3)])
def test_zbv_is_placed_when_weight_gradients_cost_more_than_input_gradients(p, costs):
    """W >= B once stalled the list scheduler: every rank at its memory limit, each waiting for a
    gradient that only another rank's deferred W would make room for. A pending W now runs there; the
    schedule validates and keeps 1F1B's memory (2p chunks)."""
    zbv = zb_timeline("zbv", p, 2 * p, costs)
    assert max(zbv.peak_in_flight()) <= 2 * p


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [8, 16])
def test_zbv_starts_its_last_rank_late_and_then_never_idles(p, m):
    # per chunk F = B = W = 1/2: rank p-1 cannot start before (p-1) F; after that the V keeps every
    # rank busy, so the step is that start plus 2 m (F + B + W); the activations held are 2p chunks
    # (p stages' worth, 1F1B's peak)
    zbv, zb = zb_timeline("zbv", p, m), zb_timeline("zb-h1", p, m)
    assert zbv.makespan == pytest.approx((p - 1) * 0.5 + 2 * m * 1.5)
    assert zbv.makespan < zb.makespan
    assert max(zbv.peak_in_flight()) == 2 * p


def test_zbv_places_chunks_in_a_v_and_hands_over_at_its_bottom():
    assert [rank_stages(r, 4, 2, "v") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    rank3 = [str(a) for a in build_schedule("zbv", 4, 8, 2)[3]]
    assert "3SEND_F0" not in rank3 and "4RECV_F0" not in rank3  # stages 3 and 4 share rank 3: no message
    assert rank3.index("3F0") < rank3.index("4F0") < rank3.index("4B0") < rank3.index("3B0")


@pytest.mark.parametrize("name,p,m", [("zb-h1", 2, 3), ("zb-h1", 4, 8), ("zbv", 2, 4), ("zbv", 3, 5), ("zbv", 4, 8)])
def test_every_b_has_its_w_later_on_the_same_rank(name, p, m):
    v = 2 if name == "zbv" else 1
    for actions in build_schedule(name, p, m, v):
        for a in actions:
            if a.op == "B":
                assert actions.index(Action("W", a.stage, a.microbatch)) > actions.index(a)


def test_a_w_before_its_b_or_a_missing_w_is_rejected():
    schedule = build_schedule("zb-h1", 2, 2)
    early = [a for a in schedule[1] if a.op != "W"]
    early.insert(0, Action("W", 1, 0))
    with pytest.raises(ScheduleError, match=r"rank 1, action #0 1W0 .* comes before 1B0"):
        validate([schedule[0], early], 2, 2)
    with pytest.raises(ScheduleError, match="rank 1 never runs 1W1"):
        validate([schedule[0], [a for a in schedule[1] if a != Action("W", 1, 1)]], 2, 2)


def test_a_message_between_two_stages_of_one_rank_is_rejected():
    schedule = build_schedule("zbv", 2, 2, 2)
    schedule[1].insert(schedule[1].index(Action("F", 1, 0)) + 1, Action("SEND_F", 1, 0))
    with pytest.raises(ScheduleError, match="stage 2 is on this rank too"):
        validate(schedule, 2, 2, 2, placement="v")


def test_the_timeline_prints_w():
    text = format_timeline(zb_timeline("zb-h1", 2, 3))
    assert "W0" in text and text.splitlines()[-1].startswith("bubble:")
