"""Live fault tolerance at the collectives layer (``minidist/comm/fault_tolerance.py``).

Under Open MPI 5 started with ``--with-ft ulfm``: a rank SIGKILLs itself, every survivor's collective
ends with ProcessFailedError naming the call and the dead rank (or the revoke that woke it), the
survivors shrink to a world without it, the same on every rank, and the hand-written collectives
are exact on it. A new rank joins the survivors,
live (MPI_Comm_spawn, then a merge). A ZeRO run that loses a replica mid-step goes on with dp - 1, live, its losses those of one process on the full batch.
Under any other MPI, ``ulfm_problem()`` says why not, on every rank. Run them under Open MPI with
``bash .ci/openmpi -k fault_tolerance``.
"""
import json
import re

import numpy as np
import pytest

from minidist.comm.fault_tolerance import LAUNCH
from minidist.launchers import fault_tolerance_flags, mpiexec_flavour
from tests.mpi.harness import find_mpiexec, run_mpi
from tests.test_drop_replicas import DROP, reference

MPIEXEC = find_mpiexec()
FLAVOUR = mpiexec_flavour(MPIEXEC) if MPIEXEC else None
FT = fault_tolerance_flags(MPIEXEC, 30.0) if MPIEXEC else []  # the rank scripts' comm timeout
needs_ulfm = pytest.mark.skipif(FLAVOUR != "openmpi", reason="needs Open MPI 5's fault-tolerance interface (ULFM; "
                                "bash .ci/openmpi): this mpiexec is " + str(FLAVOUR))


DETECT_S = 3.0  # a rank silent this long is dead (Open MPI's failure detector)


@needs_ulfm
@pytest.mark.parametrize("how, group_timeout", [("kill", 30.0), ("hang", 30.0), ("hang", 1.0)])
def test_survivors_of_a_dead_or_hung_rank_see_the_call_and_the_dead_rank_then_shrink_and_reduce_exactly(
        how, group_timeout):
    """A killed rank (SIGKILL) is seen at once; a hung one (alive, silent: no MPI call) when Open MPI's
    detector has heard nothing from it for DETECT_S seconds. When the group's own deadline comes
    first (1 s), the survivors' CommTimeoutError names it (the census), and the shrink waits for the
    detector."""
    flags = fault_tolerance_flags(MPIEXEC, DETECT_S if how == "hang" else 30.0)
    run = run_mpi(4, "fault_tolerance.py", how, group_timeout, timeout=90, launcher_args=flags)
    failed = re.findall(r"FAILED rank=(\d) (\w+) op=(\w+) seq=(\d+) dead=\[([\d, ]*)\] revoked=(\w+) :: (.*)",
                        run.stdout)
    assert sorted(int(r) for r, *_ in failed) == [0, 1, 3], run.output
    for rank, kind, op, seq, dead, revoked, message in failed:
        assert (op, seq) == ("all_reduce", "2"), run.output  # the call in progress, the same on every rank
        assert f"all_reduce #2 on group 'world': rank {rank}" in message, run.output
        if group_timeout < DETECT_S:  # our deadline: the census names the hung rank
            assert (kind, dead) == ("CommTimeoutError", "2"), run.output
        else:  # MPI's word: the death, or the revoke that woke this survivor
            assert kind == "ProcessFailedError" and (dead == "2" or revoked == "True" and dead == ""), run.output
    assert any(dead == "2" for _, _, _, _, dead, _, _ in failed), run.output  # someone knew rank 2 was gone
    shrunk = re.findall(r"SHRUNK rank=(\d) new=(\d) size=(\d) gone=\[2\] map=\[\(0, 0\), \(1, 1\), \(3, 2\)\]",
                        run.stdout)
    assert sorted(shrunk) == [("0", "0", "3"), ("1", "1", "3"), ("3", "2", "3")], run.output
    assert len(re.findall(r"OK rank=\d 21 checks on 3 ranks", run.stdout)) == 3, run.output
    times = re.findall(r"detect_s=([\d.]+) shrink_s=([\d.]+)", run.stdout)
    if how == "hang":  # dropped once the detector's timeout passed, well before the scripts' own (30 s)
        assert all(DETECT_S * 0.9 <= float(d) + float(s) < 15 for d, s in times), run.output


@needs_ulfm
def test_a_new_rank_joins_the_survivors_live_and_the_collectives_are_exact_on_the_grown_world():
    """After the shrink to 3, the survivors start one process (MPI_Comm_spawn) and merge it in."""
    run = run_mpi(4, "fault_tolerance.py", "spare", timeout=90, launcher_args=FT)
    grew = re.findall(r"GREW rank=(\d) size=4 in [\d.]+s OK 21 checks", run.stdout)
    assert sorted(grew) == ["0", "1", "2"], run.output
    assert re.search(r"JOINED rank=3 size=4 OK 21 checks", run.stdout), run.output


