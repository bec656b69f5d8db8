"""Every lesson run as a reader runs it: alone, in its own process, from the repository root.

    python tutorials/NN_name.py --png docs/_build/lessons/NN_name.png

Its output (stdout and stderr together, as a terminal shows them), its exit status, its time and its
picture are kept under docs/_build/lessons/ for the lesson's page. A lesson runs in a process of its
own (not inside Sphinx's) so that what it prints, its ranks' threads, the MPI jobs it starts and its
``sys.argv[0]`` are exactly what the reader sees, and no lesson's state reaches the next one.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path


@dataclass
class LessonRun:
    """One lesson's run: the command, what it printed, how it ended, and its picture if it drew one."""
    name: str  # "04_pipeline"
    command: str  # as typed from the repository root
    output: str
    returncode: int
    seconds: float
    picture: Path | None

    @property
    def number(self) -> str:
        return self.name[:2]


def lesson_files(root: Path) -> list[Path]:
    """tutorials/NN_name.py, in lesson order."""
    return sorted(root.glob("tutorials/[0-9][0-9]_*.py"))


def run_one(script: Path, root: Path, runs: Path, timeout: float) -> LessonRun:
    """Run one lesson with ``--png`` into ``runs``; keep its output as ``runs/NAME.txt``."""
    name = script.stem
    png = runs / f"{name}.png"
    args = [f"tutorials/{script.name}", "--png", os.path.relpath(png, root)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    # in a session of its own, so that a lesson past its time is ended with the MPI jobs it started
    proc = subprocess.Popen([sys.executable, *args], cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:  # SIGTERM first: python -m minidist.run then ends its MPI job itself
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        output, code = (output or "") + f"\n(stopped after {timeout:g} s)", 124
    seconds = time.perf_counter() - start
    (runs / f"{name}.txt").write_text(output, encoding="utf-8")
    return LessonRun(name, "python " + " ".join(args), output, code, seconds,
                     png if png.is_file() and png.stat().st_size > 0 else None)


def run_all(root: Path, runs: Path, jobs: int, timeout: float, first: tuple[str, ...] = ()) -> dict[str, LessonRun]:
    """Every lesson, ``jobs`` at a time, the ones named in ``first`` (the longest) started first;
    ``runs`` is emptied beforehand, so no picture from an earlier build can stand in for a missing one."""
    runs.mkdir(parents=True, exist_ok=True)
    for old in runs.iterdir():
        if old.is_file():
            old.unlink()
    scripts = lesson_files(root)
    ordered = sorted(scripts, key=lambda s: (s.stem[:2] not in first, s.stem))
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        done = list(pool.map(lambda s: run_one(s, root, runs, timeout), ordered))
    return {run.name: run for run in sorted(done, key=lambda r: r.name)}


def run_problems(runs: dict[str, LessonRun], without_picture: dict[str, str]) -> list[str]:
    """What fails the build: a lesson that exited non-zero, or drew no picture without being named in
    ``without_picture`` (its number -> why it may not). One message per lesson, with its last lines."""
    problems = []
    for run in runs.values():
        if run.returncode != 0:
            tail = "\n    ".join(run.output.rstrip().splitlines()[-15:])
            problems.append(f"lesson {run.name} failed: `{run.command}` exited {run.returncode}; its last lines:\n    {tail}")
        elif run.picture is None and run.number not in without_picture:
            problems.append(f"lesson {run.name} drew no picture into {run.command.split(' --png ')[1]} (a lesson "
                            f"allowed none is named in docs/conf.py's lessons_without_picture, with why)")
    return problems
