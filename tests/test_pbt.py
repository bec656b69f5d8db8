"""Population-based training (train/population.py's rules, train/pbt.py's loop).

The rules are pure functions of the seed and the losses. A member's steps are the steps of the same
layout run alone with the same hyper-parameters, bitwise; a member that copies continues exactly as
its donor would, with its new hyper-parameters; the lineage file is a function of the seed; a
resumed population continues bitwise; bad flags are refused before anything is sent.
"""
import dataclasses
import json
import re
import shutil

import numpy as np
import pytest

from minidist import run_local
from minidist.checkpoint.format import step_dir
from minidist.checkpoint.training import ResumeRefused
from minidist.train.life import Run
from minidist.train.config import ConfigError, TrainConfig, check_config
from minidist.train.pbt import exempt_of, member_config, train_pbt
from minidist.train.population import FACTORS, Member, draw, exploit, explore, generation, ranked
from tests.mpi.harness import run_mpi

SIZES = dict(n_layer=2, n_head=2, n_embd=16, block_size=16, batch_size=4, eval_iters=1, eval_every=100,
             sample_tokens=0, dtype="float64", warmup=1)


def pbt_config(tmp_path, **changes):
    return TrainConfig(**{**SIZES, **dict(mode="pbt", population=2, ready_every=3, steps=9, lr_range=(1e-3, 1e-2),
                                          ckpt_dir=str(tmp_path / "ckpt"), out=str(tmp_path / "out")), **changes})


def run_population(cfg):
    """Every rank's (model state, population history) of ``cfg`` on its thread ranks."""
    world = cfg.population * cfg.dp * cfg.tp * cfg.pp * cfg.cp
    return run_local(lambda g: (lambda m, h: (m.state_dict(), h))(*train_pbt(cfg, g)), world)


def metrics(path):
    return [json.loads(line) for line in open(path)]


def without_timings(rows):
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "data_wait_s")} for r in rows]


# --- the rules

def test_draws_are_log_uniform_in_their_range_and_a_function_of_the_seed():
    a = draw(8, 3, {"lr": 0.1, "weight_decay": 0.5}, {"lr": (1e-4, 1e-2)})
    assert a == draw(8, 3, {"lr": 0.1, "weight_decay": 0.5}, {"lr": (1e-4, 1e-2)})
    assert a != draw(8, 4, {"lr": 0.1, "weight_decay": 0.5}, {"lr": (1e-4, 1e-2)})
    assert all(1e-4 <= m.hparams["lr"] <= 1e-2 and m.hparams["weight_decay"] == 0.5 and m.parent == m.index for m in a)
    logs = np.log10([m.hparams["lr"] for m in draw(400, 0, {"lr": 0.1}, {"lr": (1e-4, 1e-2)})])
    assert abs(np.mean(logs) + 3) < 0.1  # uniform in log space: the mean exponent is the middle one


def test_truncation_the_bottom_quantile_copies_the_top_one():
    losses = [3.0, 1.0, 4.0, 2.0, 5.0, 0.5, 6.0, 2.5]
    assert ranked(losses) == [5, 1, 3, 7, 0, 2, 4, 6]
    copies = exploit(losses, "truncation", 0.25, seed=0, step=10)
    assert set(copies) == {4, 6} and set(copies.values()) <= {5, 1}
    assert copies == exploit(losses, "truncation", 0.25, seed=0, step=10)
    assert exploit([1.0, float("nan")], "truncation", 0.5, 0, 1) == {1: 0}  # a diverged member copies


def test_tournament_a_member_copies_the_other_it_meets_only_when_that_one_is_better():
    losses = [3.0, 1.0, 4.0, 2.0]
    copies = exploit(losses, "tournament", 0.25, seed=1, step=5)
    assert all(losses[donor] < losses[m] for m, donor in copies.items())
    assert 1 not in copies  # the best copies no one