def test_an_mpi_without_the_interface_says_so_on_every_rank():
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    run = run_mpi(2, "fault_tolerance.py", "problem", timeout=60)
    said = re.findall(r"PROBLEM rank=(\d) (.*?)(?=PROBLEM|\n|$)", run.stdout)  # hydra may join two ranks' lines
    assert sorted(r for r, _ in said) == ["0", "1"], run.output
    expected = (f"Open MPI's fault tolerance is off in this job: start it with {LAUNCH}" if FLAVOUR == "openmpi"
                else "has no fault-tolerance interface (ULFM): a dead rank ends the job")
    assert all(expected in line for _, line in said), run.output


@needs_ulfm
def test_open_mpi_started_with_ulfm_has_no_problem():
    run = run_mpi(2, "fault_tolerance.py", "problem", timeout=60, launcher_args=FT)
    assert run.stdout.count("None") == 2, run.output


@needs_ulfm
@pytest.mark.parametrize("stage, optimizer, dp, tp", [(1, "sgd", 3, 1), (2, "adamw", 3, 1), (1, "adamw", 2, 2)])
def test_a_zero_run_that_loses_a_replica_mid_step_goes_on_live_like_one_process(stage, optimizer, dp, tp):
    """Replica 1 (its tp ranks) dies (SIGKILL) after its backward at step DROP; the survivors shrink,
    re-form dp - 1, rebuild the step's start from their copies and redo it (tests/mpi/drop_replica.py)."""
    run = run_mpi(dp * tp, "drop_replica.py", stage, optimizer, dp, tp, timeout=120, launcher_args=FT)
    gone = ", ".join(str(r) for r in range(tp, 2 * tp))
    recovered = re.findall(rf"RECOVERED rank=(\d) at step {DROP} from '(.*)' gone=\[{gone}\] dp={dp - 1} tp={tp}",
                           run.stdout)
    survivors = [str(r) for r in range((dp - 1) * tp)]
    assert sorted(r for r, _ in recovered) == survivors, run.output
    assert all(re.match(r"reduce_scatter #\d+ on group 'dp\[pp0,tp\d\]'", why) for _, why in recovered), run.output
    ref_losses, _ = reference(optimizer)
    losses = re.findall(r"LOSSES rank=(\d) (.*)", run.stdout)
    assert sorted(r for r, _ in losses) == survivors, run.output
    for _, values in losses:
        np.testing.assert_allclose(json.loads(values), ref_losses, rtol=1e-10, atol=0)


def test_the_launch_flags_turn_ulfm_and_its_detector_on_under_open_mpi_only():
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    flags = fault_tolerance_flags(MPIEXEC, 300.0)
    if FLAVOUR != "openmpi":
        assert flags == []
    else:
        assert " ".join(flags) == ("--with-ft ulfm --mca mpi_ft_detector true --mca mpi_ft_detector_timeout 300 "
                                   "--mca mpi_ft_detector_period 75")
        assert " ".join(flags).startswith(" ".join(LAUNCH.split()[1:]))  # what ulfm_problem tells a user


# --- the trainer: --fault-tolerant (minidist/train/fault_tolerant.py)

TRAIN = ["--n-layer", "2", "--n-head", "4", "--n-embd", "16", "--block-size", "16", "--batch-size", "6",
         "--eval-iters", "1", "--eval-every", "100", "--sample-tokens", "0", "--dtype", "float64", "--zero", "1",
         "--lr", "1e-2", "--warmup", "1"]


def steps_alone(cfg, world, until: int) -> list[dict]:
    """``cfg``'s records up to step ``until``, on ``world`` (threads), saving a checkpoint at the end."""
    from minidist.train import Run
    with Run(cfg, world, quiet=True, progress=False) as run:
        return run.advance(until)


@needs_ulfm
def test_the_trainer_drops_a_dead_replica_and_goes_on_as_a_run_with_one_replica_fewer(tmp_path):
    """dp 3 with ZeRO-1; rank 2 (replica 2) dies at the start of step 3. The survivors shrink, re-form
    dp 2, re-cut the optimizer state from their copies and redo step 3: every step's loss equals that
    of a run that had 3 replicas up to step 3 and 2 from it on (a checkpoint in between), in float64."""
    import dataclasses
    from minidist import run_local
    from minidist.train.config import TrainConfig
    from minidist.train.cli import parse_args
    out, data = tmp_path / "out", tmp_path / "data"
    args = [*TRAIN, "--dp", "3", "--steps", "6", "--fault-tolerant", "--fail-at-step", "3", "--fail-rank", "2",
            "--out", str(out), "--data-dir", str(data)]
    run = run_mpi(3, "-m", "minidist.train", *args, timeout=180, launcher_args=FT, check=False)
    assert run.returncode == 0, run.output
    assert re.search(r"step +4  ranks 2 lost \(ProcessFailedError\); going on with dp 2 on 2 ranks, the step redone",
                     run.stdout), run.output
    ours = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in ours] == list(range(6)), ours
    cfg = dataclasses.replace(parse_args(args), fault_tolerant=False, fail_at_step=-1, out=None)
    first = dataclasses.replace(cfg, ckpt_dir=str(tmp_path / "ref"), save_every=3)
    before = run_local(lambda g: steps_alone(first, g, 3), 3)[0]
    after = run_local(lambda g: steps_alone(dataclasses.replace(first, dp=2, resume=True), g, 6), 2)[0]
    expected = [r["loss"] for r in before + after]
    assert isinstance(cfg, TrainConfig) and len(expected) == 6
    np.testing.assert_allclose([r["loss"] for r in ours], expected, rtol=1e-10, atol=0)


