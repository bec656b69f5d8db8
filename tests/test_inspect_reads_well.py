"""python -m minidist.inspect reads well: a timeline whose text is legible, whose legend names only
what it draws, with the passes visible under their module spans; a folder with only metrics; trace
files a fifth of their plain size that read back to the same events, even cut.

The rules: every text drawn on a colour is black or white, whichever contrasts more with it (WCAG's
ratio, at least 4.5:1); the legend lists the passes, module spans and mesh axes that occur, and no
other (no "weight" without a W pass); a module span is a thin band below its pass, never a box over
it. A folder with metrics.jsonl and no trace prints the metrics tables and the one line saying how to
record a trace, exit 0. ``Trace.stream`` (the trainer's ``--trace``) writes the compact format: under
a quarter of the plain format's bytes for the same events, read back equal (times that are not whole
nanoseconds too); a file a crash cut reads every complete event; a garbled line loses its event and
the ids it defined, and the events that use them are skipped and said, never misread; a file read
from its middle decodes from its first segment header on; plain lines still read, alone or mixed in.
"""
import json

import numpy as np
import pytest

import minidist
from minidist.comm import Event, Trace
from minidist.comm.trace_events import COMPACT_START, REPEATED, CompactWriter
from minidist.inspect import load, load_run
from minidist.inspect.__main__ import NO_TRACE
from minidist.inspect.__main__ import main as inspect_main
from minidist.inspect.colors import contrast, text_color, tint
from minidist.inspect.timeline import AXIS_COLORS, COMPUTE_COLORS, IDLE, OTHER, step_window, timeline_figure
from minidist.inspect.write import write_trace
from minidist.train import train
from minidist.train.config import TrainConfig

TINY = dict(n_layer=2, n_head=4, n_embd=16, block_size=16, batch_size=4, eval_iters=1, sample_tokens=0)


def pipeline_step(weight: bool) -> list[Trace]:
    """Two ranks of a pipeline step: forward and backward of micro-batch 0 (and its W pass if
    ``weight``) with their module spans, a tp all-reduce blocking the forward, an optimizer span."""
    traces = []
    for r in range(2):
        ev = [Event("forward", "stage 0", "", 0, 0.0, 1.0, 0, r, kind="compute", thread=1),
              Event("h.0", "module", "forward", 64, 0.0, 1.0, 0, r, kind="compute", thread=1),
              Event("all_reduce", "tp[dp0,pp0]", "ring", 64, 0.4, 0.6, 1, r, thread=1, label="activation: g"),
              Event("backward", "stage 0", "", 0, 1.0, 2.0, 0, r, kind="compute", thread=1),
              Event("h.0", "module", "backward", 64, 1.0, 2.0, 0, r, kind="compute", thread=1)]
        if weight:
            ev.append(Event("weight", "stage 0", "", 0, 2.0, 2.5, 0, r, kind="compute", thread=1))
        ev.append(Event("optimizer", "world", "", 0, 2.5, 3.0, 0, r, kind="compute", thread=1))
        t = Trace(r)
        t.events = ev
        traces.append(t)
    return traces


