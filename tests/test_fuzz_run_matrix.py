"""``python -m minidist.run`` and ``python -m minidist.support_matrix`` fail well on hostile input
(tests/fuzz.py): exit 0 or 2 (the launcher also 124, its own --timeout), one clear message, never a
traceback, a hang or an absurd job.

The launcher refuses, before mpiexec starts anything: more ranks than this machine can start
(``minidist.run.MAX_RANKS``, or fewer where its available memory holds fewer ranks), more restarts
than ``MAX_RESTARTS``, and a job python could not start (a missing script, a folder without
``__main__.py``, a FIFO python would wait on forever, a module that cannot be found, a python option
where the script goes), and a hostfile line or a ``--launcher-args`` value mpiexec would choke on
(a slot count outside 1..MAX_SLOTS, a host name outside RFC 1123, ``-n`` given to mpiexec:
minidist/hosts.py); the fuzz also draws hostile hostfiles and launcher arguments. The support matrix refuses arguments (it takes none) and ends quietly when
its reader stops early (``| head``) and with one line when stdout is full.

The regressions below each failed before the fix; the fuzz runs ~10 cases per command here and
~200 with ``--slow``, its counts written by :class:`tests.fuzz.Tally`.
"""
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from minidist.hosts import MAX_SLOTS, hostfile_problem, launcher_args_problem
from minidist.launchers import find_mpiexec, mpiexec_flavour
from minidist.run import MAX_RESTARTS, build_parser, describe_exit, parse_args
from minidist.support_matrix import build_parser as matrix_parser
from tests.fuzz import (NUMBERS, STRINGS, Tally, argument_lists, assert_fails_well, flags_of, fuzz_settings, hostile_paths,
                        run_command)

RUN_TALLY, MATRIX_TALLY = Tally("minidist.run"), Tally("minidist.support_matrix")
ROOT = Path(tempfile.mkdtemp(prefix="minidist-fuzz-run-"))
PATHS = hostile_paths(ROOT / "paths")
OK = ROOT / "ok.py"
OK.write_text("print('ok')\n")
RUNS_ON_ITS_OWN = ("junk_file", "link_to_file")  # python starts them; the job itself fails (exit 1, relayed)


@pytest.fixture(scope="module", autouse=True)
def tallies():
    yield
    for tally in (RUN_TALLY, MATRIX_TALLY):
        if sum(tally.statuses.values()):
            tally.write()
    shutil.rmtree(ROOT, ignore_errors=True)


def launch(*args, timeout_s=30.0):
    return run_command("minidist.run", [str(a) for a in args], timeout_s=timeout_s, cwd=ROOT)


def refused_before_mpiexec(result, *words):
    """Exit 2 with one message naming ``words``, and mpiexec never started."""
    assert_fails_well(result)
    assert result.rc == 2 and "attempt 1/" not in result.stderr, result.describe()
    for word in words:
        assert word in result.stderr, result.describe()


