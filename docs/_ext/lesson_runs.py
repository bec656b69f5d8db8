"""Every lesson run as a reader runs it: alone, in its own process, from the repository root.

    python tutorials/NN_name.py --png docs/_build/lessons/NN_name.png

Its output (stdout and stderr together, as a terminal shows them), its exit status, its time and its
picture are kept under docs/_build/lessons/ for the lesson's page. A lesson runs in a process of its
own (not inside Sphinx's) so that what it prints, its ranks' threads, the MPI jobs it starts and its
``sys.argv[0]`` are exactly what the reader sees, and no lesson's state reaches the next one.
"""
from __future__ import annotations

import os
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
    try:
        done = subprocess.run([sys.executable, *args], cwd=root, env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        output, code = done.stdout, done.returncode
    except subprocess.TimeoutExpired as stopped:
        output, code = (stopped.output or b"").decode(errors="replace") + f"\n(stopped after {timeout:.0f} s)", 124
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