def test_fault_tolerance_is_refused_where_it_cannot_drop_a_replica_yet():
    from minidist.train.config import ConfigError, TrainConfig, check_config
    for changes, said in [(dict(zero=0), "a state other than ZeRO-1 or 2"), (dict(zero=3), "ZeRO-1 or 2"),
                          (dict(dp=1), "one replica"), (dict(pp=2, dp=2, micro_batches=2), "pipeline"),
                          (dict(dtype="bfloat16"), "--dtype bfloat16"), (dict(mode="ps"), "--mode ps")]:
        cfg = TrainConfig(**{**dict(dp=2, zero=1, fault_tolerant=True), **changes})
        with pytest.raises(ConfigError, match=re.escape(said)):
            check_config(cfg, cfg.world if cfg.mode != "ps" else 2)


@pytest.mark.skipif(FLAVOUR != "mpich", reason="the MPI without the interface here is MPICH's")
def test_without_the_interface_the_trainer_says_so_and_trains_as_without_the_flag(tmp_path):
    run = run_mpi(2, "-m", "minidist.train", *TRAIN, "--dp", "2", "--steps", "2", "--fault-tolerant",
                  "--data-dir", tmp_path / "data", timeout=120)
    assert "--fault-tolerant: this MPI (MPICH" in run.stdout and "no fault-tolerance interface (ULFM)" in run.stdout, \
        run.output


def test_the_restarting_launcher_starts_a_fault_tolerant_trainer_with_ulfm_under_open_mpi_only():
    from minidist.launchers import fault_tolerance_launch
    script = ["-m", "minidist.train", "--dp", "3", "--zero", "1", "--fault-tolerant", "--comm-timeout", "60"]
    assert fault_tolerance_launch(["mpiexec"], script[:-3] + ["--comm-timeout", "60"]) == ["mpiexec"]  # no flag
    if FLAVOUR == "openmpi":
        assert fault_tolerance_launch([MPIEXEC, "--oversubscribe"], script)[2:] == fault_tolerance_flags(MPIEXEC, 60.0)
    elif MPIEXEC:
        assert fault_tolerance_launch([MPIEXEC], script) == [MPIEXEC]  # MPICH: nothing to turn on


# --- replicas that join a running job: --spares, --grow-at (minidist/train/fault_tolerant.py)

def reference_losses(tmp_path, cfg, segments) -> list[float]:
    """The losses of runs of ``cfg`` (threads) with dp changing at step boundaries: ``segments`` is
    [(dp, until), ...], each segment resumed from the checkpoint the previous one saved at its end."""
    import dataclasses
    from minidist import run_local
    losses, start = [], 0
    for i, (dp, until) in enumerate(segments):
        part = dataclasses.replace(cfg, dp=dp, ckpt_dir=str(tmp_path / "ref"), save_every=until - start,
                                   resume=i > 0)
        losses += [r["loss"] for r in run_local(lambda g: steps_alone(part, g, until), dp * cfg.tp)[0]]
        start = until
    return losses


def trained(tmp_path, n, *flags, timeout=240, detect_s=30.0):
    """The trainer on ``n`` ranks under Open MPI with ULFM, its detector's timeout ``detect_s`` (the
    trainer's --comm-timeout, as python -m minidist.run sets it): (the job, its metrics, its config)."""
    import dataclasses
    from minidist.train.cli import parse_args
    out = tmp_path / "out"
    args = [*TRAIN, *map(str, flags), "--fault-tolerant", "--out", str(out), "--data-dir", str(tmp_path / "data")]
    run = run_mpi(n, "-m", "minidist.train", *args, timeout=timeout, check=False,
                  launcher_args=fault_tolerance_flags(MPIEXEC, detect_s))
    assert run.returncode == 0, run.output
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    cfg = dataclasses.replace(parse_args(args), fault_tolerant=False, fail_at_step=-1, spares=0, grow_at=-1, out=None)
    return run, metrics, cfg


