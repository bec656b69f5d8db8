"""python -m minidist.inspect on what a crash, a careless copy or an attacker leaves in a run folder.

The rules: a trace whose last line a crash cut in half (the normal state of a killed ``--trace``
run), a garbled line, a line nested deeper than JSON parsers go, a line too long to hold: each is
skipped, said on stderr (naming the file), and every complete event is read and drawn (exit 0); a
file larger than its share is read from its end (the last steps). A metrics line that is not a
row is skipped the same way, and a diverged run's ``null`` loss prints. A folder that is not a run
(missing, empty, a file), a memory report that is not one, a FIFO or a device where a file goes, a
step the trace does not hold, a trace or metrics file of which no line reads (random bytes): exit 2
with one line naming the file, never a traceback, never a hang. A population-based training run's
folder lists its members, each with the command that shows it.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minidist.comm import Event, Trace
from minidist.inspect import load
from minidist.inspect.__main__ import main
from minidist.inspect.write import write_memory_report, write_trace
from tests.mpi.harness import REPO


def healthy_run(path, steps=3, ranks=2):
    """A run folder as the trainer leaves it: per rank a forward, an all-reduce and an optimizer span
    per step, a memory report, and a metrics row per step. Returns the events per rank."""
    for r in range(ranks):
        trace = Trace(r)
        for s in range(steps):
            t = 10.0 * s
            trace.events.append(Event("forward", "world", "", 0, t, t + 1, s, r, kind="compute"))
            trace.events.append(Event("all_reduce", "dp[pp0,tp0]", "ring", 4096, t + 1, t + 2, s, r,
                                      label="gradient: DDP bucket 0 average"))
            trace.events.append(Event("optimizer", "world", "", 0, t + 2, t + 3, s, r, kind="compute"))
        write_trace(path, trace)
        write_memory_report(path, r, [dict(label="after step", parameters=1024, gradients=1024, optimizer=2048)])
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in range(steps)))
    return 3 * steps


def inspect(path, capsys, *args):
    """(exit status, stdout, stderr) of ``python -m minidist.inspect path *args``, run in this process."""
    code = main([str(path), *args])
    out, err = capsys.readouterr()
    return code, out, err


def inspect_cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "minidist.inspect", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_a_trace_a_crash_cut_in_half_is_read_to_its_last_complete_event(tmp_path):
    per_rank = healthy_run(tmp_path)
    path = tmp_path / "trace" / "rank1.jsonl"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 40])  # the kill came halfway through the last line
    done = inspect_cli(tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "rank1.jsonl: skipped 1 incomplete line at the end" in done.stderr
    assert f"2 ranks, {2 * per_rank - 1} events" in done.stdout
    assert "timeline of last step" in done.stdout and (tmp_path / "timeline.png").stat().st_size > 1000


@pytest.mark.parametrize("garbage, why", [
    (b"not JSON at all\n", "Expecting value"),
    (b"\x00\xff\n", "codec can't decode"),
    (b'{"op": "all_reduce"}\n', "no field"),
    (b'{"op": "x", "group": "g", "algorithm": "", "nbytes": 8, "start": NaN, "end": 1, "seq": 0, "rank": 0}\n',
     "field 'start' holds nan"),
    (b'{"op": "x", "group": "g", "algorithm": "", "nbytes": 8, "start": 0, "end": 1, "seq": 0, "rank": 0, '
     b'"kind": "dance"}\n', "field 'kind'"),
    (b"[" * 100_000 + b"\n", "nested too deep"),
    (b'"' + b"x" * (2 << 20) + b'"\n', "longer than 1 MiB"),
])
def test_a_garbled_line_is_skipped_and_said(tmp_path, capsys, garbage, why):
    per_rank = healthy_run(tmp_path)
    path = tmp_path / "trace" / "rank0.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:4] + [garbage] + lines[4:]))
    code, out, err = inspect(tmp_path, capsys)
    assert code == 0
    assert "rank0.jsonl: skipped 1 garbled line (line 5: " in err and why in err
    assert f"{2 * per_rank} events" in out


def test_a_trace_larger_than_its_share_is_read_from_its_end(tmp_path, capsys, monkeypatch):
    healthy_run(tmp_path, steps=50)
    monkeypatch.setattr(load, "MAX_TRACE_BYTES", 2 * 4000)  # 4000 bytes per rank: the last ~15 events
    code, out, err = inspect(tmp_path, capsys)
    assert code == 0 and "rank0.jsonl: read only its last" in err and "rank1.jsonl: read only its last" in err
    run = load.load_run(tmp_path)
    last = run.traces[0].events[-1]
    assert (last.op, last.seq) == ("optimizer", 49) and 0 < len(run.traces[0].events) < 30
    assert "timeline of last step" in out


def test_a_metrics_line_that_is_not_a_row_is_skipped_and_a_null_loss_prints(tmp_path, capsys):
    healthy_run(tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": null}\nNaN garbage\n{"step": 4, "lo')  # a diverged step, junk, a cut line
    code, out, err = inspect(tmp_path, capsys)
    assert code == 0
    assert "steps 0..3: loss 5.0000 -> null" in out
    assert "metrics.jsonl: skipped 1 garbled line" in err and "metrics.jsonl: skipped 1 incomplete line" in err


@pytest.mark.parametrize("report, why", [
    ({"rank": 1}, 'no "rows"'),
    ({"rank": 1, "rows": [{"parameters": 8}]}, 'no "rows"'),
    ({"rank": 1, "rows": [{"label": "x", "parameters": "8"}]}, "not a finite number"),
    ({"rank": 1, "rows": [{"label": "x", "weights": 8}]}, "has the columns weights"),
    ("[" * 100_000, "nested too deep"),
    ("{\"rank\": 1, \"rows\": [", "not JSON"),
])
def test_a_memory_report_that_is_not_one_exits_2_naming_it(tmp_path, capsys, report, why):
    healthy_run(tmp_path)
    path = tmp_path / "memory" / "rank1.json"
    path.write_text(report if isinstance(report, str) else json.dumps(report))
    code, out, err = inspect(tmp_path, capsys)
    assert code == 2 and why in err and str(path) in err and len(err.splitlines()) == 1


def test_a_memory_report_without_rows_is_one_line_at_the_command_line(tmp_path):
    healthy_run(tmp_path)
    (tmp_path / "memory" / "rank1.json").write_text('{"rank": 1}')
    done = inspect_cli(tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("minidist.inspect: ") and "memory/rank1.json" in done.stderr


@pytest.mark.parametrize("make, why", [
    (lambda p: p.mkdir(), "holds no trace"),
    (lambda p: None, "no such folder"),
    (lambda p: p.write_text("not a folder"), "not a run folder"),
    (lambda p: (p / "trace").mkdir(parents=True), "holds no trace"),
])
def test_a_folder_that_is_not_a_run_exits_2_with_one_line(tmp_path, make, why):
    run_dir = tmp_path / "run"
    make(run_dir)
    done = inspect_cli(run_dir)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert why in done.stderr and str(run_dir) in done.stderr and len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize("newlines", [True, False], ids=["with-line-breaks", "one-line"])
def test_a_file_of_random_bytes_is_not_a_trace_exit_2_naming_it(tmp_path, newlines):
    """Was: "skipped 1 incomplete line at the end (cut when the run stopped)", 0 events, exit 0."""
    healthy_run(tmp_path)
    junk = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    junk = junk if newlines else junk.replace(b"\n", b"x")
    (tmp_path / "trace" / "rank1.jsonl").write_bytes(junk)
    done = inspect_cli(tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert f"{tmp_path / 'trace' / 'rank1.jsonl'}: not a trace: no event read (" in done.stderr, done.stderr
    (tmp_path / "metrics.jsonl").write_bytes(junk)
    (tmp_path / "trace" / "rank1.jsonl").unlink()
    done = inspect_cli(tmp_path)
    assert done.returncode == 2 and "metrics.jsonl: not a metrics file: no row read (" in done.stderr, done.stderr


def test_a_population_folder_lists_its_members_with_the_command_for_each(tmp_path):
    """Was: "holds no trace/rank<r>.jsonl and no metrics.jsonl (run the trainer with --trace DIR
    --out DIR)", exit 2, on the folder such a run had written."""
    from minidist import run_local
    from minidist.train.config import TrainConfig
    from minidist.train.pbt import train_pbt
    run = tmp_path / "pbt"
    cfg = TrainConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4, eval_iters=1, eval_every=100,
                      sample_tokens=0, warmup=1, mode="pbt", population=2, ready_every=2, steps=4,
                      lr_range=(1e-3, 1e-2), ckpt_dir=str(tmp_path / "ckpt"), out=str(run), trace=str(run),
                      data_dir=str(tmp_path / "data"))
    run_local(lambda g: train_pbt(cfg, g), 2)
    done = inspect_cli(run)
    assert done.returncode == 0 and not done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"{run}: population-based training, 2 members, each its own run"), lines
    for k in range(2):
        assert lines[1 + k].startswith(f"  member-{k}: 1 rank traced, steps 0..3: loss "), lines
        assert lines[1 + k].endswith(f"python -m minidist.inspect {run / f'member-{k}'}"), lines
    assert lines[3] == f"who copied whom at each ready point: {run / 'pbt.jsonl'}"
    done = inspect_cli(run / "member-1")  # and the command it gives shows that member's run
    assert done.returncode == 0 and "1 ranks," in done.stdout and "timeline of last step" in done.stdout, done.stderr


