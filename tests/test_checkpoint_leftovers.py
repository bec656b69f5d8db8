"""A stop leaves no unfinished save behind, and a run cleans what a killed one left, naming it.

A save writes into a hidden folder ``.saving-<session>-<n>-step-N`` and renames it when complete
(minidist/checkpoint/writer.py). Was: a stop signal during a save left that folder (3 of 4 tries),
and it stayed until the next complete save of a later run; a run stopped before then left it for good.
"""
import json
import shutil
import signal

import numpy as np
import pytest

import minidist
from minidist.checkpoint import CheckpointError, Piece
from minidist.checkpoint.format import SaveStopped
from minidist.checkpoint.writer import CheckpointWriter
from minidist.train import train
from minidist.train.config import TrainConfig
from minidist.train.stopping import Stopped, as_stop

TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4, steps=4, eval_every=100, eval_iters=1,
            sample_tokens=0, save_every=2)


def hidden(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_run_removes_the_unfinished_save_a_killed_run_left_and_says_so(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    (ckpt / ".saving-00000000deadbeef-1-step-000002").mkdir(parents=True)  # what a SIGKILL during a save leaves
    (ckpt / ".saving-00000000deadbeef-1-step-000002" / "rank00000.safetensors").write_bytes(b"half")
    (ckpt / ".replaced-00000000deadbeef-2-step-000004").mkdir()
    train(TrainConfig(**TINY, ckpt_dir=str(ckpt), data_dir=str(tmp_path / "data")), progress=False)
    said = capsys.readouterr().out
    assert f"removed {ckpt}/.saving-00000000deadbeef-1-step-000002: a save that a stopped or killed run left " \
           "unfinished" in said
    assert f"removed {ckpt}/.replaced-00000000deadbeef-2-step-000004" in said
    assert [n for n in hidden(ckpt) if not n.endswith(".lock")] == [] and (ckpt / "step-000004").is_dir()


@pytest.mark.parametrize("async_save", [False, True])
def test_a_stop_during_a_save_leaves_no_unfinished_save(tmp_path, monkeypatch, async_save):
    """The stop arrives while rank 0 writes its files into the save folder (the signal's handler
    raises Stopped there, as it does in the trainer's waits)."""
    real = CheckpointWriter._write_rank_files

    def stopped_half_way(self, staging, rank, step, entries, rank_meta):
        real(self, staging, rank, step, entries, rank_meta)  # the folder and this rank's files are there
        raise Stopped(15)

    monkeypatch.setattr(CheckpointWriter, "_write_rank_files", stopped_half_way)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(Stopped):
        train(TrainConfig(**TINY, ckpt_dir=str(ckpt), async_save=async_save, data_dir=str(tmp_path / "data")),
              progress=False)
    assert [n for n in hidden(ckpt) if not n.endswith(".lock")] == [], hidden(ckpt)
    assert not list(ckpt.glob("step-*"))  # and nothing half-saved counts as a checkpoint


@pytest.mark.parametrize("when", ["before its files", "before its commit"])
def test_a_save_that_a_stop_on_rank_0_interrupts_stops_rank_1_with_that_signal(tmp_path, monkeypatch, when):
    """A stop signal reaches rank 0 during an asynchronous save (its handler abandons the save), and
    rank 1's save hears which signal: SaveStopped, which rank 1 then stops by as rank 0 did (train/entry.py).
    Was: rank 1 raised "rank 0 could not commit the checkpoint", a traceback and MPI_Abort, when the
    error reached it before its own signal did (1 run of the stop matrix in a suite)."""
    real = CheckpointWriter._commit

    def stopped_before_commit(self, staging, step, meta):
        self.abandon(signal.SIGINT)  # what rank 0's stop does, here between its files and its commit
        real(self, staging, step, meta)

    if when == "before its commit":
        monkeypatch.setattr(CheckpointWriter, "_commit", stopped_before_commit)

    def rank_fn(group):
        writer = CheckpointWriter(tmp_path / "ckpt", group)
        if when == "before its files" and group.rank == 0:
            writer.abandon(signal.SIGINT)
        writer.save(1, [Piece("w", np.full(3, float(group.rank)), (6,), ((3 * group.rank, 3 * group.rank + 3),))],
                    async_=True)
        with pytest.raises(CheckpointError) as failed:
            writer.wait()
        return failed.value

    rank_0, rank_1 = minidist.run_local(rank_fn, 2)
    assert not isinstance(rank_0, SaveStopped)  # its own error, which a stopping rank 0 never raises
    assert isinstance(rank_1, SaveStopped) and rank_1.signum == signal.SIGINT and "rank 0 was stopped" in str(rank_1)
    stop = as_stop(rank_1)  # how the entry point takes it
    assert isinstance(stop, Stopped) and stop.status == 128 + signal.SIGINT
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # one stop: later signals are ignored
        assert signal.getsignal(s) == signal.SIG_IGN
        signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
    assert [n for n in hidden(tmp_path / "ckpt")] == [] and not list((tmp_path / "ckpt").glob("step-*"))


def test_a_resume_keeps_the_earlier_metrics_and_drops_what_it_cannot_read(tmp_path):
    """metrics.jsonl is read again on --resume, through the bounded reader: the rows of the steps
    before the checkpoint stay, a garbled line or one cut by the crash goes (was: a traceback)."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    cfg = TrainConfig(**TINY, ckpt_dir=str(ckpt), out=str(out), data_dir=str(tmp_path / "data"))
    train(cfg, progress=False)
    rows = (out / "metrics.jsonl").read_text().splitlines()
    damaged = rows[:1] + ["\x00\xff not json", "[" * 100_000, '{"step": "1"}'] + rows[1:] + ['{"step": 3, "lo']
    (out / "metrics.jsonl").write_text("\n".join(damaged) + "\n")
    shutil.rmtree(ckpt / "step-000004")  # resume from step 2
    train(TrainConfig(**{**cfg.__dict__, "resume": True}), progress=False)
    again = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in again] == [0, 1, 2, 3]
    assert again[:2] == rows[:2] and all(json.loads(r)["loss"] == json.loads(o)["loss"] for r, o in zip(again, rows))