def test_explore_multiplies_by_08_or_12_or_resamples_inside_the_range():
    seen = set()
    for step in range(200):
        new, how = explore({"lr": 1e-3, "weight_decay": 0.1}, ["lr", "weight_decay"], {"lr": (1e-4, 1e-2)}, 0, step, 1)
        assert 1e-4 <= new["lr"] <= 1e-2
        assert new["weight_decay"] == 0.1 * float(how["weight_decay"][1:])  # no range: perturbed only, "x0.8" or "x1.2"
        assert how["weight_decay"] in ("x0.8", "x1.2")
        perturbed = new["lr"] in (1e-3 * FACTORS[0], 1e-3 * FACTORS[1])
        assert how["lr"] == (f"x{new['lr'] / 1e-3:.1f}" if perturbed else "fresh draw")  # each change named as made
        seen.add(how["lr"])
    assert seen == {"x0.8", "x1.2", "fresh draw"}
    # a perturbation past the range is clipped, and says so
    new, how = next((n, h) for n, h in (explore({"lr": 1e-2}, ["lr"], {"lr": (1e-4, 1e-2)}, 0, s, 1) for s in range(50))
                    if h["lr"].startswith("x1.2"))
    assert new["lr"] == 1e-2 and how["lr"] == "x1.2, clipped to [0.0001, 0.01]"


def test_a_generation_gives_each_copier_its_donors_explored_hyperparameters_and_its_parent():
    members = [Member(0, {"lr": 1.0}, 0), Member(1, {"lr": 2.0}, 1)]
    after, copies, changes = generation(members, [1.0, 2.0], rule="truncation", quantile=0.5, names=["lr"], ranges={},
                                        seed=0, step=3)
    assert copies == {1: 0} and after[0] == Member(0, {"lr": 1.0}, 0, 1.0)
    assert after[1].parent == 0 and after[1].hparams["lr"] == float(changes[1]["lr"][1:]) and 0 not in changes


# --- the loop

def first_steps(cfg, world, steps: int) -> list[dict]:
    """The records of ``cfg``'s first ``steps`` steps, run alone on ``world``."""
    with Run(cfg, world, progress=False) as run:
        return run.advance(steps)


@pytest.mark.parametrize("layout", [dict(), dict(dp=2, zero=2),
                                    pytest.param(dict(tp=2, sequence_parallel=True), marks=pytest.mark.slow),
                                    pytest.param(dict(pp=2, micro_batches=2), marks=pytest.mark.slow),
                                    dict(dtype="bfloat16", dp=2, zero=1)],
                         ids=["one", "dp2-zero2", "tp2-sp", "pp2", "bf16-dp2-zero1"])
def test_a_members_first_segment_is_its_layout_run_alone_with_its_hyperparameters(tmp_path, layout):
    cfg = pbt_config(tmp_path, steps=6, **layout)
    run_population(cfg)
    members = draw(2, cfg.seed, {"lr": cfg.lr}, {"lr": cfg.lr_range})
    for k, member in enumerate(members):
        alone = dataclasses.replace(cfg, mode="collective", lr=member.hparams["lr"], ckpt_dir=None, out=None)
        rows = run_local(lambda g: first_steps(alone, g, cfg.ready_every), cfg.dp * cfg.tp * cfg.pp)[0]
        ours = metrics(tmp_path / "out" / f"member-{k}" / "metrics.jsonl")[:cfg.ready_every]
        assert without_timings(ours) == without_timings(rows), k  # bitwise: the same floats


def test_a_copy_continues_as_its_donor_would_with_its_new_hyperparameters(tmp_path):
    cfg = pbt_config(tmp_path, steps=6)
    history = run_population(cfg)[0][1]
    first = [r for r in history if r["step"] == 3]
    copier = next(r for r in first if r["donor"] is not None)
    donor = member_config(cfg, Member(copier["donor"], first[copier["donor"]]["before"], 0), copier["donor"])
    # the donor's checkpoint of step 3, continued alone with the copier's new learning rate
    again = dataclasses.replace(donor, ckpt_dir=str(tmp_path / "again"), out=None, lr=copier["after"]["lr"], resume=True)
    shutil.copytree(step_dir(tmp_path / "ckpt" / f"member-{copier['donor']}", 3), step_dir(again.ckpt_dir, 3))
    with Run(again, progress=False, explored=exempt_of(cfg), quiet=True) as alone:
        rows = alone.advance(6)
    ours = metrics(tmp_path / "out" / f"member-{copier['member']}" / "metrics.jsonl")[3:6]
    assert without_timings(ours) == without_timings(rows)