def refused_by_the_arguments(argv, capsys, *words):
    """``parse_args(argv)`` exits 2 with argparse's usage and one message naming ``words`` (in this
    process: the launcher checks its arguments before mpiexec starts)."""
    with pytest.raises(SystemExit) as stop:
        parse_args([str(a) for a in argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.splitlines()) == 2, err
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("args", [["-n", 2147483648], ["-n", 1, "--elastic-n", 2147483648], ["-n", "1_000"],
                                  ["-n", 10 ** 9]], ids=["n-int32+1", "elastic-int32+1", "n-1_000", "n-10**9"])
def test_more_ranks_than_the_machine_can_start_are_refused(args, capsys):
    """Was: -n 2147483648 went to mpiexec as it was (hydra ran 1 rank), -n 1_000 started 1,000 processes."""
    refused_by_the_arguments([*args, "--", OK], capsys, "ranks", "at most")


def test_more_restarts_than_the_limit_are_refused(capsys):
    """Was: --max-restarts 10**19 accepted ("attempt 1/10000000000000000001"): a failing job retried forever."""
    refused_by_the_arguments(["-n", 1, "--max-restarts", 10 ** 19, "--", OK], capsys, f"at most {MAX_RESTARTS:,}")


@pytest.mark.parametrize("job, words", [
    (["fifo"], ["not a regular file"]),  # was: python opened the FIFO and waited for a writer forever
    (["missing"], ["not found"]),  # was: python's own error, 4 lines, and attempt 1 had started mpiexec
    (["dangling_link"], ["not found"]),
    (["empty_folder"], ["__main__.py"]),  # was: exit 1, "a rank died or raised"
    (["under_a_file"], ["not found"]),
    ([""], ["not found"]),  # was: python ran the current folder: exit 1
    (["-m"], ["-m needs"]),
    (["-m", "minidist.no_such_module"], ["no module named minidist.no_such_module"]),  # was: exit 1
    (["-m", "minidist"], ["__main__"]),  # a package without __main__: was exit 1
    (["-m", "1 2"], ["not a module name"]),
    (["--ckpt-dir", "ckpt"], ["a script"]),  # a script's flag where the script goes: was python's usage
    (["-"], ["a script"]),  # python would read the script from stdin
], ids=["fifo", "missing", "dangling-link", "empty-folder", "under-a-file", "empty-name", "m-alone", "m-missing",
        "m-package", "m-not-a-name", "a-flag", "stdin"])
def test_a_job_python_cannot_start_is_refused_before_mpiexec(job, words, capsys):
    refused_by_the_arguments(["-n", 2, "--", *[PATHS.get(word, word) for word in job]], capsys, "the job cannot start", *words)


def test_a_fifo_for_a_script_ends_at_once_not_never():
    """Was: a hang (mpiexec's ranks waited on the FIFO for a writer; the launcher's Ctrl-C ended them)."""
    result = launch("-n", 2, "--", PATHS["fifo"], timeout_s=20)
    assert not result.timed_out, result.describe()
    refused_before_mpiexec(result, "not a regular file")


def test_a_job_killed_by_a_signal_without_a_name_is_described():
    """Was: ValueError from signal.Signals(40) (real-time signals 35..63 have no name)."""
    assert describe_exit(-40, None) == "was killed by signal 40"
    assert describe_exit(-9, None) == "was killed by signal SIGKILL"


def test_a_folder_with_main_and_a_module_still_run():
    (ROOT / "app").mkdir(exist_ok=True)
    (ROOT / "app" / "__main__.py").write_text("print('app')\n")
    for job in (["app"], ["-m", "json.tool", "--help"], ["-c", "print(1)"]):
        result = launch("-n", 1, "--", *job)
        assert result.rc == 0 and "attempt 1 finished" in result.stderr, result.describe()


# --- hostfiles and launcher arguments (minidist/hosts.py)


REFUSED_LINES = {  # was: each accepted, and mpiexec spun forever, died of SIGFPE or exited 255
    "hydra": ["localhost:100000000000000000000", "localhost:0", "localhost:-5", f"localhost:{MAX_SLOTS + 1}",
              "localhost:1e20", "localhost:+2", "localhost:1:2", "localhost slots=0", "localhost slots=-5",
              "localhost slots=1e20", "localhost:2 map=x", "local_host:2", "-node:2", "node-:2", "a..b:2",
              "x" * 64 + ":2", "é:2", "0:2", "0x10:2", "node-1.example.invalid:2"],
    "openmpi": ["localhost slots=0", "localhost slots=-5", "localhost slots=1e20", "localhost slots=100000000000000000000",
                f"localhost slots={MAX_SLOTS + 1}", "localhost max_slots=0", "localhost colour=2", "localhost slots",
                "localhost:2", "bad_host slots=2", "1e-300 slots=2", "node-1.example.invalid"],
}
ACCEPTED_LINES = {  # (names this machine resolves: a name that does not is refused too)
    "hydra": ["localhost:2", "localhost", f"{socket.gethostname()}:8 binding=core", "127.0.0.1:4",
              f"localhost:{MAX_SLOTS} user=me"],
    "openmpi": ["localhost slots=2 max_slots=4", socket.gethostname(), f"localhost slots={MAX_SLOTS}",
                "127.0.0.1 max-slots=2 user=me"],
}
FLAVOUR = "openmpi" if mpiexec_flavour(find_mpiexec()) == "openmpi" else "hydra"


@pytest.mark.parametrize("flavour", ["hydra", "openmpi"])
def test_a_hostfile_line_that_is_not_one_machine_is_refused_naming_the_file_and_the_line(flavour, tmp_path):
    hosts = tmp_path / "hosts"
    for line in REFUSED_LINES[flavour]:
        hosts.write_text(f"{ACCEPTED_LINES[flavour][0]}\n# a comment\n{line}  # its own comment\n")
        problem = hostfile_problem(str(hosts), flavour)
        assert problem is not None and f"--hostfile {hosts}: line 3 is not a machine" in problem, (line, problem)
    hosts.write_text("\n".join(ACCEPTED_LINES[flavour]) + "\n")
    assert hostfile_problem(str(hosts), flavour) is None


@pytest.mark.parametrize("line", REFUSED_LINES[FLAVOUR][:6])
def test_a_hostfile_mpiexec_would_choke_on_is_refused_before_it_starts(line, capsys):
    """At the command line, in this machine's mpiexec's own format: exit 2, one message."""
    hosts = ROOT / "hosts-refused"
    hosts.write_text(line + "\n")
    refused_by_the_arguments(["-n", 2, "--hostfile", hosts, "--", OK], capsys, f"--hostfile {hosts}: line 1")


@pytest.mark.parametrize("args, words", [
    (["-n", "4"], "the number of ranks is minidist.run's own -n"),
    (["-np", "100000000000000000000"], "the number of ranks is minidist.run's own -n"),
    (["-ppn", "0"], "'0' is not a number of slots"),  # was: mpiexec died of SIGFPE, and the job was retried
    (["-ppn", "1e20"], "'1e20' is not a number of slots"),
    (["--ppn=-5"], "'-5' is not a number of slots"),
    (["-hosts", "localhost:0"], "'0' is not a number of slots"),  # was: SIGFPE
    (["--host", "localhost:2,node_2:2"], "'node_2' is not a host name"),
    (["--host", "localhost:100000000000000000000"], "is not a number of slots"),
    (["-hosts", "0"], "'0' is not a host name"),  # was: ssh to 0.0.0.0, exit 255, retried as a failed job
    (["-hosts", "inf"], "'inf': no such host"),
    (["-f", "no-such-file"], "-f no-such-file: no such file"),
    (["-ppn"], "-ppn needs a value"),
], ids=["n", "np", "ppn-0", "ppn-1e20", "ppn-negative", "hosts-0", "host-name", "host-slots", "host-a-number",
        "host-unknown", "f-missing", "ppn-alone"])
def test_launcher_arguments_that_can_be_checked_are(args, words, capsys):
    refused_by_the_arguments(["-n", 2, "--launcher-args", *args, "--", OK], capsys, "--launcher-args", words)


def test_launcher_arguments_left_to_the_launcher_pass_and_srun_has_its_own():
    for args in (["-ppn", "2"], ["--host", f"localhost:2,{socket.gethostname()}:2"], ["--bind-to", "core"],
                 ["-genv", "X", "1"]):
        assert parse_args(["-n", "2", "--launcher-args", *args, "--", str(OK)]).launcher_args == args
    assert "minidist.run's own -n" in launcher_args_problem(["--ntasks=4"], "srun", None)
    assert "is not a number of slots" in launcher_args_problem(["--ntasks-per-node", "0"], "srun", None)
    assert launcher_args_problem(["--mpi=pmix", "-N", "2"], "srun", None) is None


# --- the support matrix


def matrix(*args, stdout=subprocess.PIPE):
    """``python -m minidist.support_matrix *args`` with its table made fast (a long fake one): only
    the command line and the writing are under test here."""
    code = ("import runpy, sys, minidist.train.support_matrix as m; "
            "m.markdown = m.summary = lambda: '| row |\\n' * 100000; "
            "sys.argv[1:] = " + repr(list(args)) + "; runpy.run_module('minidist.support_matrix', run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], stdout=stdout, stderr=subprocess.PIPE, text=True,
                          timeout=60, cwd=ROOT)


def test_the_support_matrix_refuses_arguments():
    """Was: every argument ignored, exit 0 (after 10-40 s of work)."""
    done = matrix("--bogus", "x")
    assert done.returncode == 2 and "unrecognized arguments: --bogus x" in done.stderr, done.stderr


def test_the_support_matrix_ends_quietly_when_its_reader_stops_early():
    """Was: BrokenPipeError, a traceback and exit 1 under ``| head -1``."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = matrix(stdout=write)
    finally:
        os.close(write)
    assert done.returncode == 0 and not done.stderr, done.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_the_support_matrix_says_in_one_line_that_stdout_is_full():
    """Was: OSError (No space left on device), a traceback and exit 1."""
    with open("/dev/full", "w") as full:
        done = matrix(stdout=full)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.splitlines()) == 1 and "No space left on device" in done.stderr, done.stderr


# --- the fuzz


JOBS = st.one_of(
    st.just([str(OK)]), st.just([str(OK)]),
    st.tuples(st.sampled_from(["--ckpt-dir", "{n}", "--resume"] + list(STRINGS[:6])),
              st.sampled_from(list(PATHS.values()) + ["{n}"])).map(lambda extra: [str(OK), *extra]),
    st.sampled_from([kind for kind in PATHS if kind not in RUNS_ON_ITS_OWN]).map(lambda kind: [PATHS[kind]]),
    st.sampled_from([["-m"], ["-m", ""], ["-m", "minidist.nope"], ["-m", "minidist"], ["-m", "os..path"], ["-c"],
                     ["-c", "pass"], [""], ["-"], ["-x"], ["--"], []]))
"""What follows ``--``: mostly a script that exits 0 (with stray arguments), else a hostile path or a
broken ``-m``/``-c``; never a script that python starts and that fails by itself (its exit status
is the job's, relayed)."""


HOSTFILES = {}  # a hostile hostfile per refused line, in this machine's mpiexec's format (and one sound one)
for _i, _line in enumerate(REFUSED_LINES[FLAVOUR] + ACCEPTED_LINES[FLAVOUR][:1]):
    HOSTFILES[_line] = ROOT / f"hosts-{_i}"
    HOSTFILES[_line].write_text(_line + "\n")
HOST_VALUES = tuple(f"{host}:{n}" for host in ("localhost", "bad_host", "-x", "a..b") for n in NUMBERS[:12]) + STRINGS[:6]
"""What --host may be given: this machine or a name RFC 1123 refuses, with an extreme slot count
(never another machine's name: mpiexec would try to reach it)."""


def hostile_launcher_args():
    """``--launcher-args`` and a flag minidist/hosts.py checks, with an extreme value: a count, a host
    list, a path."""
    # (only flags it checks: an unchecked one's hostile value makes mpiexec fail in its own ways, after it started)
    flag = st.sampled_from(["-n", "-np", "-ppn", "--ppn", "-hosts", "--host", "-f"])
    value = st.one_of(st.sampled_from(NUMBERS), st.sampled_from(HOST_VALUES), st.sampled_from(sorted(PATHS.values())),
                      st.sampled_from([str(p) for p in HOSTFILES.values()]))
    return st.tuples(flag, value).map(lambda fv: ["--launcher-args", *fv])


def launcher_arguments():
    """Launcher flags with extreme values (mostly after a sound ``-n``), now and then a hostile
    hostfile or hostile ``--launcher-args``, then (mostly) ``--`` and a job."""
    flags = argument_lists(flags_of(build_parser(), skip=("--help", "--launcher-args")), PATHS)
    hosts = st.one_of(st.just([]), st.just([]), st.sampled_from(sorted(HOSTFILES.values())).map(lambda p: ["--hostfile", str(p)]),
                      hostile_launcher_args())
    return st.tuples(st.sampled_from([["-n", "2"], ["-n", "1"], []]), flags, hosts, st.sampled_from([["--"], ["--"], []]),
                     JOBS).map(lambda parts: [word for part in parts for word in part])


def launcher_fails_well(result):
    """:func:`assert_fails_well`, where 124 is the launcher's own --timeout (documented, said as such)
    and a run killed at the fuzz's limit passes if it was restarting attempts."""
    if result.rc == 124:
        assert "--timeout" in result.args and "(--timeout)" in result.stderr, result.describe()
        assert "Traceback" not in result.stderr, result.describe()
    else:
        assert_fails_well(result, working=lambda r: "minidist.run: attempt" in r.stderr)


def fuzz_the_launcher(args):
    result = run_command("minidist.run", args, timeout_s=60, cwd=ROOT)
    launcher_fails_well(result)
    RUN_TALLY.add(result)


@fuzz_settings(10)
@given(launcher_arguments())
def test_the_launcher_fails_well_on_hostile_arguments(args):
    fuzz_the_launcher(args)


@pytest.mark.slow
@fuzz_settings(200)
@given(launcher_arguments())
def test_the_launcher_fails_well_on_hostile_arguments_long(args):
    fuzz_the_launcher(args)


def matrix_arguments():
    """It takes no value: any words (numbers, strings, paths, a flag of another command) and now
    and then its flags, ``--markdown`` and ``--help``."""
    assert [f.option for f in flags_of(matrix_parser())] == ["--markdown"]
    words = st.sampled_from(NUMBERS + STRINGS + tuple(PATHS.values()) + ("--help", "-h", "--markdown", "--steps",
                                                                        "--json"))
    return st.lists(words, max_size=4)


def slow_to_accept(args):
    """The lists it accepts and so computes the whole matrix for (10-40 s on 2 cores): [], ["--"],
    ``--markdown`` (repeated), before or without ``--``."""
    return "--help" not in args and "-h" not in args and all(a == "--markdown" for a in args[:-1]) and (
        not args or args[-1] in ("--", "--markdown"))


def fuzz_the_matrix(args):
    result = run_command("minidist.support_matrix", args, timeout_s=120, cwd=ROOT)
    assert_fails_well(result)
    MATRIX_TALLY.add(result)


@fuzz_settings(10)
@given(matrix_arguments())
def test_the_support_matrix_fails_well_on_hostile_arguments(args):
    assume(not slow_to_accept(args))  # the whole matrix: in the long run only
    fuzz_the_matrix(args)


@pytest.mark.slow
@fuzz_settings(200)
@given(matrix_arguments())
def test_the_support_matrix_fails_well_on_hostile_arguments_long(args):
    fuzz_the_matrix(args)
