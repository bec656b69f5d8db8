"""A run's folders and files (issue 35, parts 1 and 4): a second run on a held ``--ckpt-dir`` or
``--offload-dir`` is refused at start-up naming the holder, a dead holder's lock is taken over, no
file is written through a planted link or into a linked folder, a full disk is a message naming the
file (not SIGBUS), and every output path is checked before the first step. Each test reproduces a
defect of the trainer before this change."""
import os
import queue
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from minidist.checkpoint.format import step_dirs
from minidist.files import NoSpace, PathRefused, create, real_folder, write_atomically
from minidist.folder_lock import FolderInUse, FolderLock
from minidist.parallel.zero.offload import DiskFiles

SMALL = ["--steps", "2", "--eval-every", "1", "--eval-iters", "1", "--sample-tokens", "0", "--n-layer", "1"]
HOLD = "import sys, time; from minidist.folder_lock import FolderLock; FolderLock(sys.argv[1]); print('held', flush=True); time.sleep(600)"


def trainer(*args, data_dir, preexec_fn=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "minidist.train", "--data-dir", data_dir, *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, preexec_fn=preexec_fn,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def holder(folder):
    """Another process holding ``folder``, started and holding when this returns."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def assert_refused(done, *words):
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "step " not in done.stdout, done.stderr
    for word in words:
        assert word in done.stderr, done.stderr


# ---- part 1: concurrent runs --------------------------------------------------------------------------


def test_lock_is_refused_while_held_and_free_once_released(tmp_path):
    first = FolderLock(tmp_path / "ckpt", "--ckpt-dir")
    with pytest.raises(FolderInUse, match=rf"--ckpt-dir .* in use by another run \(pid {os.getpid()} on host "):
        FolderLock(tmp_path / "ckpt", "--ckpt-dir")
    first.release()
    FolderLock(tmp_path / "ckpt").release()


def background_trainer(*args, data_dir):
    return subprocess.Popen([sys.executable, "-m", "minidist.train", "--data-dir", data_dir, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))


def printed(proc, text: str, timeout: float = 180.0) -> bool:
    """Whether ``proc`` prints a line holding ``text`` within ``timeout`` seconds (read on a thread,
    so a run that never prints it cannot hang the test)."""
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if text in lines.get(timeout=max(0.0, deadline - time.monotonic())):
                return True
        except queue.Empty:
            return False
    return False


def test_a_second_training_on_a_held_ckpt_dir_is_refused_and_a_dead_holders_lock_taken_over(tmp_path, data_dir):
    # Before: both runs trained, each deleting the other's save in progress; one died of FileNotFoundError.
    ckpt = tmp_path / "ckpt"
    endless = [*SMALL, "--steps", 100000, "--eval-every", 100000, "--ckpt-dir", ckpt, "--save-every", 1, "--keep", 2]
    first = background_trainer(*endless, data_dir=data_dir)
    try:
        while not step_dirs(ckpt):  # the first run holds the folder and has saved
            assert first.poll() is None, first.stderr.read()
            time.sleep(0.2)
        second = trainer(*SMALL, "--seed", 1, "--ckpt-dir", ckpt, "--save-every", 1, data_dir=data_dir)
        assert_refused(second, f"pid {first.pid} on host {socket.gethostname()}", "--ckpt-dir")
    finally:
        first.kill()
        first.wait()
    # killed with -9, the first run's lock is free again: a restart takes it over and resumes
    again = background_trainer(*endless, "--resume", data_dir=data_dir)
    try:
        assert printed(again, "resumed from"), "the restart did not resume"
    finally:
        again.kill()
        again.wait()


def test_a_held_offload_dir_is_refused(tmp_path, data_dir):
    other = holder(tmp_path / "offload" / "rank0")
    try:
        done = trainer(*SMALL, "--offload", "optimizer", "--offload-dir", tmp_path / "offload", data_dir=data_dir)
        assert_refused(done, f"pid {other.pid}", "--offload-dir")
    finally:
        other.kill()
        other.wait()
    assert trainer(*SMALL, "--offload", "optimizer", "--offload-dir", tmp_path / "offload", data_dir=data_dir).returncode == 0


# ---- part 4: files written without following links, space reserved, paths checked at start-up --------------


def test_a_link_planted_at_a_store_file_is_refused_and_its_target_untouched(tmp_path, data_dir):
    # Before: the memory-mapped store was written through the link, overwriting its target.
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    rank = tmp_path / "offload" / "rank0"
    rank.mkdir(parents=True)
    for unit in ["transformer.wte", "transformer.h.0"]:
        for slot in ["master", "exp_avg", "exp_avg_sq"]:
            (rank / f"{unit}.{slot}.bin").symlink_to(victim)
    done = trainer(*SMALL, "--offload", "optimizer", "--offload-dir", tmp_path / "offload", data_dir=data_dir)
    assert_refused(done, "is a symbolic link")
    assert victim.read_bytes() == b"precious"


def test_a_rank_folder_that_is_a_link_is_refused_and_nothing_created_in_its_target(tmp_path, data_dir):
    # Before: the link was followed and the stores created in its target.
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "offload").mkdir()
    (tmp_path / "offload" / "rank0").symlink_to(target, target_is_directory=True)
    done = trainer(*SMALL, "--offload", "optimizer", "--offload-dir", tmp_path / "offload", data_dir=data_dir)
    assert_refused(done, "not a folder")
    assert list(target.iterdir()) == []


FULL_DISK = """import errno, os, runpy, sys
def full(fd, offset, length):
    raise OSError(errno.ENOSPC, "No space left on device")
os.posix_fallocate = full  # the disk is full: every reservation fails as it would with ENOSPC
sys.argv = ["minidist.train", *sys.argv[1:]]
runpy.run_module("minidist.train", run_name="__main__")
"""


def test_a_full_disk_is_a_message_naming_the_store_not_sigbus(tmp_path, data_dir):
    # Before: stores were sparse files written through their mappings, so a full disk killed the
    # trainer with SIGBUS and no message. Now each store's blocks are reserved before it is mapped.
    done = subprocess.run([sys.executable, "-c", FULL_DISK, "--data-dir", data_dir, *SMALL, "--offload", "optimizer",
                           "--offload-dir", str(tmp_path / "offload")], capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "cannot reserve" in done.stderr and ".bin" in done.stderr, done.stderr


def test_reserve_raises_no_space_naming_the_file(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(NoSpace, match=r"x\.bin: cannot reserve 4,000 bytes on its disk \(No space left on device\)"):
        DiskFiles(tmp_path, 0).array("x", 1000, np.float32)


def test_files_are_created_without_following_links_or_waiting_on_fifos(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "link").symlink_to(victim)
    os.mkfifo(tmp_path / "fifo")
    for name in ["link", "fifo"]:
        with pytest.raises(PathRefused):
            create(tmp_path / name)
    (tmp_path / "folder-link").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(PathRefused):
        real_folder(tmp_path / "folder-link")
    write_atomically(tmp_path / "link", b"new")  # replaces the link itself, never its target
    assert victim.read_text() == "precious" and (tmp_path / "link").read_bytes() == b"new"
    assert not (tmp_path / "link").is_symlink()


@pytest.mark.parametrize("flag,make,why", [
    ("--export-hf", "file", "exists and is not a folder"),   # before: trained every step, then FileExistsError
    ("--export", "folder", "a folder, not a file"),
    ("--out", "link", "symbolic link"),
    ("--trace", "under_file", "is not a folder"),
    ("--export", "link", "symbolic link"),
])
def test_every_output_path_is_checked_before_the_first_step(tmp_path, data_dir, flag, make, why):
    (tmp_path / "file").write_text("")
    (tmp_path / "folder").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "folder", target_is_directory=True)
    path = {"file": tmp_path / "file", "folder": tmp_path / "folder", "link": tmp_path / "link",
            "under_file": tmp_path / "file" / "run"}[make]
    done = trainer(*SMALL, flag, path, data_dir=data_dir)
    assert_refused(done, flag, why)


def test_a_link_planted_at_metrics_jsonl_is_refused(tmp_path, data_dir):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metrics.jsonl").symlink_to(victim)
    done = trainer(*SMALL, "--out", tmp_path / "out", data_dir=data_dir)
    assert done.returncode == 2 and "symbolic link" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert victim.read_text() == "precious"
