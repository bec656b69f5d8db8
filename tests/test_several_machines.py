"""Several machines, rehearsed on this one (minidist/comm/machines.py, minidist/launchers.py).

MPI says which ranks share a machine through its shared-memory split, and a launcher decides that
split from its host list: a hostfile that names this machine under two names (``localhost:2`` and
its host name ``:2``) makes hydra start two "machines" of two ranks each, as a cluster of two nodes
would. The tests then check what minidist derives from it (each rank's machine and its index
there, the mesh's report of which axes cross machines, the warning for tensor parallelism across
machines) and that the job trains like one process. Open MPI's ``--host a:2,b:2`` is checked where
Open MPI is the MPI (``bash .ci/openmpi``). Slurm is not installed here: ``--launcher srun`` runs a
stand-in (tests/doubles/slurm/srun) that records its arguments and starts the tasks with mpiexec.
"""
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from minidist import run_local
from minidist.comm.machines import Machines, one_machine
from minidist.launchers import find_mpiexec, mpiexec_flags, mpiexec_flavour
from minidist.parallel.mesh import DeviceMesh
from minidist.run import parse_args, split_launcher_args
from minidist.train import train
from minidist.train.config import TrainConfig
from minidist.train.folders import FolderNotShared, held_folders
from tests.mpi.harness import HERE, REPO, find_mpiexec as mpiexec_here, run_mpi
from tests.netns import TCP_ONLY, Unavailable, two_machines
from tests.test_run_launcher import rank_pids, running

SLURM = REPO / "tests" / "doubles" / "slurm"
SIZES = dict(n_layer=2, n_head=2, n_embd=16, block_size=16, batch_size=8, steps=3, eval_every=100, eval_iters=1,
             sample_tokens=0, dtype="float64", seed=3)
needs_mpi = pytest.mark.skipif(mpiexec_here() is None, reason="needs mpiexec")


