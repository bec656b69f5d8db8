"""nanoGPT's character folders read whole: ``train.bin``, ``val.bin`` and the vocabulary in ``meta.pkl``
(data/meta_pkl.py), read by an unpickler that allows no class, so a planted pickle runs nothing.

The folder here is written as nanoGPT's ``data/shakespeare_char/prepare.py`` writes it: the sorted
characters of a text, ``stoi`` / ``itos``, ids as uint16, ``pickle.dump`` of the dict.
"""
import os
import pickle
import subprocess
import sys

from pathlib import Path

import numpy as np
import pytest

from minidist.data.folder import open_corpus
from minidist.data import grammar_text
from minidist.data.meta_pkl import META_LIMIT, read_meta
from minidist.data.tokens import DataError
from minidist.train import train
from minidist.train.build import load_data, sample_tokenizer
from minidist.train.config import ConfigError, TrainConfig
from tests.mpi.harness import REPO

TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4, steps=2, eval_every=1, eval_iters=1,
            sample_tokens=0)


def char_folder(root, text: str):
    """nanoGPT's character preparation of ``text`` into ``root``: train.bin, val.bin (last 10%), meta.pkl."""
    root.mkdir(parents=True, exist_ok=True)
    chars = sorted(set(text))
    stoi, itos = {c: i for i, c in enumerate(chars)}, dict(enumerate(chars))
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = int(len(ids) * 0.9)
    (root / "train.bin").write_bytes(ids[:n].tobytes())
    (root / "val.bin").write_bytes(ids[n:].tobytes())
    with open(root / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)
    return root


@pytest.fixture()
def folder(tmp_path):
    return char_folder(tmp_path / "chars", grammar_text(20_000))


def test_the_vocabulary_comes_from_meta_pkl_and_the_sample_is_text(folder):
    vocabulary = read_meta(folder / "meta.pkl")
    corpus = open_corpus(folder)
    assert corpus.kind == "nanogpt" and corpus.vocab_size == vocabulary.vocab_size < 256
    assert corpus.tokenizer == str(folder / "meta.pkl")
    cfg, _ = load_data(TrainConfig(**TINY, data=str(folder)))  # no --vocab-size needed
    assert cfg.vocab_size == vocabulary.vocab_size
    tokenizer = sample_tokenizer(cfg)
    assert tokenizer.decode(tokenizer.encode("The cat")) == "The cat"
    text = grammar_text(20_000)
    assert vocabulary.decode(np.fromfile(folder / "train.bin", dtype=np.uint16)[:50]) == text[:50]
    assert vocabulary.decode([vocabulary.vocab_size]) == "\ufffd"  # an id a larger model samples


def test_the_trainer_prints_its_sample_as_text(folder):
    done = subprocess.run([sys.executable, "-m", "minidist.train", "--data", str(folder), "--n-layer", "1",
                           "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4", "--steps",
                           "2", "--eval-iters", "1", "--sample-tokens", "40"], capture_output=True, text=True,
                          cwd=REPO, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    sample = done.stdout.split("sample:\n", 1)[1]
    alphabet = set(read_meta(folder / "meta.pkl").itos)
    assert sample.startswith("The ") and set(sample.rstrip("\n")) <= alphabet, sample  # characters, not ids


class Planted:
    """What a malicious meta.pkl holds: unpickling it calls os.system (a marker file shows it ran)."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def hostile(tmp_path):
    """meta.pkl contents that are refused, each with a word its one line must hold."""
    shared = [1, 2]
    for _ in range(60):  # 2**60 paths through 61 objects: walked once each
        shared = [shared, shared]
    loop = []
    loop.append(loop)
    itos = {0: "a", 1: "b"}
    return {
        "code": (pickle.dumps({"itos": itos, "x": Planted(tmp_path / "ran")}), "refused: it names"),
        "a class": (pickle.dumps({"itos": itos, "x": DataError("no")}), "refused: it names"),
        "a float": (pickle.dumps({"itos": itos, "vocab_size": 2.0}), "not nanoGPT's vocabulary"),
        "a bool": (pickle.dumps({"itos": itos, "x": True}), "not nanoGPT's vocabulary"),
        "no itos": (pickle.dumps({"stoi": {"a": 0}}), "not nanoGPT's vocabulary"),
        "a list": (pickle.dumps(["a", "b"]), "not nanoGPT's vocabulary"),
        "holes": (pickle.dumps({"itos": {0: "a", 2: "b"}}), "'itos' does not map the ids 0..1"),
        "an int value": (pickle.dumps({"itos": {0: "a", 1: 5}}), "'itos' does not map"),
        "twice": (pickle.dumps({"itos": {0: "a", 1: "a"}}), "two ids the same string"),
        "stoi": (pickle.dumps({"itos": itos, "stoi": {"a": 1, "b": 0}}), "disagree"),
        "size": (pickle.dumps({"itos": itos, "vocab_size": 3}), "disagree"),
        "shared": (pickle.dumps({"itos": itos, "x": shared}), None),  # plain, and read in no time: accepted
        "cycle": (pickle.dumps({"itos": itos, "x": loop}), None),
        "cut": (pickle.dumps({"itos": itos})[:-3], "not a pickle of plain data"),
        "empty": (b"", "not a pickle of plain data"),
        "huge": (b"\x80\x04" + b"N" * (META_LIMIT + 1), "larger than 16 MiB: not a character vocabulary"),
    }


@pytest.mark.parametrize("case", list(hostile(Path("."))))
def test_a_hostile_meta_pkl_is_refused_with_one_line_and_runs_nothing(tmp_path, folder, case):
    data, word = hostile(tmp_path)[case]
    (folder / "meta.pkl").write_bytes(data)
    if word is None:
        assert read_meta(folder / "meta.pkl").vocab_size == 2
        return
    with pytest.raises(DataError, match=word) as refused:
        read_meta(folder / "meta.pkl")
    assert "\n" not in str(refused.value) and str(folder / "meta.pkl") in str(refused.value)
    with pytest.raises(ConfigError, match="--data"):
        load_data(TrainConfig(**TINY, data=str(folder)))
    assert not (tmp_path / "ran").exists()  # the planted call never ran


def test_a_planted_meta_pkl_stops_the_trainer_with_exit_2_before_anything_runs(tmp_path, folder):
    (folder / "meta.pkl").write_bytes(hostile(tmp_path)["code"][0])
    done = subprocess.run([sys.executable, "-m", "minidist.train", "--data", str(folder), "--steps", "1"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and "meta.pkl: refused: it names posix.system" in done.stderr, done.stderr
    assert not (tmp_path / "ran").exists()


def test_a_token_outside_the_character_vocabulary_is_refused(folder):
    ids = np.fromfile(folder / "val.bin", dtype=np.uint16)
    ids[3] = read_meta(folder / "meta.pkl").vocab_size  # one past the last character
    ids.tofile(folder / "val.bin")
    with pytest.raises(ConfigError, match=r"meta\.pkl token id \d+ \(in val\.bin\) is outside the model's vocabulary"):
        load_data(TrainConfig(**TINY, data=str(folder)))


def test_training_on_the_folder_equals_training_on_its_ids_with_the_vocabulary_given(folder, tmp_path):
    plain = tmp_path / "ids"
    plain.mkdir()
    for name in ("train.bin", "val.bin"):
        (plain / name).write_bytes((folder / name).read_bytes())
    vocab = read_meta(folder / "meta.pkl").vocab_size
    a = train(TrainConfig(**TINY, data=str(folder)), progress=False)[1]
    b = train(TrainConfig(**TINY, data=str(plain), vocab_size=vocab), progress=False)[1]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
