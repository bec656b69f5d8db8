"""python -m minidist.inspect: reading a run directory, the communication table, the timeline.

The rules: a run directory holds per-rank traces (trace/rank<r>.jsonl) that read back as the same
events; a group's members are the ranks that call on
it; busbw = algbw x nccl-tests' factor of the group's size; a step's timeline is cut at the
optimizer spans and idle time is what no event covers.
"""
import json

import numpy as np
import pytest

import minidist
from minidist.comm import Event, Trace
from minidist.inspect import (busy_seconds, comm_table, load_run, model_state_bytes, step_window,
                              write_memory_report, write_trace)
from minidist.inspect.__main__ import main as inspect_main
from minidist.parallel.data_parallel import DataParallel
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.step import train_step
from minidist.train_build import build_model, build_optimizer
from minidist.train_config import TrainConfig


def event(op, group, nbytes, start, end, rank, kind="collective", seq=0, peer=None):
    return Event(op, group, "ring", nbytes, start, end, seq, rank, peer, kind)


def trace_of(rank, events):
    t = Trace(rank)
    t.events = list(events)
    return t


def two_ranks():
    """Rank 0 and 1: a forward, an all-reduce on "g", a send 0 -> 1, and an optimizer span each."""
    return [trace_of(r, [event("forward", "world", 0, 1.0, 2.0, r, "compute"),
                         event("all_reduce", "g", 4096, 2.0, 2.5, r),
                         event("send" if r == 0 else "recv", "g", 1000, 2.5, 2.75, r, "p2p", peer=1 - r),
                         event("optimizer", "world", 0, 3.0, 3.5, r, "compute")]) for r in range(2)]


def test_a_run_dir_reads_back_the_same_events_on_their_raw_clocks(tmp_path):
    for t in two_ranks():
        write_trace(tmp_path, t)
    for loaded, original in zip(load_run(tmp_path).traces, two_ranks()):
        assert loaded.events == original.events  # raw clocks kept


def test_no_trace_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="--trace"):
        load_run(tmp_path)


def test_a_groups_members_are_the_ranks_that_call_on_it(tmp_path):
    traces = [trace_of(r, [event("all_reduce", "world", 8, 0, 1, r),
                           event("all_reduce", f"tp{r // 2}", 8, 1, 2, r),
                           event("forward", "stage 0", 0, 2, 3, r, "compute")]) for r in range(4)]
    for t in traces:
        write_trace(tmp_path, t)
    assert load_run(tmp_path).group_members() == {"world": [0, 1, 2, 3], "tp0": [0, 1], "tp1": [2, 3]}


def test_bus_bandwidth_uses_nccl_tests_factors():
    n, N, seconds = 4, 10**6, 1e-3
    ops = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier"]
    traces = [trace_of(r, [event(op, "g", 0 if op == "barrier" else N, i, i + seconds, r) for i, op in enumerate(ops)])
              for r in range(n)]
    rows = {r["op"]: r for r in comm_table(traces, {"g": list(range(n))})}
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n, "broadcast": 1}
    for op, f in factor.items():
        assert rows[op]["calls"] == 1 and rows[op]["bytes"] == N
        assert rows[op]["algbw"] == pytest.approx(N / seconds)
        assert rows[op]["busbw"] == pytest.approx(f * N / seconds)
    assert rows["barrier"]["algbw"] is None and rows["barrier"]["busbw"] is None


def test_table_rows_are_per_rank_that_made_the_call():
    rows = {r["op"]: r for r in comm_table(two_ranks(), {"g": [0, 1]})}
    assert (rows["all_reduce"]["ranks"], rows["all_reduce"]["calls"], rows["all_reduce"]["bytes"]) == (2, 1, 4096)
    assert (rows["send"]["ranks"], rows["send"]["bytes"], rows["send"]["busbw"]) == (1, 1000, pytest.approx(4000))


def test_busy_time_counts_overlapping_events_once():
    events = [event("forward", "w", 0, 0.0, 2.0, 0, "compute"), event("all_reduce", "w", 8, 1.0, 3.0, 0),
              event("all_reduce", "w", 8, 5.0, 6.0, 0), event("recv", "w", 8, 9.0, 12.0, 0, "p2p")]
    assert busy_seconds(events, (0.0, 10.0)) == pytest.approx(3.0 + 1.0 + 1.0)  # the recv is cut at 10


def test_a_step_runs_from_the_previous_optimizer_span_to_its_own():
    traces = [trace_of(r, [event("forward", "w", 0, 0.0 + r, 1.0, r, "compute"),
                           event("optimizer", "w", 0, 1.0, 2.0 + r, r, "compute"),
                           event("forward", "w", 0, 2.5, 3.0, r, "compute"),
                           event("optimizer", "w", 0, 3.0, 4.0 + r, r, "compute")]) for r in range(2)]
    assert step_window(traces, 0) == (0.0, 3.0)
    assert step_window(traces, 1) == step_window(traces, -1) == (2.0, 5.0)
    with pytest.raises(ValueError, match="2 steps"):
        step_window(traces, 2)
    assert step_window([trace_of(0, [event("forward", "w", 0, 0, 1, 0, "compute")])], -1) is None


CFG = TrainConfig(dp=2, tp=2, n_layer=2, n_head=4, n_embd=32, block_size=16, batch_size=8, dtype="float64")
STEPS = 2


def train_and_write(run_dir):
    """Train STEPS steps of CFG on 4 threads, each rank writing its trace and memory into run_dir.
    Returns the gradient bytes of every rank."""
    def rank_main(world):
        mesh = DeviceMesh(world, dp=CFG.dp, tp=CFG.tp)
        model = build_model(CFG, mesh.tp_group)
        dp = DataParallel(model, mesh.dp_group)
        optimizer = build_optimizer(model, CFG)
        rng = np.random.default_rng(mesh.dp_rank)
        for _ in range(STEPS):
            train_step(model, optimizer, rng.integers(0, 256, (4, 17)), 1e-3, 1.0, dp=dp, mesh=mesh, trace=world.trace)
        write_trace(run_dir, world.trace)
        write_memory_report(run_dir, world.rank, [dict(label="after step", **model_state_bytes(model, optimizer))])
        return sum(p.grad.nbytes for p in model.parameters())
    return minidist.run_local(rank_main, 4)


def test_inspect_a_real_run(tmp_path, capsys):
    grad_bytes = train_and_write(tmp_path)
    inspect_main([str(tmp_path)])
    printed = capsys.readouterr().out
    run = load_run(tmp_path)
    members = run.group_members()
    assert members["dp[pp0,tp1]"] == [1, 3] and members["tp[dp1,pp0]"] == [2, 3]
    rows = {(r["op"], r["group"]): r for r in comm_table(run.traces, members)}
    # data parallelism all-reduces every gradient once per step, plus the loss (one float64) to average it
    assert rows["all_reduce", "dp[pp0,tp0]"]["bytes"] == STEPS * (grad_bytes[0] + 8)
    assert "dp[pp0,tp0]" in printed and "busbw" in printed
    assert "rank 3: after step" in printed  # the memory table, from memory/rank3.json
    assert run.memory[0][0]["parameters"] == grad_bytes[0]  # float64 parameters and gradients alike
    chrome = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in chrome if e["ph"] == "X"} == {0, 1, 2, 3}
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
