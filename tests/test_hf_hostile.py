"""A hostile ``--init-from-hf`` folder is refused with bounded work and memory, with one HFFormatError
naming the file (exit 2 from the command line), never another exception (minidist/checkpoint/hf.py).

Every number of config.json is checked against sane limits and against what model.safetensors can
hold (its header's tensors, its size) before anything proportional to it is built; config.json is
read to a size limit (a sparse 4 GiB file is refused after reading 1 MiB of it) and its nesting is
bounded. The 24 folders of tests/test_hf.py keep their own refusals.
"""
import os
import subprocess
import sys
import tracemalloc

import pytest

from minidist.checkpoint.hf import HFFormatError, read_hf_config
from minidist.train.build import with_hf_model
from minidist.train.config import ConfigError, TrainConfig
from tests.python_lines import python_lines
from tests.test_hf import hf_config_json, hf_tensors, write_folder

WORK = 100_000  # Python lines a refusal may run: the largest here runs about 2,300; a loop over the
                # blocks of n_layer 10**6 would run millions


def refused(path, match):
    """read_hf_config(path) raises HFFormatError matching ``match`` within WORK Python lines (counted,
    not timed: tests/python_lines.py) and 16 MiB of Python allocations; the message names the file."""
    tracemalloc.start()
    try:
        with python_lines(limit=WORK), pytest.raises(HFFormatError, match=match) as error:
            read_hf_config(path)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    return str(error.value)


@pytest.mark.parametrize("n_layer", [10 ** 9, 10 ** 6, 3])
def test_more_blocks_than_the_file_holds_are_refused_before_any_name_is_built(tmp_path, n_layer):
    """Was: n_layer 10**9 built 12 x 10**9 parameter names (1.2 GiB and growing after 15 s)."""
    path = write_folder(tmp_path / "f", hf_tensors(), hf_config_json(n_layer=n_layer))
    message = refused(path, "model.safetensors" if n_layer > 3 else "missing transformer.h.2")
    if n_layer > 3:
        assert f"n_layer {n_layer}: more blocks than model.safetensors holds tensors (28" in message


@pytest.mark.parametrize("field, value", [("n_embd", 10 ** 30), ("vocab_size", 2 ** 63), ("n_positions", 2 ** 64),
                                          ("n_layer", 10 ** 100), ("n_head", 2 ** 63)])
def test_a_number_beyond_int64_is_refused_by_name(tmp_path, field, value):
    path = write_folder(tmp_path / "f", hf_tensors(), hf_config_json(**{field: value}))
    assert f"{field} must be a positive integer below 2**63" in refused(path, "config.json")


def test_a_model_larger_than_the_file_is_refused_by_its_size(tmp_path):
    path = write_folder(tmp_path / "f", hf_tensors(), hf_config_json(vocab_size=10 ** 12))
    message = refused(path, r"model.safetensors is \d+ bytes")
    assert "at least 2 bytes each" in message


def test_config_json_nested_100000_levels_is_refused(tmp_path):
    """Was: a RecursionError traceback."""
    path = write_folder(tmp_path / "f", hf_tensors(), {})
    (tmp_path / "f" / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert str(tmp_path / "f" / "config.json") in refused(path, "not JSON")


def test_a_huge_config_json_is_not_read_whole(tmp_path):
    path = write_folder(tmp_path / "f", hf_tensors(), {})
    with open(tmp_path / "f" / "config.json", "wb") as f:
        f.truncate(4 << 30)  # sparse: 4 GiB of zeros that take no disk
    refused(path, "larger than")


@pytest.mark.parametrize("text", ['{"n_layer": NaN}', '{"n_embd": Infinity}', "[1, 2]", '"gpt2"', "\xff\xfe",
                                  '{"n_layer": 2, "n_layer": 1e999}'])
def test_json_that_is_not_a_config_object_is_refused(tmp_path, text):
    path = write_folder(tmp_path / "f", hf_tensors(), {})
    (tmp_path / "f" / "config.json").write_bytes(text.encode("latin-1"))
    refused(path, "config.json")


@pytest.mark.parametrize("kind", ["fifo", "folder", "dangling link"])
def test_a_config_json_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, kind):
    path = write_folder(tmp_path / "f", hf_tensors(), hf_config_json())
    config = tmp_path / "f" / "config.json"
    config.unlink()
    {"fifo": lambda: os.mkfifo(config), "folder": config.mkdir,
     "dangling link": lambda: config.symlink_to(tmp_path / "nowhere")}[kind]()
    refused(path, "config.json")


def test_a_linked_config_json_is_read(tmp_path):
    """Hugging Face's cache links a snapshot's files to its blobs: links to regular files are followed."""
    path = write_folder(tmp_path / "f", hf_tensors(), hf_config_json())
    blob = tmp_path / "blob"
    (tmp_path / "f" / "config.json").rename(blob)
    (tmp_path / "f" / "config.json").symlink_to(blob)
    assert read_hf_config(path).n_layer == 2


def test_the_trainer_turns_every_refusal_into_a_config_error(tmp_path):
    path = write_folder(tmp_path / "f", hf_tensors(), hf_config_json(n_layer=10 ** 9))
    with pytest.raises(ConfigError, match="--init-from-hf .*n_layer 1000000000"):
        with_hf_model(TrainConfig(init_from_hf=path))


@pytest.mark.parametrize("what", ["deep", "layers"])
def test_the_command_line_exits_2_with_one_message(tmp_path, what):
    config = hf_config_json(n_layer=10 ** 9) if what == "layers" else {}
    path = write_folder(tmp_path / "f", hf_tensors(), config)
    if what == "deep":
        (tmp_path / "f" / "config.json").write_text("[" * 100_000)
    run = subprocess.run([sys.executable, "-m", "minidist.train", "--init-from-hf", path, "--data-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and "config.json" in run.stderr and len(run.stderr.splitlines()) <= 4
