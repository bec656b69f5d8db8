"""A long run holds flat memory: the trace a long job uses is a ring of its newest events, and
whoever needs every event asks for it while the events happen.

The rules: ``Trace(keep=N)`` keeps the newest N events and counts every one (``recorded``); a plain
``Trace()`` keeps them all (tests, lessons, notebooks read them afterwards); ``init()`` and the
trainer keep :data:`KEEP_RECENT`. ``capture()`` and ``stream(path)`` see every event recorded while
they are open, whatever ``keep`` is. The flight recorder shows a ring's newest calls. The trainer
streams ``--trace DIR`` to disk as it runs, explains its whole first step however short the ring,
and with ``keep_history=False`` keeps only its last record while metrics.jsonl gets every step.
"""
import inspect
import json
import re

import numpy as np
import pytest

import minidist
from minidist.comm.flight_recorder import format_events
from minidist.comm.trace import KEEP_RECENT, Event, Trace
from minidist.inspect import load_run
from minidist.inspect.__main__ import main as inspect_main
from minidist.train import train
from minidist.train.build import world_of_one
from minidist.train.config import TrainConfig

TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=8, batch_size=4, eval_iters=1, sample_tokens=0)


def record(trace, n, op="all_reduce"):
    for _ in range(n):
        with trace.record(op, seq=trace.recorded):
            pass


def test_init_and_the_trainer_keep_a_ring_and_a_plain_trace_keeps_everything():
    assert inspect.signature(minidist.init).parameters["trace_keep"].default == KEEP_RECENT
    assert world_of_one().trace.keep == KEEP_RECENT  # train(cfg) without a world
    assert Trace().keep is None and minidist.run_local(lambda g: g.trace.keep, 2) == [None, None]


def test_ten_thousand_all_reduces_keep_only_the_ring_and_count_them_all():
    def rank_fn(group):
        group.trace = Trace(group.rank, keep=KEEP_RECENT)  # what init() builds
        x = np.ones(4)
        for _ in range(10_000):
            group.all_reduce(x, op="max")
        events = group.trace.events
        return len(events), group.trace.recorded, events[0].seq, events[-1].seq

    for kept, recorded, first, last in minidist.run_local(rank_fn, 2):
        assert (kept, recorded) == (KEEP_RECENT, 10_000)
        assert last - first == KEEP_RECENT - 1  # the newest calls, in order


def test_a_ring_keeps_the_newest_and_counts_every_event():
    trace = Trace(keep=3)
    record(trace, 5)
    assert [e.seq for e in trace.events] == [2, 3, 4] and trace.recorded == 5
    assert [e.seq for e in trace.last(2)] == [3, 4] and len(trace.last(10)) == 3 and trace.last(0) == []
    trace.events = [Event("x", "g", "", 0, 0.0, 1.0, i, 0) for i in range(5)]  # assigned: the newest 3 kept
    assert [e.seq for e in trace.events] == [2, 3, 4] and trace.recorded == 5
    trace.clear()
    assert list(trace.events) == [] and trace.recorded == 0
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="keep"):
            Trace(keep=bad)


def test_capture_and_stream_see_every_event_even_when_nothing_is_kept(tmp_path):
    trace = Trace(keep=0)
    with trace.capture() as captured, trace.stream(tmp_path / "t.jsonl", flush_every=3):
        record(trace, 10)
    record(trace, 2)  # after the blocks: neither sees these
    assert [e.seq for e in captured] == list(range(10)) and len(trace.events) == 0 and trace.recorded == 12
    assert Trace.load(tmp_path / "t.jsonl").events == captured


def test_a_stream_starts_with_the_events_still_kept(tmp_path):
    trace = Trace(keep=2)
    record(trace, 3)
    with trace.stream(tmp_path / "t.jsonl"):
        record(trace, 2)
    assert [e.seq for e in Trace.load(tmp_path / "t.jsonl").events] == [1, 2, 3, 4]


def test_the_flight_recorder_shows_the_newest_calls_of_a_ring():
    trace = Trace(rank=1, keep=8)
    record(trace, 100)
    lines = format_events(trace, None, last=4).splitlines()
    assert lines[0] == "flight recorder, rank 1: last 4 of 100 calls"
    assert [int(line.split()[0]) for line in lines[2:]] == [96, 97, 98, 99]


def train_on(world, cfg, keep):
    world.trace = Trace(world.rank, keep=keep)
    history = train(cfg, progress=False, world=world)[1]
    return world.trace.recorded, len(world.trace.events), history


def test_the_trainer_streams_every_event_to_its_run_dir_and_inspect_reads_it(data_dir, tmp_path, capsys):
    cfg = TrainConfig(steps=6, dp=2, data_dir=data_dir, trace=str(tmp_path), out=str(tmp_path), **TINY)
    # the stream opens at the first step with the events the ring still holds: 24 covers the 19 calls
    # made before it (3 splits, 16 parameter broadcasts); init()'s ring of KEEP_RECENT covers a real model's
    ranks = minidist.run_local(lambda world: train_on(world, cfg, keep=24), 2)
    run = load_run(tmp_path)
    for (recorded, kept, _), t in zip(ranks, run.traces):
        assert kept == 24 < recorded == len(t.events)  # the file holds every event, memory only 24
    assert [e.op for e in run.traces[0].events].count("optimizer") == 6
    inspect_main([str(tmp_path)])
    printed = capsys.readouterr().out
    assert f"2 ranks, {sum(r[0] for r in ranks):,} events" in printed and "steps 0..5" in printed
    assert "dp[pp0,tp0]" in printed and "rank 1: after last step" in printed


def test_explain_prints_the_whole_first_step_however_short_the_ring(data_dir, capsys):
    cfg = TrainConfig(steps=1, dp=2, explain=True, data_dir=data_dir, **TINY)

    def explained(keep):
        minidist.run_local(lambda world: train_on(world, cfg, keep), 2)
        out = capsys.readouterr().out
        return re.sub(r"\d+\.\d ms", "ms", out[out.index("=== rank 0"):out.index("step     1")])

    full = explained(keep=None)
    assert full.count("all_reduce") >= 4 and "the same step as rank 0" in full and explained(keep=4) == full


def test_a_long_run_can_keep_only_its_last_record(data_dir, tmp_path):
    cfg = TrainConfig(steps=5, eval_every=2, data_dir=data_dir, out=str(tmp_path), **TINY)
    def rows():
        return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]

    _, history = train(cfg, progress=False, keep_history=False)
    assert [r["step"] for r in rows()] == [0, 1, 2, 3, 4] and [("val_loss" in r) for r in rows()] == [1, 0, 1, 0, 1]
    assert history == rows()[-1:]  # what main() prints at the end
    assert train(cfg, progress=False)[1] == rows()  # the default keeps every step, as before
