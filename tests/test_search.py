"""Hyper-parameter search (``--mode search``: train/search.py's loop, train/trials.py's trial).

A trial's steps are the steps of the same layout run alone with its hyper-parameters, bitwise; the
same command gives the same trials; a resumed search continues as the whole one did; ASHA stops
trials and their sub-groups take the next; a diverged trial is recorded as failed and the search
goes on; the exports hold the best trial's model; bad flags are refused before anything is sent.
"""
import dataclasses
import json

import numpy as np
import pytest

from minidist import run_local
from minidist.checkpoint.training import ResumeRefused
from minidist.train import Run, train
from minidist.train import search as search_module
from minidist.train.config import ConfigError, TrainConfig, check_config
from minidist.train.search import final_line, train_search
from tests.mpi.harness import run_mpi

SIZES = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4, eval_iters=1, eval_every=100,
             sample_tokens=0, dtype="float64", warmup=1)


def search_config(tmp_path, **changes):
    return TrainConfig(**{**SIZES, **dict(mode="search", trials=5, parallel=2, steps=9, lr_range=(1e-3, 3e-2),
                                          ckpt_dir=str(tmp_path / "ckpt"), out=str(tmp_path / "out")), **changes})


def run_search(cfg):
    """Every rank's search state of ``cfg`` on its thread ranks."""
    return run_local(lambda g: train_search(cfg, g), cfg.parallel * cfg.dp * cfg.tp * cfg.pp)


def lines(path):
    return [json.loads(line) for line in open(path)]


def first_steps(cfg, world, steps: int) -> list[dict]:
    """The records of ``cfg``'s first ``steps`` steps, run alone on ``world`` (the last evaluated)."""
    with Run(cfg, world, progress=False) as run:
        return run.advance(steps)


def without_timings(rows, *more):
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "data_wait_s", *more)} for r in rows]


@pytest.mark.parametrize("layout", [dict(), dict(dp=2, zero=2)], ids=["one", "dp2-zero2"])
def test_a_trial_is_its_layout_run_alone_with_its_hyperparameters(tmp_path, layout):
    cfg = search_config(tmp_path, trials=3, warmup_range=(0, 4), scheduler="asha", grace=3, **layout)
    states = run_search(cfg)
    assert all(s == states[0] for s in states)  # every rank holds the same state
    for trial in states[0].trials:
        alone = dataclasses.replace(cfg, mode="collective", **trial.hparams, ckpt_dir=None, out=None, warmup_range=None)
        rows = run_local(lambda g: first_steps(alone, g, trial.step), cfg.dp)[0]
        ours = lines(tmp_path / "out" / f"trial-{trial.index}" / "metrics.jsonl")
        # the same steps, bitwise; a segment's end also estimates the validation loss (a step alone does not)
        assert without_timings(ours, "val_loss") == without_timings(rows, "val_loss"), trial
        assert trial.loss == rows[-1]["val_loss"] and trial.loss == ours[-1]["val_loss"]


@pytest.mark.parametrize("sampler, scheduler", [("random", "none"), ("gp", "asha")])
def test_the_same_command_gives_the_same_trials(tmp_path, sampler, scheduler):
    cfg = search_config(tmp_path / "a", sampler=sampler, scheduler=scheduler, grace=3, trials=6,
                        weight_decay_range=(0.0, 0.2), log_scale="lr")
    first = run_search(cfg)[0]
    again = run_search(dataclasses.replace(cfg, ckpt_dir=str(tmp_path / "b" / "ckpt"), out=str(tmp_path / "b" / "out")))[0]
    assert first == again and len(first.trials) == 6
    assert lines(tmp_path / "a" / "out" / "trials.jsonl") == lines(tmp_path / "b" / "out" / "trials.jsonl")
    assert all(t.state in ("completed", "stopped early") for t in first.trials)
    assert all(1e-3 <= t.hparams["lr"] <= 3e-2 and 0 <= t.hparams["weight_decay"] <= 0.2 for t in first.trials)
    assert final_line(first).startswith(f"the best trial is {first.best().index}: val loss {first.best().loss:.4f}")
    if scheduler == "asha":  # rungs at 3 (9 is the budget): 1 in 3 goes on, at least the first
        assert any(t.state == "stopped early" and t.step == 3 for t in first.trials)
        assert first.spent < 6 * 9 and first.spent == sum(t.step for t in first.trials)
        # a stopped trial's sub-group took the next trial at once: trial 2 runs where one stopped at step 3
        stopped = min((t for t in first.trials if t.state == "stopped early"), key=lambda t: t.index)
        assert any(t.slot == stopped.slot and t.index > stopped.index for t in first.trials)