def test_the_lineage_is_a_function_of_the_seed_and_resume_continues_bitwise(tmp_path):
    cfg = pbt_config(tmp_path / "a", population=4, steps=9, exploit="tournament", explore="lr,weight_decay",
                     weight_decay_range=(0.01, 0.3))
    whole = run_population(cfg)
    again = run_population(dataclasses.replace(cfg, ckpt_dir=str(tmp_path / "b" / "ckpt"), out=str(tmp_path / "b" / "out")))
    lineage = metrics(tmp_path / "a" / "out" / "pbt.jsonl")
    assert lineage == metrics(tmp_path / "b" / "out" / "pbt.jsonl") and len(lineage) == 4 * 4
    assert {r["step"] for r in lineage} == {0, 3, 6, 9} and whole[0][1] == again[0][1]
    # each row's "before" is the member's "after" of the ready point before it; copies name how they changed
    after = {r["member"]: r["after"] for r in lineage if r["step"] == 0}
    for r in (r for r in lineage if r["step"] > 0):
        assert r["before"] == after[r["member"]], r
        assert (r["donor"] is None) == (r["change"] == {}), r
        assert all(how.split(",")[0] in ("x0.8", "x1.2", "fresh draw") for how in r["change"].values()), r
        after[r["member"]] = r["after"]
    assert all(r["after"] is None for r in lineage if r["step"] == 9)  # the end: nothing follows
    # a crash after the population of step 6 was recorded: step 9's population and saves are lost
    (tmp_path / "a" / "ckpt" / "population" / "step-000009.json").unlink()
    resumed = run_population(dataclasses.replace(cfg, resume=True))
    assert resumed[0][1] == whole[0][1]  # the history: the same losses, hyper-parameters and lineage
    assert metrics(tmp_path / "a" / "out" / "pbt.jsonl") == lineage  # rewritten to step 6, then appended
    for (state, _), (ref, _) in zip(resumed, whole):
        assert all(np.array_equal(state[n], ref[n]) for n in ref)


def test_the_exports_hold_the_best_members_final_model(tmp_path):
    """--export and --export-hf: the member with the lowest last validation loss, after its last
    step (7 steps, ready every 3: its last checkpoint is of step 6, the export of step 7)."""
    from safetensors.numpy import load_file
    cfg = pbt_config(tmp_path, steps=7, export=str(tmp_path / "best.npz"), export_hf=str(tmp_path / "best-hf"))
    ranks = run_population(cfg)
    last = [r for r in ranks[0][1] if r["step"] == 7]  # (the rows of step 0 are the starts)
    best = ranked([r["val_loss"] for r in last])[0]
    state = ranks[best][0]  # one rank per member: rank k is member k
    with np.load(tmp_path / "best.npz") as exported:
        assert sorted(exported.files) == sorted(state) and all(np.array_equal(exported[n], state[n]) for n in state)
    others = [ranks[k][0] for k in range(cfg.population) if k != best]
    assert all(not np.array_equal(o["lm_head.weight"], state["lm_head.weight"]) for o in others)
    hf = load_file(str(tmp_path / "best-hf" / "model.safetensors"))
    assert np.array_equal(hf["transformer.wte.weight"], state["transformer.wte.weight"])
    member = tmp_path / "ckpt" / f"member-{best}"
    assert (tmp_path / "best.npz").read_bytes() == (member / "final.npz").read_bytes()
    assert (tmp_path / "best-hf" / "config.json").read_bytes() == (member / "final-hf" / "config.json").read_bytes()


