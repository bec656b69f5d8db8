"""Every lesson (tutorials/NN_*.py) fails well on hostile input (tests/fuzz.py): exit 0 or 2, one
clear message, never a traceback or a hang, and a lesson started the easy wrong way says how to start
it (``minidist.launch_check.check_launch``, called by each lesson right after its arguments).

Refused at once, with exit 2 and one line saying how to start it: a world size the lesson is not
written for (``--local 0``, ``-1``, ``3`` where it splits 4 heads, 2**31 threads); a lesson that runs
in one process started under mpiexec, or ``--local`` under mpiexec; mpiexec with a world size it does not run on (printed once, by rank 0); and a
``--png`` it could not draw into (a FIFO, a folder, a link, a missing folder, a format matplotlib
does not know), found before the lesson, not after it.

The regressions below each failed before the fix (what each did then is in its comment). The fuzz
runs 8 cases over a sample of lessons here, leaving lists a lesson accepts (minutes of real lesson)
to ``--slow``, which runs 20 cases on every lesson; a case killed at its time limit passes only if
the lesson was printing its lesson. A lesson for several ranks started alone runs them as threads in
this process and says so in one line (it used to crash: a ring of one rank).
"""
import ast
import contextlib
import io
import runpy
import shutil
import sys
import tempfile
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import minidist.launch_check
from tests.fuzz import Flag, Tally, argument_lists, assert_fails_well, fuzz_settings, hostile_paths, run_script
from tests.mpi.harness import REPO, find_mpiexec, run_mpi

TUTORIALS = REPO / "tutorials"
LESSONS = sorted(p.name for p in TUTORIALS.glob("[0-9][0-9]_*.py"))
ROOT = Path(tempfile.mkdtemp(prefix="minidist-fuzz-lessons-"))  # the lessons' cwd: a relative --png lands here
PATHS = hostile_paths(ROOT / "paths")
TALLIES = {name: Tally(f"tutorial-{name[:2]}") for name in LESSONS}  # a command each
QUICK = ["01_ring_allreduce.py", "03_tensor_parallel.py", "04_pipeline.py", "07_parameter_server.py",
         "12_zero_bubble.py", "13_offload.py"]
"""The short fuzz's sample: lessons whose own code up to their check is cheap to run in this process."""


def named(prefix: str) -> str:
    return next(name for name in LESSONS if name.startswith(prefix))


