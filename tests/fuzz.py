"""Fuzzing a command line as a careless user or an attacker would: argument lists built from a
command's real flags with extreme values, each run in a process of its own under a time and a memory
limit, and judged only by how it ends.

A command fails well when it exits 0 (it ran) or 2 (it refused, with a short message on stderr),
never with a traceback, never past its time limit unless it was visibly working, never past its
memory limit. The values come from :data:`NUMBERS`, :data:`STRINGS` and :func:`hostile_paths`: zero,
negatives, nan and inf, the largest floats and integers, empty and huge strings, paths to a file, a
folder, a link (to a file, to a folder, dangling), a FIFO and nothing.

    flags = flags_of(parser)                       # the command's own flags, from its argparse parser
    @given(argument_lists(flags, paths))           # hypothesis: lists like ["--lr", "nan", "--tp", "0"]
    def test_x(args):
        result = run_command("minidist.x", args)
        assert_fails_well(result)
        TALLY.add(result)                          # cases, exit statuses and time, for RESULTS.md
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from minidist.process_tree import descendants, signal_processes

NUMBERS = ("0", "-0", "1", "-1", "-4", "0.5", "3", "7", "64", "nan", "-nan", "inf", "-inf", "1e-300", "1e308",
           "1e400", "2147483648", str(2 ** 63), str(10 ** 20), str(10 ** 12), "-2147483649", "0x10", "1_000")
"""Numbers at and past every edge: zero, negatives, nan and inf, the tiniest and largest floats, one past
int32 and int64, values too large for any tensor, and spellings Python may or may not accept."""
STRINGS = ("", " ", "x", "-", "--", "-x", "é", "a" * 5000, "1 2", "../..", "%s%n", "${HOME}", "none", "all")
"""Strings that are not what a flag expects: empty, blank, one that looks like a flag, a non-ASCII
letter, a very long one, format and shell syntax."""
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MEMORY_BYTES = 4 << 30  # address space per case: a command that needs more must refuse first
FUZZ_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                            HealthCheck.filter_too_much, HealthCheck.data_too_large])
"""Hypothesis settings for every fuzz test: no per-example deadline (each example is a process),
derandomized (a run is repeatable), no example database (nothing written to the project)."""


def fuzz_settings(examples: int):
    """Hypothesis's settings for a fuzz test of ``examples`` cases (see :data:`FUZZ_SETTINGS`)."""
    return settings(max_examples=examples, **FUZZ_SETTINGS)