@pytest.mark.parametrize("changes, world, words", [
    (dict(population=3), 4, "--population 3 does not divide the world of 4 ranks"),
    (dict(explore="lr,momentum"), 2, "--explore: momentum is not a hyper-parameter a member can explore"),
    (dict(lr_range=(1e-2, 1e-3)), 2, "--lr-range A B needs 0 < A <= B"),
    (dict(exploit="best"), 2, "--exploit must be one of truncation, tournament"),
    (dict(ckpt_dir=None), 2, "--mode pbt copies a member into another through its checkpoints: give --ckpt-dir"),
    (dict(quantile=0.75), 2, "--quantile"),
    (dict(dp=2), 2, "world size 1 != dp"),  # each member: 1 rank, not the dp 2 asked
    # was: "world size 0 != dp * tp = 1 * 1 = 1 (start 1 ranks: mpiexec -n 1 ...)", advice that is refused again
    (dict(population=4), 2, "--population 4 does not divide the world of 2 ranks into equal members: each member "
                            "gets 2 / 4 = 0.5 ranks, and one of dp 1 x pp 1 x cp 1 x tp 1 needs 1: start mpiexec -n 4"),
    (dict(population=2, dp=2), 3, "each member gets 3 / 2 = 1.5 ranks, and one of dp 2 x pp 1 x cp 1 x tp 1 needs 2: "
                                  "start mpiexec -n 4"),
])
def test_bad_population_flags_are_refused(tmp_path, changes, world, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        check_config(pbt_config(tmp_path, **changes), world)


def test_a_second_population_into_a_used_ckpt_dir_is_refused_unless_it_resumes(tmp_path):
    """Was: every rank died of an IndexError (train/pbt.py) in the first segment."""
    cfg = pbt_config(tmp_path, steps=2)
    run_population(cfg)
    with pytest.raises(ConfigError, match=r"holds a population already \(up to step-000002\.json\): add --resume"):
        check_config(cfg, 2)
    check_config(dataclasses.replace(cfg, resume=True), 2)  # continuing it is what --resume is for


@pytest.mark.parametrize("damage", ["[" * 100_000, '{"step": 2, "members": [], "rows": []}', "{", '{"step": "2"}'])
def test_a_damaged_population_file_is_refused_on_resume_with_one_line(tmp_path, damage):
    """Was: json.loads of the file as it was, a RecursionError or KeyError traceback on every rank."""
    cfg = pbt_config(tmp_path, steps=2)
    run_population(cfg)
    (tmp_path / "ckpt" / "population" / "step-000002.json").write_text(damage)
    with pytest.raises(ResumeRefused, match=r"step-000002\.json") as refused:
        run_population(dataclasses.replace(cfg, resume=True))
    assert "\n" not in str(refused.value)


def test_the_command_line_trains_a_population_and_refuses_a_bad_one_with_exit_2(tmp_path):
    args = ["-m", "minidist.train", "--mode", "pbt", "--population", "2", "--ready-every", "2", "--steps", "4",
            "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--batch-size", "4",
            "--eval-iters", "1", "--lr-range", "1e-3", "1e-2", "--ckpt-dir", tmp_path / "ckpt", "--out", tmp_path / "out"]
    run = run_mpi(2, *args, timeout=120)
    assert "final: the best member is" in run.stdout and run.stdout.count("step     2  val loss") == 1, run.output
    assert re.search(r"start: member 0 lr [\d.e-]+ \(drawn in \[0\.001, 0\.01\]\); member 1 lr", run.stdout), run.output
    assert len(metrics(tmp_path / "out" / "pbt.jsonl")) == 2 * 3  # the starts, then 2 ready points
    bad = run_mpi(2, *args[:5], "3", *args[6:], check=False)
    assert bad.returncode == 2 and bad.stderr.count("--population 3 does not divide") == 1, bad.output


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the diverging member's overflows, on purpose
def test_a_diverged_member_copies_a_live_one_and_the_population_goes_on(tmp_path, capsys):
    assert exploit([1.0, float("nan"), float("nan"), 2.0], "truncation", 0.25, 0, 1) == {2: 0, 1: 0}
    # seed 3 draws lr 0.67 and 8e20: member 1 diverges in its first segment (DivergenceWatch), copies member 0
    cfg = pbt_config(tmp_path, seed=3, lr_range=(1e-3, 1e30), steps=6, dtype="float32")
    history = run_population(cfg)[0][1]
    first = [r for r in history if r["step"] == 3]
    assert np.isnan(first[1]["val_loss"]) and first[1]["donor"] == 0
    assert all(np.isfinite(r["val_loss"]) for r in history if r["step"] == 6)
