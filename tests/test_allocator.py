"""The trainer's allocator setting: made by the entry point (unless --system-allocator), never by
importing the library."""
import platform
import subprocess
import sys

import pytest

import minidist.train.entry
from minidist.allocator import keep_freed_memory

TINY = ["--steps", "1", "--n-layer", "1", "--n-embd", "8", "--n-head", "2", "--block-size", "8",
        "--batch-size", "2", "--eval-iters", "1", "--sample-tokens", "0"]


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_keep_freed_memory_takes_on_glibc():
    assert keep_freed_memory() is True


@pytest.mark.parametrize("flags,calls", [([], 1), (["--system-allocator"], 0)])
def test_the_trainer_keeps_freed_memory_unless_told_not_to(monkeypatch, flags, calls):
    made = []
    monkeypatch.setattr(minidist.train.entry, "keep_freed_memory", lambda: made.append(1))
    minidist.train.entry.main(TINY + flags)
    assert len(made) == calls


def test_importing_minidist_changes_no_allocator_setting():
    """Only an entry point calls keep_freed_memory: importing every layer calls it nowhere."""
    probe = ("import sys\n"
             "import minidist.allocator\n"
             "calls = []\n"
             "minidist.allocator.keep_freed_memory = lambda: calls.append(1)\n"
             "import minidist, minidist.train, minidist.parallel, minidist.plan, minidist.inspect\n"
             "sys.exit(len(calls))\n")
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 0
