"""The restarting launcher: ``python -m minidist.run -n N [options] -- script args...``.

It runs ``mpiexec -n N python script args...`` (the ``mpiexec`` installed beside this Python, e.g.
by the pip ``mpich`` wheel, else the one on PATH), or with ``--launcher srun`` Slurm's ``srun -n N
...`` inside an allocation, with an optional time limit. The job leaves this machine through the
launcher's own options: ``--hostfile F`` (given to mpiexec as MPICH's ``-f F`` or Open MPI's
``--hostfile F``), and anything after ``--launcher-args`` up to the ``--`` goes to the launcher as
it is (``--launcher-args -ppn 2``, ``--launcher-args --mpi=pmix``). Each rank takes its share of its
own machine's cores for BLAS threads (``minidist/threads.py``, from MPI's shared-memory split):
the launcher sets no ``OMP_NUM_THREADS``, which it could not size for the other machines.

When the job fails (a rank died or raised: MPI then ends every rank, so the launcher exits
non-zero; a collective timed out; or the time limit passed), it says why and starts the WHOLE job
again: with ``--resume`` added when ``latest_valid`` finds a checkpoint in the script's
``--ckpt-dir`` (the script continues from it), else from the start without ``--resume``. A job keeps
no state outside its checkpoints, so restarting every rank is simpler and safer than patching a
running job (torchrun's elastic agent does the same). ``--elastic-n M`` restarts on M ranks instead:
the checkpoint reshards on load; write ``{n}`` in the script's arguments where the rank count
belongs (``--dp {n}``). On several machines ``--ckpt-dir`` must be a folder every machine sees
(a shared file system), since the launcher looks for the checkpoint on this one.

Four failures are never retried, since a restart would fail the same way: a configuration the job
refused (exit status 2), ranks calling different collectives (exit status 4, a bug), a run that
diverged (exit status 5: a NaN or inf loss; its newest checkpoint is from before the divergence, and
resuming it with the same settings would diverge again, so it is treated like 2, not as a crash to
retry), and mpiexec refusing the job itself: exit status 255 (MPICH's hydra and Open MPI's code for
their own errors) before any rank started (:func:`run_job`: with every rank on this machine, no rank
was ever seen; with other machines named, whose ranks it cannot see, mpiexec started no process at
all, no proxy, no ssh), which ends the launcher with 2, a configuration refused. A collective that
timed out (3) and a rank that died are retried. SIGTERM,
SIGHUP and SIGINT (Ctrl-C) stop the launcher: it passes the signal to the whole job (the launcher
and every rank it started here; mpiexec and srun pass it on to the other machines), kills what is
left after ``--grace`` seconds, restarts nothing, and exits with 128 + the signal's number, as a
shell reports a process the signal ended.

Bad input is refused before anything starts (exit 2, one message): a job kept on this machine (no
``--hostfile``, no ``--launcher-args``, not ``srun``) of more ranks than it can start
(:data:`MAX_RANKS`, or fewer where its available memory holds fewer: :func:`startable_ranks`), more
than :data:`MAX_RESTARTS` restarts, a ``--grace`` over :data:`MAX_GRACE`, a hostfile or launcher
arguments that name a machine or a slot count mpiexec would choke on (minidist/hosts.py), srun not
found, and a job python could not start (:func:`job_problem`: a missing script, a FIFO python would
wait on, a module not found).

    python -m minidist.run -n 4 --max-restarts 2 -- -m minidist.train --dp 4 --ckpt-dir ckpt --save-every 50
    python -m minidist.run -n 8 --hostfile hosts -- -m minidist.train --dp 2 --tp 4 --ckpt-dir /shared/ckpt
    python -m minidist.run -n 16 --launcher srun --launcher-args --mpi=pmix -- -m minidist.train --dp 4 --tp 4
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.machinery
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time

from minidist.checkpoint.reader import latest_valid
from minidist.comm.transport import EXIT_COMM_TIMEOUT, EXIT_CONFIG, EXIT_DIVERGED, EXIT_MISMATCH
from minidist.hosts import MAX_SLOTS, hostfile_problem, launcher_args_problem, names_machines
from minidist.launchers import (LAUNCHERS, SRUN_MISSING, fault_tolerance_launch, find_mpiexec, job_command,
                                launcher_command, mpiexec_flavour, script_value)
from minidist.process_tree import descendants, signal_processes, started, wait_gone

MAX_RANKS = MAX_SLOTS
"""The most ranks the launcher starts on this machine alone (no hosts given: every rank is a process
of this machine, and a CPU rank of minidist wants a core's share to make progress); the same bound
as each machine of a hostfile's slots (minidist/hosts.py)."""
LAUNCHER_ARGS = "--launcher-args"
"""Everything after it, up to ``--``, goes to the launcher as it is."""
RANK_BYTES = 64 << 20
"""The least memory a rank holds: Python with NumPy, mpi4py and minidist imported (about 57 MiB)."""
MAX_GRACE = 3600.0
"""The longest ``--grace``: a job that ignores its stop signal for an hour will not end by itself."""
MAX_RESTARTS = 1000
"""The most restarts ``--max-restarts`` asks for: a job that failed a thousand times will not be cured."""
TIME_LIMIT = 124
"""What :func:`run_job` returns when the job ran past ``--timeout`` (the code of ``timeout(1)``)."""
LAUNCHER_ERROR = 255
"""mpiexec's exit status for an error of its own (a flag or a hostfile it refuses, a host it cannot reach)."""
STARTED_POLL = 0.005
"""Seconds between two looks for the job's first rank (or mpiexec's first process), until one is seen,
in an attempt's first 2 s (ten times that after): a rank that only starts python and exits lives
about 40 ms."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
NOT_RETRIED = {  # exit status -> what it means; a restart would end the same way
    EXIT_CONFIG: "the job refused its configuration (bad flags or data)",
    EXIT_MISMATCH: "the ranks called different collectives (a bug)",
    EXIT_DIVERGED: "the run diverged (a NaN or inf loss or gradient norm; lower --lr, or add --warmup or --grad-clip)",
}


class Stopped(Exception):
    """The launcher received one of :data:`STOP_SIGNALS`: end the job, restart nothing."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def startable_ranks() -> int:
    """How many ranks this machine can start now: :data:`MAX_RANKS`, or fewer where its available
    memory (``MemAvailable`` in /proc/meminfo) holds fewer ranks of :data:`RANK_BYTES`."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):  # not Linux: no bound but MAX_RANKS
        return MAX_RANKS
    return max(1, min(MAX_RANKS, kib * 1024 // RANK_BYTES))


def job_problem(script: list) -> str | None:
    """What keeps python from starting ``script`` (what follows ``--``), or None: found here, before
    mpiexec starts a rank. A script must be a readable regular file or a folder with ``__main__.py``
    (a FIFO would keep python waiting for a writer); ``-m`` needs a module found on the path,
    without importing it; ``-c`` needs code; anything else starting with ``-`` is a python option
    (or a script's flag) where the script goes."""
    first = script[0]
    if first in ("-m", "-c"):
        if len(script) < 2 or not script[1]:
            return f"{first} needs a {'module' if first == '-m' else 'command'} after it"
        return module_problem(script[1]) if first == "-m" else None
    if first.startswith("-"):
        return f"{first!r} where the job's script goes: give a script, -m MODULE or -c CODE first"
    if not first or not os.path.exists(first):  # os.path's tests answer False where a name is too long
        return f"script {first!r} not found"
    if os.path.isdir(first):
        return None if os.path.isfile(os.path.join(first, "__main__.py")) else f"{first} is a folder without __main__.py"
    if not os.path.isfile(first):
        return f"{first} is not a regular file (a FIFO or a device): python cannot run it"
    return None if os.access(first, os.R_OK) else f"{first}: no permission to read it"


def module_problem(name: str) -> str | None:
    """Why ``python -m name`` would not start (no such module, or a package without ``__main__``), or
    None; found by the import system's finders, without running the module or its packages."""
    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        return f"-m {name!r} is not a module name"
    where = None
    for i, part in enumerate(parts):
        try:
            spec = importlib.util.find_spec(part) if i == 0 else importlib.machinery.PathFinder.find_spec(part, where)
        except (ImportError, ValueError, OSError):
            spec = None
        if spec is None:
            return f"-m {name}: no module named {'.'.join(parts[:i + 1])}"
        where = spec.submodule_search_locations
        if where is None and i < len(parts) - 1:
            return f"-m {name}: {'.'.join(parts[:i + 1])} is not a package"
    if where is not None and importlib.machinery.PathFinder.find_spec("__main__", where) is None:
        return f"-m {name} is a package without __main__: it cannot be run"
    return None


@contextlib.contextmanager
def stop_signals():
    """Inside: SIGTERM, SIGHUP and SIGINT raise :class:`Stopped` (in the main thread) instead of
    ending or interrupting the launcher; the previous handlers come back on exit."""
    def stop(signum, frame):
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_job(cmd: list, timeout: float | None, grace: float = 5.0, rank: str | None = None) -> tuple[int, bool]:
    """Run ``cmd`` (mpiexec or srun) in its own process group; return (its exit code, whether it
    started the job): a rank (a process running ``rank``, the job's python, when every rank runs on
    this machine) or else any process of it (hydra's proxy, ssh) was seen, looked for every
    :data:`STARTED_POLL` seconds until one is (True where /proc cannot say). Past ``timeout``
    seconds the whole job is ended (:func:`end_job` with SIGTERM) and :data:`TIME_LIMIT` returned.
    On :class:`Stopped` (a signal to the launcher) the job is ended with that signal, then it is
    raised again."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    begin = time.monotonic()
    end = None if timeout is None else begin + timeout
    seen = started(proc.pid, rank) is None  # without /proc: not known, so a failure is retried as before
    try:
        while True:
            left = None if end is None else max(0.0, end - time.monotonic())
            poll = STARTED_POLL * (1 if time.monotonic() - begin < 2 else 10)  # a rank starts within a second
            try:
                return proc.wait(timeout=left if seen else poll if left is None else min(poll, left)), seen
            except subprocess.TimeoutExpired:
                if end is not None and time.monotonic() >= end:
                    end_job(proc, signal.SIGTERM, grace)
                    return TIME_LIMIT, True
                seen = bool(started(proc.pid, rank))
    except Stopped as stop:
        end_job(proc, stop.signum, grace)
        raise


def end_job(proc: subprocess.Popen, signum: int, grace: float) -> None:
    """End the job of ``proc`` (mpiexec, leader of its process group): send ``signum`` to the group
    and to every process descended from mpiexec (MPICH starts each rank in a session of its own, out
    of the group's reach; mpiexec also forwards the signal to the ranks on other hosts), wait up to
    ``grace`` seconds, then SIGKILL whatever still runs. Returns once mpiexec is reaped and none of
    its descendants runs. The stop signals are held back meanwhile, so a second Ctrl-C cannot
    interrupt the clean-up."""
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        job = signal_job(proc, [], signum)
        deadline = time.monotonic() + grace
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
        if wait_gone(job, max(0.0, deadline - time.monotonic())) or proc.poll() is None:
            say(f"the job did not end within {grace:g}s of {signal.Signals(signum).name}: killing it (SIGKILL)")
            job = signal_job(proc, job, signal.SIGKILL)
            proc.wait()
            wait_gone(job, 5.0)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def signal_job(proc: subprocess.Popen, job: list, signum: int) -> list:
    """Send ``signum`` to mpiexec's process group (while mpiexec runs: its pid is then still ours)
    and to the processes of ``job`` plus every process now descended from mpiexec; returns them all."""
    if proc.poll() is None:
        job = job + descendants(proc.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signum)
    signal_processes(job, signum)
    return job


def checkpoint_dir(script_args: list) -> str | None:
    """The value of ``--ckpt-dir`` in the script's arguments, if any."""
    return script_value(script_args, "--ckpt-dir")


def describe_exit(code: int, timeout: float | None) -> str:
    """Why a job ended, in words."""
    if code == TIME_LIMIT:
        return f"hit the time limit of {timeout:g}s (--timeout) and was ended (a hang, or too short a limit?)"
    if code == EXIT_COMM_TIMEOUT:
        return f"exited with code {code}: a collective timed out: a rank hung or was lost"
    if code in NOT_RETRIED:
        return f"exited with code {code}: {NOT_RETRIED[code]}"
    if code < 0:
        names = {s.value: s.name for s in signal.Signals}  # real-time signals 35..63 have no name
        return f"was killed by signal {names.get(-code, -code)}"
    return f"exited with code {code} (a rank died or raised)"


def build_parser() -> argparse.ArgumentParser:
    """The launcher's command line (its checks are in :func:`parse_args`)."""
    p = argparse.ArgumentParser(prog="python -m minidist.run", description=__doc__.split("\n\n")[0],
                                usage="python -m minidist.run -n N [options] -- script args...")
    p.add_argument("-n", type=int, required=True, help="ranks (MPI processes)")
    p.add_argument("--max-restarts", type=int, default=0, help="restarts after a failure before giving up")
    p.add_argument("--timeout", type=float, default=None, help="seconds each attempt may run")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds a stopped or timed-out job has to end after the signal, before SIGKILL")
    p.add_argument("--elastic-n", type=int, default=None, help="ranks to restart with (default: -n)")
    p.add_argument("--launcher", choices=LAUNCHERS, default="mpiexec",
                   help="what starts the ranks: mpiexec (MPICH, Open MPI), or Slurm's srun inside an allocation")
    p.add_argument("--hostfile", default=None,
                   help="the machines and their slots, in your MPI's format (MPICH: 'host:2' lines, Open MPI: "
                        "'host slots=2'); mpiexec only (srun takes the allocation's nodes)")
    p.add_argument(LAUNCHER_ARGS, dest="launcher_args", nargs="*", default=[], metavar="ARG",
                   help="every argument after it, up to --, goes to the launcher as it is (e.g. -ppn 2, --mpi=pmix)")
    p.add_argument("script", nargs=argparse.REMAINDER, help="after --: a script (or -m module) and its args")
    return p


def split_launcher_args(argv: list) -> tuple[list, list]:
    """(the launcher's own arguments, the rest): what follows :data:`LAUNCHER_ARGS` up to the first
    ``--``, taken out before argparse sees it (the launcher's flags start with '-' too)."""
    end = argv.index("--") if "--" in argv else len(argv)
    if LAUNCHER_ARGS not in argv[:end]:
        return [], argv
    start = argv.index(LAUNCHER_ARGS)
    return argv[start + 1:end], argv[:start] + argv[end:]


def parse_args(argv=None):
    """The launcher's arguments, checked: exit 2 with argparse's usage and one message if they are bad."""
    p = build_parser()
    extra, rest = split_launcher_args(list(sys.argv[1:] if argv is None else argv))
    args = p.parse_args(rest)
    args.launcher_args = extra
    args.script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not args.script:
        p.error("nothing to run: give the script after --, e.g. -- -m minidist.train --ckpt-dir ckpt")
    if args.n < 1 or (args.elastic_n is not None and args.elastic_n < 1):
        p.error("-n and --elastic-n must be >= 1")
    if args.hostfile is not None and args.launcher == "srun":
        p.error("--hostfile is for mpiexec: srun runs on the nodes of its Slurm allocation (choose them with "
                "sbatch/salloc --nodelist, or --launcher-args --nodelist=...)")
    if args.launcher == "srun" and shutil.which("srun") is None:
        p.error(SRUN_MISSING)
    flavour = mpiexec_flavour(find_mpiexec()) if args.launcher == "mpiexec" else None
    problem = (hostfile_problem(args.hostfile, flavour) if args.hostfile is not None else None) or \
        launcher_args_problem(args.launcher_args, args.launcher, flavour)
    if problem:
        p.error(problem)
    most = startable_ranks()
    if stays_here(args) and max(args.n, args.elastic_n or 0) > most:
        p.error(f"{max(args.n, args.elastic_n or 0):,} ranks: this machine starts at most {most} (each rank is a process "
                f"of this machine; at most {MAX_RANKS}, and {RANK_BYTES >> 20} MiB of available memory each; "
                f"give --hostfile to use several machines)")
    if not 0 <= args.max_restarts <= MAX_RESTARTS:
        p.error(f"--max-restarts must be >= 0 and at most {MAX_RESTARTS:,}, got {args.max_restarts:,}")
    if args.timeout is not None and not 0 < args.timeout < float("inf"):
        p.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if not 0 <= args.grace <= MAX_GRACE:
        p.error(f"--grace must be a number of seconds from 0 to {MAX_GRACE:g}, got {args.grace}")
    problem = job_problem([args.script[0].replace("{n}", str(args.n)), *args.script[1:]])
    if problem:
        p.error(f"the job cannot start: {problem}")
    return args


def main(argv=None) -> int:
    """Run the job, restarting it up to ``--max-restarts`` times; returns the last exit code, or
    128 + signal number when a signal stopped the launcher."""
    args = parse_args(argv)
    with stop_signals():
        try:
            return supervise(args)
        except Stopped as stop:
            say(f"stopped by {stop}: the job was ended (mpiexec and every rank); not restarting")
            return 128 + stop.signum


def stays_here(args) -> bool:
    """Whether every rank is a process of this machine: mpiexec given no hosts (no ``--hostfile``,
    no launcher arguments, which may name hosts)."""
    return args.launcher == "mpiexec" and args.hostfile is None and not args.launcher_args


def supervise(args) -> int:
    """The attempts of :func:`main`: run, and on a failure that a restart can cure, restart."""
    launcher, ckpt = launcher_command(args.launcher, args.hostfile, args.launcher_args), checkpoint_dir(args.script)
    launcher = fault_tolerance_launch(launcher, args.script)
    n, resume = args.n, False
    for attempt in range(args.max_restarts + 1):
        cmd = job_command(launcher, n, args.script, resume)
        say(f"attempt {attempt + 1}/{args.max_restarts + 1}: {' '.join(cmd)}")
        start = time.monotonic()
        here = args.hostfile is None and not names_machines(args.launcher_args)  # every rank on this machine
        code, began = run_job(cmd, args.timeout, args.grace, rank=sys.executable if here else None)
        if code == 0:
            say(f"attempt {attempt + 1} finished in {time.monotonic() - start:.1f}s")
            return 0
        if code == LAUNCHER_ERROR and not began and args.launcher == "mpiexec":
            say(f"attempt {attempt + 1}: mpiexec refused the job (exit {code} before any rank started; its own "
                "message is above): not restarting, a restart would be refused the same way")
            return EXIT_CONFIG
        say(f"attempt {attempt + 1} {describe_exit(code, args.timeout)} after {time.monotonic() - start:.1f}s")
        if code in NOT_RETRIED:
            say(f"not restarting: {NOT_RETRIED[code]}, and a restart would end the same way")
            return code
        if attempt == args.max_restarts:
            break
        n = args.elastic_n or n
        found = latest_valid(ckpt, log=say) if ckpt else None
        resume = found is not None  # --resume refuses to start without a valid checkpoint
        where = (f"with --resume from checkpoint {found}" if found else
                 f"from the start (no valid checkpoint in {ckpt}), without --resume" if ckpt else
                 "from the start (no --ckpt-dir given)")
        say(f"restart {attempt + 1}/{args.max_restarts} on {n} ranks {where}")
    say(f"giving up after {args.max_restarts} restart(s)")
    return code if code > 0 else 1


def say(line: str) -> None:
    print(f"minidist.run: {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