class Crash(RuntimeError):
    pass


@pytest.mark.parametrize("when", ["after the state", "before the state"])
def test_a_resumed_search_continues_as_the_whole_one(tmp_path, monkeypatch, when):
    """A crash after the third segment's agreement: with its state written, or before (its trials'
    checkpoints of that segment newer than the state: removed, the segment run again)."""
    cfg = search_config(tmp_path / "whole", sampler="gp", scheduler="asha", grace=3, trials=6, save_every=3)
    whole = run_search(cfg)[0]
    record, calls = search_module.record, {}

    def crashing(cfg, world, state, ended):  # every rank at its third agreement
        calls[world.rank] = calls.get(world.rank, 0) + 1
        if calls[world.rank] == 3 and when == "before the state":
            raise Crash()
        record(cfg, world, state, ended)
        if calls[world.rank] == 3:
            raise Crash()

    cut = dataclasses.replace(cfg, ckpt_dir=str(tmp_path / "cut" / "ckpt"), out=str(tmp_path / "cut" / "out"))
    monkeypatch.setattr(search_module, "record", crashing)
    with pytest.raises(Crash):
        run_search(cut)
    monkeypatch.setattr(search_module, "record", record)
    with pytest.raises(ConfigError, match="holds a search already: add --resume"):
        check_config(cut, 2)
    resumed = run_search(dataclasses.replace(cut, resume=True))[0]
    assert resumed == whole
    assert lines(tmp_path / "cut" / "out" / "trials.jsonl") == lines(tmp_path / "whole" / "out" / "trials.jsonl")
    for t in whole.trials:  # each trial's metrics: the rows of the interrupted segment written again, the same
        rows = without_timings(lines(tmp_path / "cut" / "out" / f"trial-{t.index}" / "metrics.jsonl"))
        assert rows == without_timings(lines(tmp_path / "whole" / "out" / f"trial-{t.index}" / "metrics.jsonl"))


@pytest.mark.parametrize("damage", ["[" * 100_000, "{", '{"spent": 0, "trials": [{"trial": 3}]}'])
def test_a_damaged_state_is_refused_on_resume_with_one_line(tmp_path, damage):
    cfg = search_config(tmp_path, trials=2, steps=2)
    run_search(cfg)
    (tmp_path / "ckpt" / "search" / "state.json").write_text(damage)
    with pytest.raises(ResumeRefused, match=r"state\.json") as refused:
        run_search(dataclasses.replace(cfg, resume=True))
    assert "\n" not in str(refused.value)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the diverging trial's overflows, on purpose
def test_a_diverged_trial_is_recorded_as_failed_and_the_search_goes_on(tmp_path):
    cfg = search_config(tmp_path, lr_range=(1e-3, 1e30), trials=4, steps=6, dtype="float32")
    state = run_search(cfg)[0]
    assert {t.state for t in state.trials} == {"failed", "completed"}, state
    failed = [r for r in lines(tmp_path / "out" / "trials.jsonl") if r["state"] == "failed"]
    assert failed and all(r["loss"] is None for r in failed)
    assert state.best().state == "completed"


