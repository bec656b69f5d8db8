"""Progress you can see: rank 0 shows a bar on a terminal and, anywhere else (under mpiexec, piped
into a file), a line every few seconds, at the first step and at the last, with the step, the loss,
ms/step, tokens/s and the ETA (minidist/train/progress.py). Never both.

The pace is wall time over the steps since the previous line; the tests read it from a clock they
drive, or only check that the fields are there: nothing here depends on how fast the machine is.
"""
import os
import re
import subprocess
import sys

from minidist.train import train
from minidist.train.config import TrainConfig
from minidist.train.progress import Progress, eta

LINE = re.compile(r"^(\d+)/(\d+) steps  loss (\d+\.\d{4})  (\d+\.\d) ms/step  ([\d,]+|-) tok/s  data wait \d+\.\d ms/step  ETA (\d+:\d\d(?::\d\d)?)$",
                  flags=re.M)
TINY = dict(n_layer=2, n_head=4, n_embd=16, block_size=16, batch_size=4, eval_iters=1, sample_tokens=0)


def drive(progress, losses):
    """Run ``progress`` over its steps, each ending with its loss from ``losses``."""
    for step, loss in zip(progress, losses):
        progress.update(step, loss)


def test_a_line_at_the_first_step_every_interval_and_the_last(capsys):
    clock = iter([0.0, 1.0, 2.0, 3.0, 7.0, 8.0]).__next__  # construction, then after steps 0..4
    progress = Progress(0, 5, tokens_per_step=100, every_s=5.0, terminal=False, clock=clock)
    drive(progress, [5.5, 5.0, 4.5, 4.0, 3.5])
    assert LINE.findall(capsys.readouterr().out) == [
        ("1", "5", "5.5000", "1000.0", "100", "0:04"),  # the first step: 1 s
        ("4", "5", "4.0000", "2000.0", "50", "0:02"),   # 6 s since the first line, over 3 steps
        ("5", "5", "3.5000", "1000.0", "100", "0:00"),  # the last step, always
    ]


def test_a_line_says_the_mean_wait_for_data_per_step_since_the_last_line(capsys):
    clock = iter([0.0, 1.0, 2.0, 3.0, 7.0]).__next__
    progress = Progress(0, 4, tokens_per_step=100, every_s=5.0, terminal=False, clock=clock)
    for step, wait in enumerate([0.004, 0.001, 0.002, 0.003]):
        progress.update(step, 1.0, data_wait_s=wait)
    assert re.findall(r"data wait (\d+\.\d) ms/step", capsys.readouterr().out) == ["4.0", "2.0"]


def test_interval_zero_prints_every_step_and_a_resumed_run_counts_from_its_start(capsys):
    clock = iter([10.0, 10.4, 10.8, 11.2]).__next__
    progress = Progress(7, 10, tokens_per_step=64, every_s=0, terminal=False, clock=clock)
    drive(progress, [2.0, 1.9, 1.8])
    lines = LINE.findall(capsys.readouterr().out)
    assert [(done, total) for done, total, *_ in lines] == [("8", "10"), ("9", "10"), ("10", "10")]
    assert [line[3:] for line in lines] == [("400.0", "160", "0:01"), ("400.0", "160", "0:00"), ("400.0", "160", "0:00")]


def test_on_a_terminal_the_bar_alone_and_disabled_nothing(capsys):
    for terminal, enabled in ((True, True), (False, False)):
        progress = Progress(0, 3, tokens_per_step=8, every_s=0, terminal=terminal, enabled=enabled)
        drive(progress, [1.0, 1.0, 1.0])
        progress.write("a line of its own")
        captured = capsys.readouterr()
        assert not LINE.search(captured.out), captured.out
        assert "a line of its own" in captured.out  # other lines print either way
        assert ("3/3" in captured.err) == terminal  # the bar draws on stderr


def test_eta_reads_as_a_clock():
    assert [eta(s) for s in (0, 59.4, 161, 3600, 3725)] == ["0:00", "0:59", "2:41", "1:00:00", "1:02:05"]


def test_the_trainer_prints_a_line_per_step_with_interval_zero(data_dir, capsys):
    cfg = TrainConfig(steps=3, data_dir=data_dir, **TINY)
    _, history = train(cfg, progress_every=0)  # capsys: stderr is not a terminal
    lines = LINE.findall(capsys.readouterr().out)
    assert [(done, total) for done, total, *_ in lines] == [("1", "3"), ("2", "3"), ("3", "3")]
    assert [loss for _, _, loss, *_ in lines] == [f"{r['loss']:.4f}" for r in history]


def test_a_piped_run_prints_its_first_and_last_step(data_dir):
    args = [f"--{key.replace('_', '-')}={value}" for key, value in TINY.items()]
    done = subprocess.run([sys.executable, "-m", "minidist.train", *args, "--steps", "3", "--data-dir", str(data_dir)],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    lines = LINE.findall(done.stdout)
    assert lines[0][:2] == ("1", "3") and lines[-1][:2] == ("3", "3"), done.stdout  # between them: every 5 s
    assert "it/s" not in done.stderr  # no bar: stderr is a pipe