def lesson_flags(name: str) -> list[Flag]:
    """The flags of a lesson's argparse parser, read from its source (``add_argument`` calls): a
    lesson is a script, and 00 runs when imported."""
    flags = []
    for node in ast.walk(ast.parse((TUTORIALS / name).read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            option = max((a.value for a in node.args if isinstance(a, ast.Constant)), key=len)
            keywords = {k.arg: k.value for k in node.keywords}
            kind = ("switch" if getattr(keywords.get("action"), "value", None) == "store_true" else
                    "int" if getattr(keywords.get("type"), "id", None) == "int" else "str")
            flags.append(Flag(option, kind))
    return flags


def lesson(name: str, *args, timeout_s: float = 60.0):
    hostile_paths(ROOT / "paths")  # as made: a lesson that ran may have drawn into one of them
    return run_script(TUTORIALS / name, [str(a) for a in args], timeout_s=timeout_s, cwd=ROOT)


def refused(output: str, rc, *words) -> None:
    """Exit 2 with one line (printed once) naming ``words``; argparse's own errors: usage and error."""
    lines = [line for line in output.splitlines() if line.strip()]
    assert rc == 2 and (len(lines) == 1 or output.count("usage:") == 1 and output.count("error:") == 1), output
    for word in words:
        assert word in output, output


@pytest.fixture(scope="module", autouse=True)
def tally():
    yield
    for tally in TALLIES.values():
        if sum(tally.statuses.values()):
            tally.write()
    shutil.rmtree(ROOT, ignore_errors=True)


# --- regressions: a world size the lesson is not written for, and a lesson started alone that needs mpiexec

WORLDS = [  # (lesson, arguments, what it did before the fix)
    ("03", ["--local", "3"], "ValueError: n_head = 4 is not divisible by tp = 3, a traceback"),
    ("12", ["--local", "1_000"], "1,000 threads, minutes of lesson (2**31: a hang)"),
    ("10", ["--local", "0"], "ran the lesson on 4 threads, exit 0"),
    ("04", ["--local", "1"], "IndexError on a pipeline of one stage"),
]
MORE_WORLDS = [
    ("01", ["--local", "2147483648"], "a hang, starting 2**31 threads"),
    ("02", ["--local", "3"], "ValueError: 3 rows cannot be cut into 2 micro-batches, CommTimeoutError"),
    ("03", ["--local", "-1"], "ValueError: world_size must be a positive int, a traceback"),
    ("04", ["--local", "3"], "ValueError: 8 micro-batches not a multiple of 3 stages, CommTimeoutError"),
    ("07", ["--local", "1"], "the same ValueError"),
    ("07", ["--local", "5"], "ValueError: batch size 6 must be divisible by the 4 workers"),
    ("11", ["--local", "3"], "AssertionError: this lesson runs on 2 or 4 ranks"),
    ("15", ["--local", "3"], "AssertionError"),
    ("15", ["--local", "-1"], "ValueError: world_size must be a positive int"),
]


ALONE = [  # (lesson, its ranks as threads, what it did started alone before the fix); the others:
    ("03", 2, "ran tensor parallelism on one rank, exit 0"),  # tests/test_tutorials.py, started alone
]


@pytest.mark.parametrize("prefix, ranks, before", ALONE, ids=[p for p, _, _ in ALONE])
def test_a_lesson_started_alone_runs_its_ranks_as_threads_and_says_so(prefix, ranks, before):
    result = lesson(named(prefix), timeout_s=120)
    assert result.rc == 0 and "Traceback" not in result.stderr, result.describe()
    said = [line for line in result.stdout.splitlines() if "started alone" in line]
    assert said == [f"{named(prefix)}: started alone, so its {ranks} ranks run as threads in this process "
                    f"(as processes: mpiexec -n {ranks} python {TUTORIALS / named(prefix)})"], result.describe()
    assert f"on {ranks} ranks" in result.stdout, result.describe()


def check_world_refused(prefix, args):
    result = lesson(named(prefix), *args, timeout_s=30)
    assert_fails_well(result)
    refused(result.stderr, result.rc, "ranks, not", "start it as")


@pytest.mark.parametrize("prefix, args, before", WORLDS, ids=[f"{p}-{' '.join(a) or 'alone'}" for p, a, _ in WORLDS])
def test_a_world_size_the_lesson_does_not_run_on_is_refused_with_how_to_start_it(prefix, args, before):
    check_world_refused(prefix, args)


@pytest.mark.slow
@pytest.mark.parametrize("prefix, args, before", MORE_WORLDS,
                         ids=[f"{p}-{' '.join(a) or 'alone'}" for p, a, _ in MORE_WORLDS])
def test_every_world_size_the_lesson_does_not_run_on_is_refused(prefix, args, before):
    check_world_refused(prefix, args)


# --- regressions: --png checked before the lesson, not after it

PNGS = [("fifo", "a FIFO", "a hang at the end: savefig waited for a reader"),
        ("missing", "does not exist", "FileNotFoundError at the end, after the whole lesson")]
MORE_PNGS = [("folder", "a folder", "IsADirectoryError at the end"),
             ("under_a_file", "not a folder", "NotADirectoryError at the end"),
             ("link_to_file", "symbolic link", "drew through the link into its target"),
             ("dev_null", "a device", "drew into /dev/null, exit 0"),
             ("x.txt", "cannot draw into a .txt", "ValueError: Format 'txt' is not supported, at the end"),
             ("", "needs a file name", "FileNotFoundError or a folder error at the end")]


def check_png_refused(kind, words):
    result = lesson(named("00"), "--png", PATHS.get(kind, kind), timeout_s=30)
    assert not result.timed_out, result.describe()
    refused(result.stderr, result.rc, "--png", words)


@pytest.mark.parametrize("kind, words, before", PNGS, ids=[k for k, _, _ in PNGS])
def test_a_png_the_lesson_could_not_draw_into_is_refused_before_the_lesson(kind, words, before):
    check_png_refused(kind, words)


@pytest.mark.slow
@pytest.mark.parametrize("kind, words, before", MORE_PNGS, ids=[k or "empty" for k, _, _ in MORE_PNGS])
def test_every_png_the_lesson_could_not_draw_into_is_refused_before_the_lesson(kind, words, before):
    check_png_refused(kind, words)


# --- regressions: under mpiexec the wrong way (each rank would run the whole lesson, or the wrong world)

MPI_RUNS = [  # (ranks, lesson, arguments, what the message says, what it did before the fix)
    (2, "14", [], "runs in one process", "two copies of the lesson, each with 8 threads, exit 0"),
    (3, "11", [], "2 or 4 ranks, not 3", "AssertionError on every rank, MPI_Abort"),
    (2, "01", ["--local", "2"], "--local runs its ranks as threads", "each rank ran its own 2 threads"),
]
MORE_MPI_RUNS = [
    (2, "00", [], "runs in one process", "two copies of the lesson"),
    (2, "06", [], "runs in one process", "two copies, each starting its own jobs"),
    (2, "09", [], "4 ranks, not 2", "part 3's rank 3 missing"),
]


def check_mpi_refused(ranks, prefix, args, words):
    run = run_mpi(ranks, TUTORIALS / named(prefix), *args, timeout=60, check=False)
    assert "Traceback" not in run.stderr, run.output
    refused(run.said, run.returncode, words, "python ")  # once: rank 0 says it, the others leave quietly


@pytest.mark.skipif(find_mpiexec() is None, reason="mpiexec not found")
@pytest.mark.parametrize("ranks, prefix, args, words, before", MPI_RUNS, ids=[f"{n}x{p}" for n, p, *_ in MPI_RUNS])
def test_a_lesson_under_mpiexec_the_wrong_way_says_how_to_start_it(ranks, prefix, args, words, before):
    check_mpi_refused(ranks, prefix, args, words)


@pytest.mark.slow
@pytest.mark.skipif(find_mpiexec() is None, reason="mpiexec not found")
@pytest.mark.parametrize("ranks, prefix, args, words, before", MORE_MPI_RUNS,
                         ids=[f"{n}x{p}" for n, p, *_ in MORE_MPI_RUNS])
def test_every_lesson_under_mpiexec_the_wrong_way_says_how_to_start_it(ranks, prefix, args, words, before):
    check_mpi_refused(ranks, prefix, args, words)


# --- the fuzz


class Accepted(Exception):
    """The lesson's own checks passed: it would start its lesson now."""


def accepted(name: str, args: list) -> bool:
    """Whether lesson ``name`` accepts ``args`` when started alone: its code run in this process up
    to its check_launch, which here stops it either way (exit 2, or :class:`Accepted`)."""
    real = minidist.launch_check.check_launch

    def check_then_stop(*a, **k):
        real(*a, **k)
        raise Accepted

    quiet = io.StringIO()
    with mock.patch.object(minidist.launch_check, "check_launch", check_then_stop), \
            mock.patch.object(minidist.launch_check, "launched_ranks", lambda: (0, 1)), \
            mock.patch.object(sys, "argv", [str(TUTORIALS / name), *args]), \
            contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        try:
            runpy.run_path(str(TUTORIALS / name), run_name="__main__")
        except Accepted:
            return True
        except SystemExit:
            return False
    raise AssertionError(f"{name} never called check_launch")


def working(result) -> bool:
    """A lesson killed at its time limit was working if it had printed its first section."""
    return bool(result.stdout.strip())


def fuzz_a_lesson(name, args, timeout_s):
    result = lesson(name, *args, timeout_s=timeout_s)
    assert_fails_well(result, working=working)
    TALLIES[name].add(result)


def lesson_and_arguments(names):
    return st.sampled_from(names).flatmap(
        lambda name: argument_lists(lesson_flags(name), PATHS, max_flags=3).map(lambda args: (name, args)))


@fuzz_settings(8)
@given(lesson_and_arguments(QUICK))
def test_a_sample_of_lessons_fails_well_on_hostile_arguments(case):
    name, args = case
    assume(not accepted(name, args))  # a lesson it accepts runs for minutes: --slow
    fuzz_a_lesson(name, args, timeout_s=30)


@pytest.mark.slow
@pytest.mark.parametrize("name", LESSONS, ids=[name[:2] for name in LESSONS])
def test_every_lesson_fails_well_on_hostile_arguments_long(name):
    @fuzz_settings(20)
    @given(argument_lists(lesson_flags(name), PATHS, max_flags=3))
    def run(args):
        fuzz_a_lesson(name, args, timeout_s=40)

    run()