def test_the_exports_hold_the_best_trials_final_model(tmp_path):
    cfg = search_config(tmp_path, trials=3, export=str(tmp_path / "best.npz"), export_hf=str(tmp_path / "best-hf"))
    best = run_search(cfg)[0].best()
    alone = dataclasses.replace(cfg, mode="collective", **best.hparams, ckpt_dir=None, out=None, export=None, export_hf=None)
    state = train(alone, progress=False)[0].state_dict()
    with np.load(tmp_path / "best.npz") as exported:
        assert sorted(exported.files) == sorted(state) and all(np.array_equal(exported[n], state[n]) for n in state)
    assert (tmp_path / "best-hf" / "config.json").is_file()


@pytest.mark.parametrize("changes, world, words", [
    (dict(parallel=3), 4, "--parallel 3 does not divide the world of 4 ranks into equal sub-groups"),
    (dict(lr_range=(1e-2, 1e-3)), 2, "--lr-range 0.01 0.001 is inverted"),
    (dict(lr_range=None), 2, "--mode search needs at least one range"),
    (dict(weight_decay_range=(0.0, 0.1), log_scale="lr,weight_decay"), 2, "which needs A > 0"),
    (dict(scheduler="asha", grace=9), 2, "--grace 9 is not below --steps 9: the budget is too small for one rung"),
    (dict(ckpt_dir=None), 2, "--mode search resumes each trial from its checkpoints: give --ckpt-dir"),
    (dict(reduction=1), 2, "--reduction"),
    (dict(sampler="tpe"), 2, "--sampler must be one of random, gp"),
    (dict(dp=2), 2, "world size 1 != dp"),  # each trial: 1 rank, not the dp 2 asked
    (dict(mode="collective", warmup_range=(0, 4)), 1, "--warmup-range is a range a search searches: add --mode search"),
])
def test_bad_search_flags_are_refused(tmp_path, changes, world, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        check_config(search_config(tmp_path, **changes), world)


def test_the_command_line_searches_and_refuses_a_bad_search_with_exit_2(tmp_path):
    args = ["-m", "minidist.train", "--mode", "search", "--parallel", "2", "--trials", "3", "--steps", "4",
            "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--batch-size", "4",
            "--eval-iters", "1", "--lr-range", "1e-3", "1e-2", "--sampler", "gp", "--scheduler", "asha", "--grace", "2",
            "--reduction", "2", "--ckpt-dir", tmp_path / "ckpt", "--out", tmp_path / "out"]
    run = run_mpi(2, *args, timeout=120)
    assert "final: the best trial is" in run.stdout and run.stdout.count("trial 0 ") == 1, run.output
    assert len(lines(tmp_path / "out" / "trials.jsonl")) == 3
    bad = run_mpi(2, *args[:5], "3", *args[6:], check=False)
    assert bad.returncode == 2 and bad.stderr.count("--parallel 3 does not divide") == 1, bad.output
    bad = run_mpi(2, *args[:-4], "--lr-range", "1e-2", "1e-3", "--ckpt-dir", tmp_path / "c2", check=False)
    assert bad.returncode == 2 and bad.stderr.count("--lr-range 0.01 0.001 is inverted") == 1, bad.output


def test_inspect_shows_the_trials_as_a_table_and_a_picture(tmp_path, capsys):
    from minidist.inspect.__main__ import main as inspect_main
    cfg = search_config(tmp_path, trials=4, scheduler="asha", grace=3, warmup_range=(0, 4))
    state = run_search(cfg)[0]
    with open(tmp_path / "out" / "trials.jsonl", "a") as f:
        f.write('{"trial": "garbled"}\n')
    capsys.readouterr()
    assert inspect_main([str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    table = out.split("\n")[1:2 + len(state.trials)]
    assert table[0].split() == ["trial", "lr", "warmup", "@3", "@9", "state"], out
    for t, line in zip(state.trials, table[1:]):
        assert line.split()[0] == str(t.index) and line.endswith(t.state) and f"{t.rungs[3]:.4f}" in line
    assert (tmp_path / "out" / "trials.png").read_bytes()[:4] == b"\x89PNG"
    assert "trials.jsonl" in err and "not a trial" in err, err