def legend_of(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


@pytest.mark.parametrize("weight", [False, True])
def test_the_legend_lists_only_what_the_timeline_draws(weight):
    fig = timeline_figure(pipeline_step(weight), (0.0, 3.0))
    passes = ["forward", "backward"] + ["weight"] * weight + ["optimizer"]
    assert legend_of(fig) == passes + ["forward modules", "backward modules", "tp comm"]


def test_module_spans_are_thin_bands_below_their_pass_not_boxes_over_it():
    ax = timeline_figure(pipeline_step(False), (0.0, 3.0)).axes[0]
    bars = [p for p in ax.patches if p.get_width() > 0]
    forward = [p for p in bars if p.get_facecolor()[:3] == pytest.approx(tuple(int(COMPUTE_COLORS["forward"][i:i + 2], 16)
                                                                             / 255 for i in (1, 3, 5)))]
    modules = [p for p in bars if p.get_edgecolor()[:3] == pytest.approx((0.2, 0.2, 0.2))]
    assert forward and modules
    top_of_modules = min(p.get_y() for p in modules)
    assert all(p.get_y() + p.get_height() <= top_of_modules for p in forward if p.get_y() < 1)  # rank 0's row


def test_every_text_on_a_colour_is_black_or_white_whichever_contrasts_more():
    fig = timeline_figure(pipeline_step(True), (0.0, 3.0))
    placed = [(t.get_text(), t.get_color(), t.get_gid()[3:]) for t in fig.axes[0].texts if t.get_gid()]
    assert {"F0", "B0", "h.0"} <= {s for s, _, _ in placed}
    for s, color, background in placed:
        assert color == text_color(background) and contrast(color, background) >= 4.5, (s, color, background)
    colors = list(COMPUTE_COLORS.values()) + list(AXIS_COLORS.values()) + [OTHER, IDLE]
    for c in colors + [tint(c, 0.75) for c in colors]:
        assert contrast(text_color(c), c) >= 4.5
    assert (text_color("#ffffff"), text_color("#000000"), text_color("#f0f0f0")) == ("black", "white", "black")
    assert contrast("black", "white") == pytest.approx(21)


def test_a_real_pipeline_run_draws_legibly_and_writes_a_compact_trace(data_dir, tmp_path):
    cfg = TrainConfig(steps=2, pp=2, micro_batches=2, data_dir=data_dir, trace=str(tmp_path), out=str(tmp_path),
                      **TINY)
    minidist.run_local(lambda world: train(cfg, progress=False, world=world), 2)
    assert (tmp_path / "trace" / "rank0.jsonl").read_bytes().startswith(COMPACT_START)
    traces = load_run(tmp_path).traces
    fig = timeline_figure(traces, step_window(traces, -1))
    legend = legend_of(fig)
    assert legend[:3] == ["forward", "backward", "optimizer"] and "weight" not in legend and "pp comm" in legend
    texts = [t for t in fig.axes[0].texts if t.get_gid()]  # which fit their box depends on the timing
    assert all(contrast(t.get_color(), t.get_gid()[3:]) >= 4.5 for t in texts)


def test_a_folder_with_only_metrics_prints_them_and_says_how_to_record_a_trace(tmp_path, capsys):
    rows = [{"step": s, "loss": 5.0 - 0.1 * s, "lr": 3e-4, "tokens_per_s": 12345.6, "expert_imbalance": 1.5,
             "expert_rows": [10, 12], "expert_load": {"0": [3, 5, 4, 8]}} for s in range(30)]
    rows[3]["val_loss"] = 4.9
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = inspect_main([str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    assert out.splitlines()[-1] == NO_TRACE == "no trace here: add --trace DIR to the training command"
    assert "steps 0..29: loss 5.0000 -> 2.1000" in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("step "))
    assert header.split() == ["step", "loss", "lr", "tokens_per_s", "expert_imbalance", "val_loss"]
    assert "12,346" in out and "(11 of 30 steps shown)" in out and "block 0:" in out
    assert not (tmp_path / "trace.json").exists() and not (tmp_path / "timeline.png").exists()


def recorded_run(n_steps: int = 40) -> list[Event]:
    """The events of rank 0 of two thread ranks: per step a forward span holding labelled
    all-reduces, and an optimizer span; real perf_counter times and thread idents."""
    def rank_fn(group):
        x = np.ones(64)
        for step in range(n_steps):
            with group.trace.record("forward", kind="compute", seq=step):
                for i in range(3):
                    group.all_reduce(x, label=f"activation: partial sums of block {i}")
            with group.trace.record("optimizer", kind="compute", seq=step):
                group.all_reduce(x[:1], label="metric: the loss")
        return list(group.trace.events)
    return minidist.run_local(rank_fn, 2)[0]


def sizes(tmp_path, events) -> tuple[int, int]:
    trace = Trace(0)
    trace.events = events
    trace.save(tmp_path / "plain.jsonl")
    with trace.stream(tmp_path / "compact.jsonl"):
        pass
    return (tmp_path / "plain.jsonl").stat().st_size, (tmp_path / "compact.jsonl").stat().st_size


def test_a_compact_trace_is_under_a_quarter_of_the_plain_one_and_reads_back_equal(tmp_path):
    events = recorded_run()
    events.append(Event("odd times", "g", "", 0, 1.0000000000001, 2.5e-10, 0, 0, kind="compute"))  # not whole ns
    plain, compact = sizes(tmp_path, events)
    assert 4 * compact < plain
    assert Trace.load(tmp_path / "compact.jsonl").events == Trace.load(tmp_path / "plain.jsonl").events == events
    (tmp_path / "trace").mkdir()
    (tmp_path / "compact.jsonl").rename(tmp_path / "trace" / "rank0.jsonl")
    assert load_run(tmp_path).traces[0].events == events


def compact_lines(events, segment_bytes=None) -> list[bytes]:
    writer = CompactWriter(segment_bytes)
    return "".join(writer.line(e) for e in events).encode().splitlines(keepends=True)


def test_a_cut_compact_trace_reads_every_complete_event(tmp_path):
    events = recorded_run(3)
    lines = compact_lines(events, segment_bytes=600)  # several segments: cuts land in headers too
    data = b"".join(lines)
    ends, at = [], 0  # where each event's JSON ends (without its newline)
    for line in lines:
        at += len(line)
        if not line.startswith(COMPACT_START):
            ends.append(at - 1)
    path = tmp_path / "trace" / "rank0.jsonl"
    path.parent.mkdir()
    for cut in range(0, len(data), 9):
        path.write_bytes(data[:cut])
        run = load_run(tmp_path)
        assert run.traces[0].events == events[:sum(end <= cut for end in ends)], cut
        assert all("incomplete line at the end" in note for note in run.skipped)


def test_a_garbled_line_loses_its_event_and_ids_and_nothing_is_misread(tmp_path):
    events = recorded_run(3)
    lines = compact_lines(events)
    n = next(i for i, line in enumerate(lines) if b'"metric: the loss"]' in line)  # defines that label's id
    lost = {v[1] for v in json.loads(lines[n]) if isinstance(v, list)}  # every value whose id it defines
    path = tmp_path / "trace" / "rank0.jsonl"
    path.parent.mkdir()
    path.write_bytes(b"".join(lines[:n] + [b"[garbled\n"] + lines[n + 1:]))
    run = load_run(tmp_path)
    kept = [e for i, e in enumerate(events) if i != n - 1 and not lost & {getattr(e, f) for f in REPEATED}]
    assert run.traces[0].events == kept and 0 < len(kept) < len(events) - 1
    assert any(f"garbled lines (line {n + 1}:" in note for note in run.skipped)


def test_a_compact_trace_read_from_its_middle_decodes_from_its_first_header(tmp_path, monkeypatch):
    events = recorded_run(60)
    path = tmp_path / "trace" / "rank0.jsonl"
    path.parent.mkdir()
    path.write_bytes(b"".join(compact_lines(events, segment_bytes=2000)))
    monkeypatch.setattr(load, "MAX_TRACE_BYTES", load.COMPACT_SHARE * 5000)  # the last 5000 bytes
    run = load_run(tmp_path)
    read = run.traces[0].events
    assert 0 < len(read) < len(events) and read == events[-len(read):]
    assert any("read only its last" in note for note in run.skipped) and not any("garbled" in n for n in run.skipped)


def test_plain_traces_still_read_alone_or_mixed_into_a_compact_one(tmp_path):
    events = recorded_run(2)
    write_trace(tmp_path, Trace.from_bytes(b"".join(compact_lines(events))))  # plain, as Trace.save writes
    assert not (tmp_path / "trace" / "rank0.jsonl").read_bytes().startswith(COMPACT_START)
    assert load_run(tmp_path).traces[0].events == events
    old = dict(op="send", group="g", algorithm="", nbytes=8, start=1.0, end=2.0, seq=0, rank=0, peer=1, kind="p2p")
    (tmp_path / "trace" / "rank0.jsonl").write_bytes(b"".join(compact_lines(events)) + json.dumps(old).encode() + b"\n")
    assert load_run(tmp_path).traces[0].events == events + [Event(**old)]


@pytest.mark.parametrize("garbage, why", [
    (b"[1,2,3]\n", "3 values, not the 12 fields"),
    (b"[0,1,2,8,0,1,0,0,null,3,4,99]\n", "field 'label' holds 99: not an id defined"),
    (b'[0,1,2,8,0,1,0,0,null,[3,"dance"],4,5]\n', "field 'kind' holds 'dance'"),
    (b"[0,1,2,8,NaN,1.0,0,0,null,3,4,5]\n", "field 'start' holds nan"),
    (b'{"minidist trace": "compact 9", "t0": 0}\n', "unknown format"),
])
def test_a_garbled_compact_line_is_skipped_and_said(tmp_path, garbage, why):
    events = recorded_run(2)
    lines = compact_lines(events)
    path = tmp_path / "trace" / "rank0.jsonl"
    path.parent.mkdir()
    path.write_bytes(b"".join(lines[:3] + [garbage] + lines[3:]))
    run = load_run(tmp_path)
    assert run.traces[0].events == events
    assert any("skipped 1 garbled line (line 4: " in note and why in note for note in run.skipped), run.skipped
