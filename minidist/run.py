"""The restarting launcher: ``python -m minidist.run -n N [--max-restarts K] -- script args...``.

It runs ``mpiexec -n N python script args...`` (the ``mpiexec`` installed beside this Python, e.g.
by the pip ``mpich`` wheel, else the one on PATH) with ``OMP_NUM_THREADS=1`` and a time limit. When
the job fails (a rank died: MPI then ends every rank, so mpiexec exits non-zero; or the time limit
passed), it says so and starts the WHOLE job again with ``--resume`` added: the script continues from
the latest valid checkpoint in its ``--ckpt-dir``. A job keeps no state outside its checkpoints, so
restarting every rank is simpler and safer than patching a running job (torchrun's elastic agent
does the same). ``--elastic-n M`` restarts on M ranks instead: the checkpoint reshards on load; write
``{n}`` in the script's arguments where the rank count belongs (``--dp {n}``).

    python -m minidist.run -n 4 --max-restarts 2 -- -m minidist.train --dp 4 --ckpt-dir ckpt --save-every 50
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from minidist.checkpoint.reader import latest_valid


def find_mpiexec() -> str:
    """``mpiexec`` beside ``sys.executable`` (a virtual environment with the ``mpich`` wheel), else on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        raise SystemExit("minidist.run: mpiexec not found beside python nor on PATH (pip install mpich)")
    return found


def job_command(mpiexec: str, n: int, script_args: list, resume: bool) -> list:
    """``mpiexec -n n python script args`` with ``{n}`` replaced by n, and ``--resume`` added once."""
    args = [a.replace("{n}", str(n)) for a in script_args]
    if resume and "--resume" not in args:
        args.append("--resume")
    return [mpiexec, "-n", str(n), sys.executable, *args]


def run_job(cmd: list, timeout: float | None) -> int:
    """Run ``cmd`` in its own process group and return its exit code; past ``timeout`` seconds the
    whole group (mpiexec and every rank) is killed and 124 returned (the code of ``timeout(1)``).
    The limit is also handed to MPICH's mpiexec (MPIEXEC_TIMEOUT)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if timeout is not None:
        env["MPIEXEC_TIMEOUT"] = str(int(timeout))
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=None if timeout is None else timeout + 5)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return 124
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        raise


def checkpoint_dir(script_args: list) -> str | None:
    """The value of ``--ckpt-dir`` in the script's arguments, if any."""
    for i, a in enumerate(script_args):
        if a == "--ckpt-dir" and i + 1 < len(script_args):
            return script_args[i + 1]
        if a.startswith("--ckpt-dir="):
            return a.split("=", 1)[1]
    return None


def describe_exit(code: int, timeout: float | None) -> str:
    """Why a job ended, in words."""
    if code == 124:
        return f"hit the time limit of {timeout:g}s (a hang?)"
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code} (a rank died or raised)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m minidist.run", description=__doc__.split("\n\n")[0],
                                usage="python -m minidist.run -n N [options] -- script args...")
    p.add_argument("-n", type=int, required=True, help="ranks (MPI processes)")
    p.add_argument("--max-restarts", type=int, default=0, help="restarts after a failure before giving up")
    p.add_argument("--timeout", type=float, default=None, help="seconds each attempt may run")
    p.add_argument("--elastic-n", type=int, default=None, help="ranks to restart with (default: -n)")
    p.add_argument("script", nargs=argparse.REMAINDER, help="after --: a script (or -m module) and its args")
    args = p.parse_args(argv)
    args.script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not args.script:
        p.error("nothing to run: give the script after --, e.g. -- -m minidist.train --ckpt-dir ckpt")
    if args.n < 1 or (args.elastic_n is not None and args.elastic_n < 1):
        p.error("-n and --elastic-n must be >= 1")
    if args.max_restarts < 0:
        p.error("--max-restarts must be >= 0")
    return args


def main(argv=None) -> int:
    """Run the job, restarting it up to ``--max-restarts`` times; returns the last exit code."""
    args = parse_args(argv)
    mpiexec, ckpt = find_mpiexec(), checkpoint_dir(args.script)
    n, resume = args.n, False
    for attempt in range(args.max_restarts + 1):
        cmd = job_command(mpiexec, n, args.script, resume)
        say(f"attempt {attempt + 1}/{args.max_restarts + 1}: {' '.join(cmd)}")
        start = time.monotonic()
        code = run_job(cmd, args.timeout)
        if code == 0:
            say(f"attempt {attempt + 1} finished in {time.monotonic() - start:.1f}s")
            return 0
        say(f"attempt {attempt + 1} {describe_exit(code, args.timeout)} after {time.monotonic() - start:.1f}s")
        if attempt == args.max_restarts:
            break
        n, resume = args.elastic_n or n, True
        found = latest_valid(ckpt, log=say) if ckpt else None
        where = (f"from checkpoint {found}" if found else
                 f"from the start (no valid checkpoint in {ckpt})" if ckpt else "(no --ckpt-dir given)")
        say(f"restart {attempt + 1}/{args.max_restarts} on {n} ranks with --resume {where}")
    say(f"giving up after {args.max_restarts} restart(s)")
    return code if code > 0 else 1


def say(line: str) -> None:
    print(f"minidist.run: {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