@needs_ulfm
def test_a_spare_replica_joins_at_the_step_asked_and_the_run_goes_on_as_one_with_a_replica_more(tmp_path):
    """dp 2 with ZeRO-1 (AdamW: its moments handed over too) and --spares 1 --grow-at 3: at step 3's
    start the two ranks spawn a third trainer, merge it in and hand it the weights and optimizer state;
    every step's loss equals that of a run that had 2 replicas up to step 3 and 3 from it on, in float64."""
    run, ours, cfg = trained(tmp_path, 2, "--dp", 2, "--steps", 6, "--spares", 1, "--grow-at", 3)
    said = re.search(r"step +4  1 replica joined \(rank 2, started in [\d.]+ s\); going on with dp 3 on 3 ranks, "
                     r"the weights and optimizer state handed over \(([\d.]+) MiB to each new rank", run.stdout)
    assert said, run.output
    assert float(said[1]) == pytest.approx(10_944 * 8 * 3 / 2**20, abs=1e-3)  # masters, AdamW's m and v: float64
    assert [r["step"] for r in ours] == list(range(6)), ours
    expected = reference_losses(tmp_path, cfg, [(2, 3), (3, 6)])
    np.testing.assert_allclose([r["loss"] for r in ours], expected, rtol=1e-10, atol=0)


@needs_ulfm
def test_a_spare_replaces_a_dead_replica_at_once_and_the_run_keeps_its_replicas(tmp_path):
    """dp 3 with ZeRO-2 and SGD, --spares 1; rank 1 dies at step 3. The survivors drop it, re-form dp
    2, then start a spare, which joins as the third replica, and the step is redone with dp 3: every
    step's loss is that of a run with 3 replicas throughout (the dp 2 segment is empty)."""
    run, ours, cfg = trained(tmp_path, 3, "--dp", 3, "--zero", 2, "--optimizer", "sgd", "--steps", 6, "--spares", 1,
                             "--fail-at-step", 3, "--fail-rank", 1)
    assert re.search(r"step +4  ranks 1 lost \(ProcessFailedError\); going on with dp 2 on 2 ranks", run.stdout), \
        run.output
    assert re.search(r"step +4  1 replica joined \(rank 2, .*\); going on with dp 3 on 3 ranks", run.stdout), run.output
    assert [r["step"] for r in ours] == list(range(6)), ours
    np.testing.assert_allclose([r["loss"] for r in ours], reference_losses(tmp_path, cfg, [(3, 6)]), rtol=1e-10, atol=0)


@needs_ulfm
def test_a_hung_replica_is_dropped_as_a_dead_one_once_it_misses_the_comm_timeout(tmp_path):
    """dp 3 with ZeRO-1, --comm-timeout 4; rank 2 hangs (sleeps, no MPI call) at step 3. Open MPI's
    detector, set to the same timeout by the launch flags, declares it dead; the survivors drop it and
    go on with dp 2, every loss that of a dp 3 -> dp 2 run. The job ends (the hung rank is ended too)."""
    flags = ["--dp", 3, "--steps", 5, "--fail-at-step", 3, "--fail-rank", 2, "--fail-hang", "--comm-timeout", 4]
    run, ours, cfg = trained(tmp_path, 3, *flags, timeout=120, detect_s=4.0)
    assert re.search(r"step +4  ranks 2 lost \((ProcessFailedError|CommTimeoutError)\); going on with dp 2",
                     run.stdout), run.output
    expected = reference_losses(tmp_path, cfg, [(3, 3), (2, 5)])
    np.testing.assert_allclose([r["loss"] for r in ours], expected, rtol=1e-10, atol=0)


def test_spares_are_refused_without_fault_tolerance_or_a_batch_that_divides():
    from minidist.train.config import ConfigError, TrainConfig, check_config
    for changes, said in [(dict(fault_tolerant=False), "add --fault-tolerant"),
                          (dict(spares=0), "add --spares S"),
                          (dict(batch_size=8), "does not divide over 3 replicas")]:
        cfg = TrainConfig(**{**dict(dp=2, zero=1, fault_tolerant=True, spares=1, grow_at=3, batch_size=6), **changes})
        with pytest.raises(ConfigError, match=re.escape(said)):
            check_config(cfg, cfg.world)


def test_after_a_loss_as_many_spares_join_as_were_lost_and_the_batch_allows():
    from minidist.train.fault_tolerant import refill
    assert refill(dp=2, lost=1, spares=3, batch_size=6) == 1
    assert refill(dp=1, lost=2, spares=1, batch_size=6) == 1
    assert refill(dp=2, lost=2, spares=2, batch_size=6) == 1  # 4 replicas would not divide 6 rows
    assert refill(dp=2, lost=1, spares=0, batch_size=6) == 0

