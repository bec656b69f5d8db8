"""Every file a run did not write itself goes through one bounded reader (minidist/untrusted.py).

The rules: only a regular file is opened (a FIFO, a folder or a device never is: a FIFO would block);
at most its reader's limit of bytes is read (a sparse 1 GiB file costs one limit's worth of memory,
not a GiB); its JSON nests at most 64 deep (``[`` repeated 100,000 times was a RecursionError
traceback); and each refusal is one exception whose message names the file. Each reader of an
untrusted file is checked against the same two hostile inputs below.
"""
import json
import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from minidist.checkpoint.format import CheckpointError
from minidist.data.tokens import DataError
from minidist.untrusted import MAX_DEPTH, Unreadable, open_bounded, parse_json, read_bounded, read_json
from tests.mpi.harness import REPO


def nested(levels: int, kind: str = "list") -> str:
    return "[" * levels + "]" * levels if kind == "list" else '{"a": ' * levels + "0" + "}" * levels


@pytest.mark.parametrize("kind", ["list", "object"])
@pytest.mark.parametrize("levels", [MAX_DEPTH + 1, 900, 100_000])
def test_json_nested_past_the_bound_is_refused_however_deep(levels, kind):
    """Past 64 levels, whether Python's parser would have read it (900) or raised RecursionError (100,000)."""
    with pytest.raises(ValueError, match=f"nested too deep \\(over {MAX_DEPTH} levels\\)"):
        parse_json(nested(levels, kind).encode())


def test_json_nested_to_the_bound_is_read():
    assert parse_json(nested(MAX_DEPTH)) == json.loads(nested(MAX_DEPTH))
    assert parse_json(json.dumps([[1, 2]] * 1000)) == [[1, 2]] * 1000  # many brackets, shallow


@pytest.mark.parametrize("kind", ["fifo", "folder", "missing", "link to a device"])
def test_only_a_regular_file_is_opened(tmp_path, kind):
    path = tmp_path / "f.json"
    {"fifo": lambda: os.mkfifo(path), "folder": path.mkdir, "missing": lambda: None,
     "link to a device": lambda: path.symlink_to("/dev/zero")}[kind]()
    with pytest.raises(Unreadable, match=str(path)):
        read_bounded(path, 100, "a test file")


def test_a_link_is_refused_where_the_reader_does_not_follow_links(tmp_path):
    (tmp_path / "real.json").write_text("{}")
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    assert read_json(tmp_path / "link.json", 100, "a test file") == {}
    with pytest.raises(Unreadable, match="link.json is a symbolic link, not a regular file"):
        read_json(tmp_path / "link.json", 100, "a test file", follow_links=False)
    with open_bounded(tmp_path / "real.json") as f:
        assert f.read() == b"{}"


# --- every reader of an untrusted file: one refusal naming it, in bounded memory


def data_manifest(folder):
    from minidist.data.folder import read_manifest
    return folder / "manifest.json", lambda: read_manifest(folder), DataError


def prepare_tokenizer(folder):
    from minidist.data.encode import PrepareError, parse_tokenizer
    pytest.importorskip("tokenizers")
    return folder / "tokenizer.json", lambda: parse_tokenizer(str(folder / "tokenizer.json")), PrepareError


def trainer_tokenizer(folder):
    from minidist.data.hf_tokenizer import HFTokenizer
    pytest.importorskip("tokenizers")
    return folder / "tokenizer.json", lambda: HFTokenizer(folder / "tokenizer.json"), ValueError


def corpus_record(folder):
    from minidist.data.corpus import cache_problem, record_path

    def check():
        problem = cache_problem(folder / "corpus.bin")
        if problem is not None:
            raise DataError(f"{record_path(folder / 'corpus.bin')}: {problem}")
    (folder / "corpus.bin").write_bytes(b"x")
    return folder / "corpus.bin.json", check, DataError


def hostfile(folder):
    from minidist.hosts import hostfile_problem

    def check():
        problem = hostfile_problem(str(folder / "hosts"), "hydra")
        if problem is not None:
            raise ValueError(problem)
    return folder / "hosts", check, ValueError


def checkpoint_manifest(folder):
    from minidist.checkpoint.reader import read_manifest
    (folder / "step-000001").mkdir()
    return folder / "step-000001" / "manifest.json", lambda: read_manifest(folder / "step-000001"), CheckpointError


def hf_config(folder):
    from minidist.checkpoint.hf import HFFormatError, read_config_json
    return folder / "config.json", lambda: read_config_json(folder / "config.json"), HFFormatError


def memory_report(folder):
    from minidist.inspect.load import RunError, read_memory_report
    return folder / "rank0.json", lambda: read_memory_report(folder / "rank0.json", None), RunError


READERS = [data_manifest, prepare_tokenizer, trainer_tokenizer, corpus_record, hostfile, checkpoint_manifest,
           hf_config, memory_report]
"""(the file it reads, a call that reads it, the exception it raises) of each reader, in a folder.
The trace's lines go through the same parse_json (tests/test_inspect_hostile.py: skipped and said)."""


@pytest.mark.parametrize("hostile", ["nested 100,000 deep", "a sparse GiB"])
@pytest.mark.parametrize("reader", READERS, ids=[r.__name__ for r in READERS])
def test_every_untrusted_file_is_refused_in_one_exception_naming_it(tmp_path, reader, hostile):
    """Was: the data manifest and the corpus record ended in a RecursionError traceback; the
    tokenizer.json given to prepare or to the trainer was read whole (a GiB in memory)."""
    path, read, error = reader(tmp_path)
    if hostile == "a sparse GiB":
        with open(path, "wb") as f:
            f.truncate(1 << 30)  # a GiB of zeros that takes no disk
    else:
        path.write_text(nested(100_000))
    tracemalloc.start()
    try:
        with pytest.raises(error) as refused:
            read()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    message = str(refused.value)
    assert str(path) in message and "\n" not in message, message
    if reader not in (hostfile, corpus_record):  # not JSON; a cache regenerated from "has no valid record"
        assert ("larger than" if hostile == "a sparse GiB" else "nested too deep") in message, message
    assert peak < 200 << 20, peak  # at most one reader's limit (64 MiB) read, never the GiB


def test_a_deep_manifest_at_the_trainers_command_line_is_one_line_and_exit_2(tmp_path):
    """Was: a RecursionError traceback, exit 1."""
    from minidist.data.shards import write_shard
    for name in ("train_000000.bin", "val_000000.bin"):
        write_shard(tmp_path / name, np.arange(100) % 50)
    (tmp_path / "manifest.json").write_text(nested(100_000))
    done = subprocess.run([sys.executable, "-m", "minidist.train", "--data", str(tmp_path), "--steps", "1"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "manifest.json: not a data manifest (not JSON: nested too deep" in done.stderr, done.stderr