def test_a_fifo_where_a_trace_or_the_png_goes_is_refused_not_waited_on(tmp_path):
    healthy_run(tmp_path)
    fifo = tmp_path / "trace" / "rank1.jsonl"
    fifo.unlink()
    os.mkfifo(fifo)
    done = inspect_cli(tmp_path, timeout=60)
    assert done.returncode == 2 and "rank1.jsonl is a FIFO" in done.stderr
    fifo.unlink()
    healthy_run(tmp_path)
    os.mkfifo(tmp_path / "out.png")
    done = inspect_cli(tmp_path, "--png", tmp_path / "out.png", timeout=60)
    assert done.returncode == 2 and "out.png is a FIFO" in done.stderr and "Traceback" not in done.stderr


def test_a_step_the_trace_does_not_hold_exits_2(tmp_path, capsys):
    healthy_run(tmp_path)
    code, out, err = inspect(tmp_path, capsys, "--step", str(10**20))
    assert code == 2 and "there is no step" in err


def test_what_cannot_be_drawn_is_said_and_the_rest_printed(tmp_path, capsys):
    """Events that take no time draw no timeline; a rank whose trace is empty (it died before its
    first event) is left out of the drawing, the others are drawn."""
    trace = Trace(0)
    trace.events = [Event("all_reduce", "world", "ring", 8, 1.0, 1.0, 0, 0)]
    write_trace(tmp_path, trace)
    code, out, _ = inspect(tmp_path, capsys)
    assert code == 0 and "no timeline: the events of the whole trace take no time" in out and "all_reduce" in out
    healthy_run(tmp_path, ranks=2)
    (tmp_path / "trace" / "rank1.jsonl").write_bytes(b"")
    code, out, _ = inspect(tmp_path, capsys)
    assert code == 0 and "timeline of last step" in out
