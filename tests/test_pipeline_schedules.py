"""Pipeline schedules as data: what GPipe, 1F1B and interleaved 1F1B ask each rank to do, what the
dry-run simulator says about them, and how validation rejects a broken schedule by naming the action."""
import pytest

from minidist.parallel.pipeline import Action, ScheduleError, build_schedule, format_timeline, validate
from minidist.parallel.pipeline.schedules import add_communication, gpipe, interleaved_1f1b, one_f_one_b

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
