"""python -m minidist.inspect: reading a run directory, the communication table, the timeline.

The rules: a run directory holds per-rank traces (trace/rank<r>.jsonl) that read back as the same
events (a trace written before calls had labels too: its calls are unlabelled); a group's members
are the ranks that call on it; the communication table has a row per op, group and label (why the
calls were made, as their call site said); busbw = algbw x nccl-tests' factor of the group's size;
the merged Chrome trace carries each call's label; a step's timeline is cut at the optimizer spans
and idle time is what no event covers.
"""
import contextlib
import json

import numpy as np
import pytest

import minidist
from minidist.comm import Event, Trace
from minidist.inspect import (busy_seconds, comm_table, format_comm_table, load_run, model_state_bytes, step_window,
                              write_memory_report, write_trace)
from minidist.inspect.tables import format_purposes
from minidist.inspect.__main__ import main as inspect_main
from minidist.parallel.data.data_parallel import DataParallel
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.state import WholeState
from minidist.parallel.step import train_step
from minidist.train.build import build_model, build_optimizer
from minidist.train.config import TrainConfig


def event(op, group, nbytes, start, end, rank, kind="collective", seq=0, peer=None, label=""):
    return Event(op, group, "ring", nbytes, start, end, seq, rank, peer, kind, label=label)


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


def test_a_trace_from_before_labels_reads_as_unlabelled_calls(tmp_path):
    path = tmp_path / "trace" / "rank0.jsonl"
    path.parent.mkdir()
    old = dict(op="all_reduce", group="g", algorithm="ring", nbytes=8, start=1.0, end=2.0, seq=1, rank=0, peer=None,
               kind="collective", thread=7)  # no "label": written before calls had one
    path.write_text(json.dumps(old) + "\n")
    run = load_run(tmp_path)
    assert run.traces[0].events[0].label == ""
    rows = comm_table(run.traces, run.group_members())
    assert rows[0]["label"] == rows[0]["purpose"] == "" and "(unlabelled)" in format_comm_table(rows)


def test_the_table_has_a_row_per_label_and_sums_bytes_per_purpose():
    labels = ["gradient: DDP bucket 0 average", "metric: mean loss over dp", "gradient: DDP bucket 0 average", ""]
    traces = [trace_of(r, [event("all_reduce", "g", 1000 if "bucket" in label else 8, i, i + 0.5, r, label=label)
                           for i, label in enumerate(labels)]) for r in range(2)]
    rows = {r["label"]: r for r in comm_table(traces, {"g": [0, 1]})}
    bucket = rows["gradient: DDP bucket 0 average"]
    assert (bucket["calls"], bucket["bytes"]) == (2, 2000)
    assert rows["metric: mean loss over dp"]["purpose"] == "metric" and rows[""]["purpose"] == ""
    printed = format_comm_table(list(rows.values()))
    assert "   gradient: DDP bucket 0 average" in printed and "   (unlabelled)" in printed
    assert format_purposes(list(rows.values())) == (  # both ranks' calls
        "gradient 3.9 KiB in 4 calls; metric 16 B in 2 calls; (unlabelled) 16 B in 2 calls")


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
            train_step(model, WholeState(model, optimizer, dp), rng.integers(0, 256, (4, 17)), 1e-3, 1.0, mesh=mesh,
                       trace=world.trace)
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
    rows = [r for r in comm_table(run.traces, members) if (r["op"], r["group"]) == ("all_reduce", "dp[pp0,tp0]")]
    # data parallelism all-reduces every gradient once per step, plus the loss (one float64) to average it
    assert sum(r["bytes"] for r in rows) == STEPS * (grad_bytes[0] + 8)
    assert sum(r["bytes"] for r in rows if r["purpose"] == "gradient") == STEPS * grad_bytes[0]
    assert "dp[pp0,tp0]" in printed and "busbw" in printed and "by purpose, all ranks together: gradient " in printed
    assert "rank 3: after step" in printed  # the memory table, from memory/rank3.json
    assert run.memory[0][0]["parameters"] == grad_bytes[0]  # float64 parameters and gradients alike
    chrome = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in chrome if e["ph"] == "X"} == {0, 1, 2, 3}
    labels = {e["args"]["label"] for e in chrome if e["ph"] == "X" and e["cat"] == "collective"}
    assert {r["label"] for r in comm_table(run.traces, members)} == labels
    assert any(label.startswith("activation: ") for label in labels)  # tensor parallelism's, in the args
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_module_spans_nest_inside_forward_and_backward_and_change_no_number():
    """With the trace on and watched (streamed or captured), every forward and backward holds one
    span per module (embedding, h.0, h.1, head), each inside its pass, backward in reverse; the
    weights are bitwise those of a step with the trace off. A trace nobody watches (the trainer's
    ring of recent events) gets none."""
    from minidist.model import GPT, GPTConfig
    from minidist.optim import SGD
    from minidist.inspect.spans import is_module_span
    config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8)
    batch = np.random.default_rng(0).integers(0, 256, (4, 9))  # (B, T+1)
    weights, traces = [], []
    for on, watched in ((False, False), (True, False), (True, True)):
        model = GPT(config, seed=0, dtype="float64")
        optimizer, trace = SGD(model.named_parameters(), lr=0.1, momentum=0.9), Trace(enabled=on)
        with trace.capture() if watched else contextlib.nullcontext():
            for _ in range(2):
                train_step(model, WholeState(model, optimizer), batch, 0.1, 1.0, trace=trace, n_micro=2)
        weights.append(model.state_dict())
        traces.append(trace)
        assert "forward" not in model.transformer.h[0].__dict__  # the wrappers are gone after the pass
    assert all(np.array_equal(weights[0][k], w[k]) for w in weights[1:] for k in weights[0])
    assert not any(is_module_span(e) for e in traces[1].events)
    events = traces[2].events
    passes = [e for e in events if e.op in ("forward", "backward")]
    assert len(passes) == 2 * 2 * 2  # 2 steps x 2 micro-batches x (forward, backward)
    for p in passes:
        inside = sorted((e for e in events if is_module_span(e) and p.start <= e.start and e.end <= p.end),
                        key=lambda e: e.start)
        order = ["embedding", "h.0", "h.1", "head"]
        assert [e.op for e in inside] == (order if p.op == "forward" else order[::-1]), p
        assert all(e.algorithm == p.op and e.nbytes > 0 for e in inside)
    assert sum(is_module_span(e) for e in events) == 4 * len(passes)