@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag of a command: its long option, what it takes (``switch``, ``int``, ``float``,
    ``str`` or ``choice``) and, for a choice, the values it accepts."""
    option: str
    kind: str
    choices: tuple = ()


def flags_of(parser: argparse.ArgumentParser, skip=("--help",)) -> list[Flag]:
    """Every optional flag of ``parser`` (argparse's own action list), but ``skip``, as :class:`Flag`s."""
    found = []
    for action in parser._actions:
        if not action.option_strings:
            continue
        option = max(action.option_strings, key=len)
        if option in skip or isinstance(action, argparse._HelpAction):
            continue
        if action.nargs == 0:
            kind = "switch"
        elif action.choices:
            kind = "choice"
        elif action.type in (int, float):
            kind = action.type.__name__
        else:
            kind = "str"
        found.append(Flag(option, kind, tuple(str(c) for c in (action.choices or ()))))
    return found


def hostile_paths(root: Path) -> dict[str, str]:
    """Make, under ``root``, one of each kind of path a careless argument names, and return them by
    kind: an empty file, a file of junk, a folder, an empty folder, links to each and a dangling one,
    a link to a folder, a FIFO (opening it for reading would block), a path under a file, a missing
    path and ``/dev/null``."""
    root.mkdir(parents=True, exist_ok=True)
    made = {"empty_file": root / "empty.txt", "junk_file": root / "junk.bin", "folder": root / "folder",
            "empty_folder": root / "empty", "link_to_file": root / "link-file", "link_to_folder": root / "link-folder",
            "dangling_link": root / "dangling", "fifo": root / "fifo", "under_a_file": root / "junk.bin" / "x",
            "missing": root / "missing" / "deeper"}
    made["empty_file"].write_bytes(b"")
    made["junk_file"].write_bytes(bytes(range(256)) * 64 + b"\n{\"step\": 1,")
    made["folder"].mkdir(exist_ok=True)
    (made["folder"] / "config.json").write_text("{" * 3000)
    made["empty_folder"].mkdir(exist_ok=True)
    for link, target in (("link_to_file", made["junk_file"]), ("link_to_folder", made["folder"]),
                         ("dangling_link", root / "nowhere")):
        if not made[link].is_symlink():
            made[link].symlink_to(target)
    if not made["fifo"].exists():
        os.mkfifo(made["fifo"])
    paths = {kind: str(path) for kind, path in made.items()}
    paths["dev_null"] = os.devnull
    return paths


def values_for(flag: Flag, paths: dict[str, str]):
    """A hypothesis strategy of values for ``flag``: mostly of its own kind at the edges, sometimes
    anything else (a string where a number goes, a path where a choice goes)."""
    anything = st.sampled_from(NUMBERS + STRINGS + tuple(paths.values()))
    if flag.kind == "choice":
        own = st.sampled_from(flag.choices)
    elif flag.kind in ("int", "float"):
        own = st.sampled_from(NUMBERS)
    else:
        own = st.sampled_from(tuple(paths.values()) + STRINGS + NUMBERS[:4])
    return st.one_of(own, own, own, anything)


def argument_lists(flags: list[Flag], paths: dict[str, str], max_flags: int = 5):
    """A hypothesis strategy of argument lists for a command with ``flags``: up to ``max_flags``
    flags (repeats allowed), each with a value from :func:`values_for` (switches take none), and
    now and then a flag's value missing or a stray word."""
    def one(flag: Flag):
        if flag.kind == "switch":
            return st.just([flag.option])
        with_value = values_for(flag, paths).map(lambda value: [flag.option, value])
        return st.one_of(*([with_value] * 9 + [st.just([flag.option])]))

    single = st.sampled_from(flags).flatmap(one)
    stray = st.sampled_from(STRINGS[2:6] + NUMBERS[:3]).map(lambda word: [word])
    weighted = st.one_of(*([single] * 9 + [stray]))
    return st.lists(weighted, max_size=max_flags).map(lambda parts: [word for part in parts for word in part])


@dataclasses.dataclass
class Result:
    """How one run of a command ended: its arguments, exit status (None if it was killed at its time
    limit), output, seconds, and whether it ran out of time."""
    args: list
    rc: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool

    def describe(self) -> str:
        tail = "\n".join(self.stderr.splitlines()[-15:])
        return f"args {self.args!r}: exit {self.rc}, {self.seconds:.1f} s, timed out {self.timed_out}\n{tail}"


def run_command(module: str, args: list, timeout_s: float = DEFAULT_TIMEOUT_S,
                memory_bytes: int = DEFAULT_MEMORY_BYTES, cwd=None, stdin=subprocess.DEVNULL, script=None) -> Result:
    """Run ``python -m module *args`` (or ``python script *args``, :func:`run_script`) in a session of its
    own, with at most ``memory_bytes`` of address space and ``timeout_s`` seconds; at the limit the whole
    session is killed, and every process descended from it. One thread per BLAS. Without ``cwd`` it runs
    in a fresh temporary folder, so the relative paths a fuzz invents never land in the project."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="")
    with tempfile.TemporaryDirectory(prefix="minidist-fuzz-cwd-") as scratch:  # relative paths land here
        return _run(module, args, timeout_s, limit, cwd if cwd is not None else scratch, stdin, script, env)


def _run(module, args, timeout_s, limit, cwd, stdin, script, env) -> Result:
    start = time.perf_counter()
    target = ["-u", str(Path(script).resolve())] if script is not None else ["-m", module]
    proc = subprocess.Popen([sys.executable, *target, *map(str, args)], cwd=cwd, stdin=stdin,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                            env=env, preexec_fn=limit, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        escaped = descendants(proc.pid)  # in sessions of their own (mpiexec's ranks): out of killpg's reach,
        os.killpg(proc.pid, signal.SIGKILL)  # and holding the output pipes open
        signal_processes(escaped, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    return Result(list(args), None if timed_out else proc.returncode, out, err, time.perf_counter() - start, timed_out)


def run_script(path, args: list, **limits) -> Result:
    """Run ``python -u path *args`` (a lesson is a script, not a module) as :func:`run_command` runs a
    module; unbuffered, so that a run killed at its time limit shows how far it got."""
    return run_command("", args, script=path, **limits)


def assert_fails_well(result: Result, working=None, max_message_lines: int = 40) -> None:
    """Assert that ``result`` ended well: exit 0, or exit 2 with a short message on stderr; never a
    traceback, never killed by a signal, never another exit status. A run killed at its time limit
    passes only if ``working(result)`` says its output shows it was doing its job (a long training
    run is not a hang)."""
    assert "Traceback (most recent call last)" not in result.stderr + result.stdout, result.describe()
    if result.timed_out:
        assert working is not None and working(result), "no exit and no sign of work: " + result.describe()
        return
    assert result.rc in (0, 2), result.describe()
    if result.rc == 2:
        assert result.stderr.strip(), "exit 2 without a message: " + result.describe()
        assert len(result.stderr.splitlines()) <= max_message_lines, "not one clear message: " + result.describe()


class Tally:
    """Counts of a fuzz test's cases for benchmarks/RESULTS.md: cases, exit statuses, seconds. The
    summary is written to ``<tmp>/minidist-fuzz/<name>.json`` when the test module ends."""

    def __init__(self, name: str):
        self.name, self.statuses, self.seconds, self.slowest = name, collections.Counter(), 0.0, 0.0

    def add(self, result: Result) -> None:
        self.statuses["timed out, working" if result.timed_out else f"exit {result.rc}"] += 1
        self.seconds += result.seconds
        self.slowest = max(self.slowest, result.seconds)

    def write(self) -> Path:
        folder = Path(tempfile.gettempdir()) / "minidist-fuzz"
        folder.mkdir(exist_ok=True)
        path = folder / f"{self.name}.json"
        path.write_text(json.dumps({"command": self.name, "cases": sum(self.statuses.values()),
                                    "statuses": dict(self.statuses), "seconds": round(self.seconds, 1),
                                    "slowest_s": round(self.slowest, 1)}, indent=1))
        return path