def launch(*args, env=None) -> subprocess.CompletedProcess:
    """``python -m minidist.run *args``, its output captured."""
    return subprocess.run([sys.executable, "-m", "minidist.run", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=120, env=env)


def flags(sizes: dict) -> list:
    return [a for k, v in sizes.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def test_machines_are_numbered_by_their_lowest_rank_and_give_each_rank_its_local_index():
    m = Machines((0, 0, 1, 1, 0, 2))
    assert m.count == 3 and m.ranks_on(0) == [0, 1, 4]
    assert [m.local_rank(r) for r in range(6)] == [0, 1, 0, 1, 2, 0]  # which GPU each rank takes
    assert [m.local_size(r) for r in range(6)] == [3, 3, 2, 2, 3, 1]  # how many share its cores
    assert m.spanned([0, 4]) == [0] and m.spanned([1, 2, 5]) == [0, 1, 2]
    assert str(m) == "3 machines: ranks 0-1, 4 on machine 0, ranks 2-3 on machine 1, ranks 5 on machine 2"
    assert one_machine(4).count == 1 and one_machine(4).local_size(3) == 4
    assert [m.host_size(r) for r in range(6)] == [3, 3, 2, 2, 3, 1] and m.rehearsed() == []  # no names: a host each


def test_machines_on_one_host_are_said_to_be_rehearsed_and_share_its_cores():
    """A hostfile naming one host twice: MPI's split makes 2 machines, and their host names say that
    both are this host, so the run says it is a rehearsal and its 4 ranks share the host's cores."""
    m = Machines((0, 0, 1, 1), ("vm", "vm"))
    assert m.rehearsed() == ["vm"] and [m.host_size(r) for r in range(4)] == [4] * 4 and m.local_size(0) == 2
    assert str(m) == "2 machines (rehearsed on one host, vm): ranks 0-1 on machine 0, ranks 2-3 on machine 1"
    two = Machines((0, 0, 1, 1, 2), ("a", "a", "b"))
    assert str(two).startswith("3 machines (some rehearsed on one host: a): ") and two.host_size(4) == 1
    real = Machines((0, 0, 1, 1), ("node1", "node2"))
    assert real.rehearsed() == [] and str(real).startswith("2 machines: ") and real.host_size(0) == 2


@pytest.mark.parametrize("layout, of_rank, said", [
    (dict(dp=2, tp=2), (0, 0, 1, 1), "tp groups inside a machine, dp groups across 2 machines"),
    (dict(dp=2, pp=2), (0, 0, 1, 1), "pp groups inside a machine, dp groups across 2 machines"),
    (dict(pp=2, tp=2), (0, 1, 0, 1), "tp groups across 2 machines, pp groups inside a machine"),
    (dict(dp=4, ep=2), (0, 0, 1, 1), "dp groups across 2 machines, ep groups inside a machine"),
    (dict(tp=4), (0, 0, 0, 0), None),  # one machine: nothing to say
])
def test_the_mesh_says_which_axes_cross_machines_and_warns_when_tensor_parallelism_does(layout, of_rank, said):
    lines = run_local(lambda g: DeviceMesh(g, **layout, machines=Machines(of_rank)).machine_lines(), len(of_rank))[0]
    if said is None:
        assert lines == []
        return
    assert lines[0].endswith(said) and lines[0].startswith("2 machines: ")
    warned = [line for line in lines if line.startswith("warning: tensor-parallel groups cross machines")]
    assert len(warned) == ("tp groups across" in said)


def test_launcher_arguments_reach_the_launcher_as_they_are():
    argv = ["-n", "4", "--launcher-args", "-ppn", "2", "--bind-to", "core", "--", "-m", "minidist.train", "--launcher-args"]
    assert split_launcher_args(argv) == (["-ppn", "2", "--bind-to", "core"],
                                         ["-n", "4", "--", "-m", "minidist.train", "--launcher-args"])
    args = parse_args(argv)
    assert args.launcher_args == ["-ppn", "2", "--bind-to", "core"] and args.script == ["-m", "minidist.train", "--launcher-args"]
    assert split_launcher_args(["-n", "2", "--", "s.py", "--launcher-args", "x"])[0] == []  # the script's own flag


@pytest.mark.parametrize("says, spelled", [("mpiexec (Open MPI) 5.0.11", ["--oversubscribe", "--hostfile", "hosts"]),
                                           ("HYDRA build details:", ["-f", "hosts"])])
def test_the_hostfile_is_given_in_the_flavours_own_spelling(tmp_path, says, spelled):
    fake = tmp_path / "mpiexec"
    fake.write_text(f"#!/bin/sh\necho '{says}'\n")
    fake.chmod(0o755)
    assert mpiexec_flags(str(fake), hostfile="hosts") == spelled


def test_bad_launcher_choices_fail_at_once_with_exit_2(tmp_path, capsys, monkeypatch):
    machine = "localhost slots=2" if mpiexec_flavour(find_mpiexec()) == "openmpi" else "localhost:2"  # its format
    hosts = tmp_path / "hosts"
    hosts.write_text(machine + "\n")
    (tmp_path / "junk").write_bytes(bytes(range(256)))
    (tmp_path / "empty").write_text("# no machine yet\n\n")
    (tmp_path / "bad").write_text(f"{machine}\nnode-1 2 slots\n")
    for argv, message in [
        (["--hostfile", str(tmp_path / "none")], "--hostfile " + str(tmp_path / "none") + ": no such file"),
        (["--hostfile", str(tmp_path)], "not a readable file"),
        (["--hostfile", str(tmp_path / "junk")], "not readable as text"),
        (["--hostfile", str(tmp_path / "empty")], "no machine in it"),
        (["--hostfile", str(tmp_path / "bad")], "line 2 is not a machine in"),
        (["--launcher", "srun", "--hostfile", str(hosts)], "--hostfile is for mpiexec: srun runs on the nodes"),
        (["--launcher", "slurm"], "invalid choice: 'slurm'"),
    ]:
        with pytest.raises(SystemExit) as e:
            parse_args(["-n", "2", *argv, "--", "s.py"])
        assert e.value.code == 2 and message in capsys.readouterr().err, argv
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun here
    with pytest.raises(SystemExit) as e:
        parse_args(["-n", "2", "--launcher", "srun", "--", sys.executable])
    assert e.value.code == 2 and "srun not found on PATH" in capsys.readouterr().err
    # this machine's bound on ranks is for a job kept here: a hostfile takes the ranks elsewhere
    with pytest.raises(SystemExit):
        parse_args(["-n", "100000", "--", sys.executable])
    assert "this machine starts at most" in capsys.readouterr().err
    assert parse_args(["-n", "100000", "--hostfile", str(hosts), "--", sys.executable]).n == 100000


def this_machine_twice(tmp_path) -> str:
    """A hostfile naming this machine twice, two slots each, in hydra's format."""
    hosts = tmp_path / "hosts"
    hosts.write_text(f"localhost:2\n{socket.gethostname()}:2\n")
    return str(hosts)


def one_process(tmp_path, data_dir) -> dict:
    cfg = TrainConfig(**SIZES, data_dir=data_dir, export=str(tmp_path / "one.npz"))
    train(cfg, progress=False)
    return dict(np.load(cfg.export))


def assert_like(weights: dict, ref: dict):
    assert weights.keys() == ref.keys()
    for name, r in ref.items():
        assert np.abs(weights[name] - r).max() <= 1e-10 * np.abs(r).max(), name


@needs_mpi
@pytest.mark.skipif(mpiexec_flavour(find_mpiexec()) == "openmpi", reason="hydra's hostfile format (MPICH)")
def test_a_hostfile_of_two_machines_places_the_ranks_reports_the_axes_and_trains_like_one_process(tmp_path, data_dir):
    run = launch("-n", 4, "--hostfile", this_machine_twice(tmp_path), "--", "-m", "minidist.train", "--dp", 2, "--tp", 2,
                 *flags(SIZES), "--data-dir", data_dir, "--export", tmp_path / "w.npz", "--explain")
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"-f {tmp_path / 'hosts'}" in run.stderr  # the launcher's attempt line: hydra's spelling
    said = (f"  2 machines (rehearsed on one host, {socket.gethostname()}): ranks 0-1 on machine 0, ranks 2-3 on "
            "machine 1; tp groups inside a machine, dp groups across 2 machines")  # MPI's split, and the host named
    assert said in run.stdout.splitlines()
    for rank, (machine, local) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):  # --explain, rank by rank
        assert f"on machine {machine} of 2, local rank {local} of 2" in run.stdout.split(f"=== rank {rank}:")[1]
    assert "dp[pp0,tp0] = ranks [0, 2] (across machines 0, 1)" in run.stdout
    assert "tp[dp1,pp0] = ranks [2, 3] (inside machine 1)" in run.stdout
    assert "warning: tensor-parallel" not in run.stdout
    assert_like(dict(np.load(tmp_path / "w.npz")), one_process(tmp_path, data_dir))


@needs_mpi
@pytest.mark.skipif(mpiexec_flavour(find_mpiexec()) != "openmpi", reason="Open MPI's --host (bash .ci/openmpi)")
def test_open_mpis_host_option_reaches_mpiexec_and_the_job_trains_like_one_process(tmp_path, data_dir):
    run = launch("-n", 4, "--launcher-args", "--host", f"localhost:2,{socket.gethostname()}:2", "--", "-m",
                 "minidist.train", "--pp", 2, "--tp", 2, *flags(SIZES), "--data-dir", data_dir, "--export", tmp_path / "w.npz")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "--host localhost:2," in run.stderr  # the launcher's attempt line: the option reached mpiexec
    # Open MPI 5 maps two names of one machine onto one node (hydra keeps a node per hostfile line), so
    # MPI's split says one machine, and minidist, which asks MPI, reports no group crossing machines
    assert "machines:" not in run.stdout and "across" not in run.stdout, run.stdout
    assert_like(dict(np.load(tmp_path / "w.npz")), one_process(tmp_path, data_dir))


def with_srun(log) -> dict:
    """The environment in which ``srun`` is the stand-in (tests/doubles/slurm/srun), logging to ``log``."""
    return dict(os.environ, PATH=f"{SLURM}{os.pathsep}{os.environ['PATH']}", FAKE_SRUN_MPIEXEC=find_mpiexec(),
                FAKE_SRUN_LOG=str(log))


@needs_mpi
def test_srun_starts_the_job_with_its_arguments_and_restarts_it_elastically_from_the_checkpoint(tmp_path):
    log = tmp_path / "srun.log"
    script = [str(HERE / "restartable.py"), "--ckpt-dir", tmp_path / "ckpt", "--steps", 6, "--save-every", 2,
              "--out", tmp_path / "w.npy"]
    run = launch("-n", 2, "--launcher", "srun", "--max-restarts", 1, "--elastic-n", 1, "--launcher-args",
                 "--mpi=pmix", "--", *script, "--fail-at-step", 5, "--fail-rank", 1, env=with_srun(log))
    assert run.returncode == 0, run.stderr
    calls = log.read_text().splitlines()
    assert [c.split(" -n ")[0] for c in calls] == ["srun --kill-on-bad-exit=1 --mpi=pmix"] * 2, calls
    assert " -n 2 " in calls[0] and " -n 1 " in calls[1] and calls[1].endswith("--resume"), calls
    assert "restart 1/1 on 1 ranks with --resume from checkpoint" in run.stderr
    run_mpi(2, "restartable.py", "--ckpt-dir", tmp_path / "ref", *script[3:7], "--out", tmp_path / "ref.npy")
    # the same numbers; only the all-reduce's order of summation over 2 or 1 ranks differs
    np.testing.assert_allclose(np.load(tmp_path / "w.npy"), np.load(tmp_path / "ref.npy"), rtol=1e-13)


@needs_mpi
def test_a_stop_signal_ends_an_srun_job_and_restarts_nothing(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-m", "minidist.run", "-n", "2", "--launcher", "srun", "--max-restarts",
                                 "2", "--grace", "3", "--", str(HERE / "launcher_job.py"), "sleep", str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                env=with_srun(tmp_path / "srun.log"))
    try:
        pids = rank_pids(tmp_path)
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM, stderr
    assert "stopped by SIGTERM: the job was ended" in stderr and "attempt 2" not in stderr
    assert not [pid for pid in pids if running(pid)], "a rank outlived the launcher"


@needs_mpi
@pytest.mark.skipif(mpiexec_flavour(find_mpiexec()) == "openmpi", reason="hydra's -launcher-exec (MPICH)")
def test_two_network_namespaces_joined_by_a_veth_pair_train_like_one_process(tmp_path, data_dir):
    try:
        with two_machines(tmp_path) as m:
            before = m.received_bytes(m.b)
            run = subprocess.run(m.command(sys.executable, "-m", "minidist.run", "-n", 4, "--hostfile",
                                           m.hostfile(tmp_path / "hosts"), "--launcher-args", *m.hydra_args(), "--",
                                           "-m", "minidist.train", "--dp", 2, "--tp", 2, *flags(SIZES),
                                           "--data-dir", data_dir, "--export", tmp_path / "w.npz"),
                                 capture_output=True, text=True, cwd=REPO, timeout=120, env={**os.environ, **TCP_ONLY})
            crossed = m.received_bytes(m.b) - before
    except Unavailable as e:
        pytest.skip(f"no network namespaces here: {e}")
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"  2 machines (rehearsed on one host, {socket.gethostname()}): ranks 0-1 on machine 0, ranks 2-3 on " \
           "machine 1; tp groups inside a machine, dp groups across 2 machines" in run.stdout.splitlines()
    params = int(run.stdout.split(" parameters on rank 0")[0].split()[-1].replace(",", ""))
    # every step, ranks 0 and 1 send their gradients (float64) to ranks 2 and 3 across the pair
    assert crossed >= SIZES["steps"] * 2 * 8 * params, (crossed, params)
    assert_like(dict(np.load(tmp_path / "w.npz")), one_process(tmp_path, data_dir))


def test_a_checkpoint_folder_that_another_machine_does_not_see_is_refused_on_every_rank(tmp_path):
    """Rank 1 plays a machine whose --ckpt-dir is a folder of its own (not a shared file system):
    it does not find rank 0's lock token there, and every rank refuses before anything is saved."""
    def hold(folder_of_rank, machines):
        def body(world):
            cfg = TrainConfig(ckpt_dir=str(folder_of_rank(world.rank)))
            with held_folders(cfg, world, machines):
                return "held"
        return run_local(body, 2)

    with pytest.raises(FolderNotShared, match=r"rank 1 \(machine 1\) does not find in it the lock rank 0 holds"):
        hold(lambda rank: tmp_path / ("ckpt" if rank == 0 else "its-own-disk"), Machines((0, 1)))
    assert hold(lambda rank: tmp_path / "ckpt", Machines((0, 1))) == ["held", "held"]  # shared: one folder
    assert hold(lambda rank: tmp_path / f"ckpt{rank}", one_machine(2)) == ["held", "held"]  # one machine: not asked