def test_the_timeline_colours_calls_by_axis_and_cuts_blocked_time_out_of_compute():
    from minidist.inspect import compute_seconds, step_title
    from minidist.inspect.timeline import AXIS_COLORS, blocked
    me, other = 1, 2  # thread idents: the compute thread, a communication thread
    forward = Event("forward", "world", "", 0, 0.0, 4.0, 0, 0, thread=me, kind="compute")
    tp = Event("all_reduce", "tp[dp0,pp0]", "ring", 8, 1.0, 2.0, 1, 0, thread=me)  # blocks the forward
    dp = Event("all_reduce", "dp[pp0,tp0]", "ring", 8, 2.5, 3.5, 1, 0, thread=other)  # overlaps it
    assert blocked([forward, tp, dp]) == [(1.0, 2.0)]
    assert compute_seconds([forward, tp, dp], (0.0, 4.0)) == pytest.approx(3.0)
    assert len({AXIS_COLORS[a] for a in ("dp", "tp", "pp", "cp", "ep")}) == 5
    assert step_title(-1) == "last step" and step_title(2) == "step 2" and step_title(-2) == "1 step before the last"


def test_inspect_titles_the_last_step_and_tables_peak_memory(tmp_path, capsys):
    from minidist.inspect import step_peak_bytes
    from minidist.inspect.timeline import step_window as window_of

    def rank_main(world):
        mesh = DeviceMesh(world, dp=CFG.dp, tp=CFG.tp)
        model = build_model(CFG, mesh.tp_group)
        dp = DataParallel(model, mesh.dp_group)
        optimizer = build_optimizer(model, CFG)
        with world.trace.capture():  # watched, as --trace's stream watches it: module spans are recorded
            for _ in range(STEPS):
                train_step(model, WholeState(model, optimizer, dp), np.random.default_rng(0).integers(0, 256, (4, 17)),
                           1e-3, 1.0, mesh=mesh, trace=world.trace)
        held = model_state_bytes(model, optimizer)
        write_trace(tmp_path, world.trace)
        write_memory_report(tmp_path, world.rank, [dict(label="after last step", **held,
                                                        peak=step_peak_bytes(world.trace, held))])
        lo, hi = window_of([world.trace], -1)
        sampled = max(e.nbytes for e in world.trace.events if e.group == "module" and lo <= e.start <= hi)
        return held, sampled
    for (held, sampled), rows in zip(minidist.run_local(rank_main, 4), load_run(tmp_path).memory.values()):
        end = held["parameters"] + held["gradients"] + held["optimizer"]
        # activations live at the end of the forward: the peak is above the end of the step
        assert rows[0]["peak"] == sampled + held["optimizer"] > end
    inspect_main([str(tmp_path), "--png", str(tmp_path / "t.png")])
    printed = capsys.readouterr().out
    assert "timeline of last step" in printed and "peak" in printed
