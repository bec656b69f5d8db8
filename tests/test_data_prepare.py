"""``python -m minidist.data.prepare``: text in, llm.c shards and a manifest out, which the trainer's
reader (data/folder.py) opens; the same command again is a cache hit that touches nothing, and any
change (an input, the tokenizer, a damaged or missing shard) prepares the folder again.
"""
import errno
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from minidist.data import encode, grammar_text
from minidist.data.folder import open_corpus
from minidist.data.hf_tokenizer import HFTokenizer
from minidist.data.prepare import main, prepare
from minidist.data.shards import HEADER_BYTES, MAGIC, VERSION

pytest.importorskip("tokenizers")

TEXT = grammar_text(6000, seed=1) + "Le café où l'élève écrit: 日本語の文章. ✓\n" * 3  # multi-byte UTF-8 too


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def texts(tmp_path):
    """Two input files; their concatenation is TEXT."""
    cut = TEXT.index("\n", len(TEXT) // 3) + 1
    return [write(tmp_path / "a.txt", TEXT[:cut]), write(tmp_path / "b.txt", TEXT[cut:])]


def run(capsys, *argv):
    """(exit status, stdout lines, stderr lines) of main(argv)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


LOCK = ".minidist.lock"  # prepare's hold on the folder (folder_lock.py): rewritten by every run, a cache hit too


def files_of(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != LOCK}


def mtimes(folder):
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.name != LOCK}


def test_byte_shards_round_trip_through_the_trainers_reader(texts, tmp_path):
    data = TEXT.encode("utf-8")
    n_val = int(len(data) * 0.1)
    result = prepare(texts, tmp_path / "out", shard_tokens=2000)
    corpus = open_corpus(tmp_path / "out")
    assert not result.cached and corpus.kind == "prepared" and corpus.vocab_size == 256 and corpus.tokenizer == "bytes"
    assert bytes(corpus.train.read(0, len(corpus.train)).astype(np.uint8)) == data[:-n_val]
    assert bytes(corpus.val.read(0, len(corpus.val)).astype(np.uint8)) == data[-n_val:]

    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest == result.manifest
    assert list(manifest) == ["format", "version", "vocab_size", "tokenizer", "inputs", "val_fraction", "shard_tokens",
                              "shards"]
    assert manifest["tokenizer"] == {"kind": "bytes", "vocab": 256}
    assert [i["path"] for i in manifest["inputs"]] == [str(p.resolve()) for p in texts]
    assert [i["bytes"] for i in manifest["inputs"]] == [p.stat().st_size for p in texts]
    n_train = len(data) - n_val
    assert [(e["name"], e["tokens"]) for e in manifest["shards"]] == (
        [(f"train_{k:06d}.bin", min(2000, n_train - 2000 * k)) for k in range(math.ceil(n_train / 2000))]
        + [("val_000000.bin", n_val)])
    for e in manifest["shards"]:  # llm.c's header, then uint16 tokens
        raw = (tmp_path / "out" / e["name"]).read_bytes()
        assert list(np.frombuffer(raw[:12], "<i4")) == [MAGIC, VERSION, e["tokens"]]
        assert not np.frombuffer(raw[12:HEADER_BYTES], "<i4").any() and len(raw) == HEADER_BYTES + 2 * e["tokens"]
        assert e["largest"] == int(np.frombuffer(raw[HEADER_BYTES:], "<u2").max())


def test_the_validation_split_is_at_least_one_token(tmp_path):
    result = prepare([write(tmp_path / "t.txt", "hello")], tmp_path / "out", val_fraction=0.01)
    assert [(e["split"], e["tokens"]) for e in result.manifest["shards"]] == [("train", 4), ("val", 1)]


def test_chunks_end_at_line_breaks_or_between_characters(tmp_path, monkeypatch):
    monkeypatch.setattr(encode, "CHUNK_BYTES", 16)
    data = ("short\n" + "é" * 20 + "\n" + "x" * 40 + "\n\n日本").encode()
    (tmp_path / "t.txt").write_bytes(data)
    pieces = list(encode.chunks(tmp_path / "t.txt"))
    assert b"".join(p for _, p in pieces) == data and all(0 < len(p) <= 16 for _, p in pieces)
    assert [o for o, _ in pieces] == [sum(len(p) for _, p in pieces[:k]) for k in range(len(pieces))]
    assert [p.decode() for _, p in pieces][:2] == ["short\n", "é" * 7]  # no line break in 16 bytes: between characters


def test_bpe_is_learned_saved_and_deterministic(texts, tmp_path):
    first = prepare(texts, tmp_path / "one", tokenizer="bpe:300", workers=1)
    prepare(texts, tmp_path / "two", tokenizer="bpe:300", workers=1)
    assert first.manifest["vocab_size"] == 300 and first.manifest["tokenizer"]["vocab"] == 300
    assert files_of(tmp_path / "one") == files_of(tmp_path / "two")  # tokenizer.json and shards, byte for byte
    corpus = open_corpus(tmp_path / "one")
    tokenizer = HFTokenizer(corpus.tokenizer)
    assert corpus.tokenizer == str(tmp_path / "one" / "tokenizer.json") and tokenizer.vocab_size == 300
    ids = np.concatenate([corpus.train.read(0, len(corpus.train)), corpus.val.read(0, len(corpus.val))])
    assert len(ids) < 0.7 * len(TEXT.encode())  # 44 merges learned
    assert tokenizer.decode(ids) == TEXT


def test_a_bpe_runs_out_of_pairs_on_a_small_text_and_says_so(tmp_path, capsys):
    code, out, _ = run(capsys, write(tmp_path / "t.txt", "the cat sees the cat\n" * 20), "--out", tmp_path / "out",
                       "--tokenizer", "bpe:5000", "--workers", 1)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert code == 0 and out[0].startswith(f"bpe:5000 learned {manifest['vocab_size']} tokens")
    assert manifest["tokenizer"]["asked_vocab"] == 5000 and manifest["vocab_size"] < 300
    assert run(capsys, tmp_path / "t.txt", "--out", tmp_path / "out", "--tokenizer", "bpe:5000")[1][0].endswith(
        "(nothing to do)")


def test_a_given_tokenizer_json_is_copied_and_gives_the_same_tokens(texts, tmp_path):
    learned = prepare(texts, tmp_path / "bpe", tokenizer="bpe:300", workers=1)
    given = prepare(texts, tmp_path / "file", tokenizer=str(tmp_path / "bpe" / "tokenizer.json"), workers=1)
    assert given.manifest["tokenizer"] == {"kind": "file", "vocab": 300,
                                           "sha256": learned.manifest["tokenizer"]["sha256"],
                                           "source": str((tmp_path / "bpe" / "tokenizer.json").resolve())}
    assert files_of(tmp_path / "file").keys() == files_of(tmp_path / "bpe").keys()
    assert {k: v for k, v in files_of(tmp_path / "file").items() if k != "manifest.json"} == \
        {k: v for k, v in files_of(tmp_path / "bpe").items() if k != "manifest.json"}
    assert open_corpus(tmp_path / "file").identity == open_corpus(tmp_path / "bpe").identity


def test_special_tokens_a_template_adds_are_left_out_by_prepare_and_by_the_trainer(tmp_path):
    """A tokenizer.json whose template puts [CLS] before every text: prepare's shards and the
    trainer's HFTokenizer (a --data FILE beside --init-from-hf) hold the text's tokens only."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    words = ["[CLS]", "[UNK]", "the", "cat", "sees"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="[CLS] $A", special_tokens=[("[CLS]", 0)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert tokenizer.encode("the cat").ids == [0, 2, 3]  # the template's [CLS] by default
    text = "the cat sees the cat\n" * 50
    prepare([write(tmp_path / "t.txt", text)], tmp_path / "out", tokenizer=str(tmp_path / "tokenizer.json"), workers=1)
    corpus = open_corpus(tmp_path / "out")
    ids = np.concatenate([corpus.train.read(0, len(corpus.train)), corpus.val.read(0, len(corpus.val))])
    assert ids.tolist() == [2, 3, 4, 2, 3] * 50
    assert HFTokenizer(tmp_path / "tokenizer.json").encode(text).tolist() == ids.tolist()


def test_two_workers_write_the_same_shards_as_one(texts, tmp_path, monkeypatch):
    monkeypatch.setattr(encode, "CHUNK_BYTES", 256)  # many chunks, cut the same for both
    prepare(texts, tmp_path / "one", tokenizer="bpe:300", workers=1)
    prepare(texts, tmp_path / "two", tokenizer="bpe:300", workers=2)
    assert files_of(tmp_path / "two") == files_of(tmp_path / "one")


def test_the_second_run_is_a_cache_hit_that_touches_nothing(texts, tmp_path, capsys):
    out = tmp_path / "out"
    code, lines, _ = run(capsys, *texts, "--out", out, "--shard-tokens", 2000)
    assert code == 0 and len(lines) == 1 and "MB/s" in lines[0]
    before = mtimes(out)
    code, lines, err = run(capsys, *texts, "--out", out, "--shard-tokens", 2000)
    shards = json.loads((out / "manifest.json").read_text())["shards"]
    assert code == 0 and err == [] and lines == [
        f"{out} is up to date: {len(shards)} shards, {len(TEXT.encode()):,} tokens (nothing to do)"]
    assert mtimes(out) == before
    assert open_corpus(out).identity == open_corpus(out).identity


@pytest.mark.parametrize("change, says", [
    ("input", "b.txt changed since it was prepared"),
    ("tokenizer", "the tokenizer is not the one it was prepared with"),
    ("shard-tokens", "--val-fraction 0.1 --shard-tokens 3000 are not the ones it was prepared with (0.1, 2000)"),
    ("damaged", "train_000001.bin: its SHA-256 differs from the manifest"),
    ("deleted", "train_000001.bin: missing"),
    ("manifest", "manifest.json: not a data manifest (not JSON: Expecting property name enclosed in double quotes"),
])
def test_a_change_prepares_the_folder_again(change, says, texts, tmp_path, capsys):
    out = tmp_path / "out"
    flags = ["--out", out, "--shard-tokens", 2000]
    assert run(capsys, *texts, *flags)[0] == 0
    shards = files_of(out)
    if change == "input":
        write(texts[1], TEXT[len(texts[0].read_text()):].replace("cat", "cow"))
    elif change == "tokenizer":
        flags += ["--tokenizer", "bpe:300", "--workers", 1]
    elif change == "shard-tokens":
        flags[-1] = 3000
    elif change == "damaged":
        raw = bytearray((out / "train_000001.bin").read_bytes())
        raw[HEADER_BYTES + 7] ^= 1
        (out / "train_000001.bin").write_bytes(bytes(raw))
    elif change == "deleted":
        (out / "train_000001.bin").unlink()
    else:
        write(out / "manifest.json", "{")
    code, lines, _ = run(capsys, *texts, *flags)
    says = says.replace("b.txt", str(texts[1].resolve())).replace("manifest.json", str(out / "manifest.json"))
    assert code == 0 and lines[0].startswith(says) and lines[0].endswith(f": preparing {out} again")
    assert "MB/s" in lines[-1]
    manifest = json.loads((out / "manifest.json").read_text())
    assert {e["name"] for e in manifest["shards"]} | {"manifest.json"} | (
        {"tokenizer.json"} if change == "tokenizer" else set()) == set(os.listdir(out)) - {LOCK}  # the old shards are gone
    if change in ("damaged", "deleted", "manifest"):
        assert files_of(out) == shards
    assert run(capsys, *texts, *flags)[1][0].endswith("(nothing to do)")
    if change == "tokenizer":  # and back: tokenizer.json goes with the tokenizer
        assert run(capsys, *texts, "--out", out, "--shard-tokens", 2000)[0] == 0
        assert not (out / "tokenizer.json").exists() and files_of(out) == shards


def big_vocabulary(path):
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({str(i): i for i in range(70_000)}, unk_token="0")).save(str(path))
    return path


@pytest.mark.parametrize("case, says", [
    ("missing", "missing.txt: no such file"),
    ("not utf-8", "bad.txt: not UTF-8 text (byte 4 is 0xff, invalid start byte)"),
    ("folder", "is a folder, not a text file"),
    ("too short", "the inputs give 1 token: too few for a training and a validation token"),
    ("out is a link", "is a symbolic link"),
    ("out is a file", "exists and is not a folder"),
    ("bpe:abc", "--tokenizer bpe:abc: bpe:VOCAB takes a whole number of tokens"),
    ("bpe:256", "--tokenizer bpe:256: a byte-level BPE has more than the 256 byte tokens"),
    ("bpe:65537", "--tokenizer bpe:65537: a byte-level BPE has more than the 256 byte tokens and at most 65,536"),
    ("nonsense", "--tokenizer nonsense: neither bytes, bpe:VOCAB nor a tokenizer.json file"),
    ("unreadable tokenizer", "not a tokenizer.json the tokenizers package can read"),
    ("vocabulary too large", "a vocabulary of 70,000 tokens does not fit uint16 shards (at most 65,536)"),
    ("no tokenizers", "--tokenizer bpe:300 needs the 'tokenizers' package: pip install tokenizers"),
    ("val 0", "--val-fraction 0.0 is not between 0 and 1"),
    ("val 1", "--val-fraction 1.0 is not between 0 and 1"),
    ("val nan", "--val-fraction nan is not between 0 and 1"),
    ("val abc", "argument --val-fraction: invalid float value: 'abc'"),
    ("shards 0", "--shard-tokens 0 is not >= 1"),
    ("workers 0", "--workers 0 is not >= 1"),
    ("no out", "the following arguments are required: --out"),
])
def test_bad_input_is_one_line_and_exit_2(case, says, texts, tmp_path, capsys, monkeypatch):
    out, flags, inputs = tmp_path / "out", [], [texts[0]]
    if case == "missing":
        inputs = [tmp_path / "missing.txt"]
    elif case == "not utf-8":
        (tmp_path / "bad.txt").write_bytes(b"abc\n\xff\n")
        inputs = [texts[0], tmp_path / "bad.txt"]
    elif case == "folder":
        inputs = [tmp_path]
    elif case == "too short":
        inputs = [write(tmp_path / "t.txt", "x")]
    elif case == "out is a link":
        (tmp_path / "real").mkdir()
        out.symlink_to(tmp_path / "real")
    elif case == "out is a file":
        write(out, "hello")
    elif case.startswith("bpe:") or case == "nonsense":
        flags = ["--tokenizer", case]
    elif case == "unreadable tokenizer":
        flags = ["--tokenizer", write(tmp_path / "tokenizer.json", '{"model": "no"}')]
    elif case == "vocabulary too large":
        flags = ["--tokenizer", big_vocabulary(tmp_path / "big.json")]
    elif case == "no tokenizers":
        monkeypatch.setitem(sys.modules, "tokenizers", None)
        flags = ["--tokenizer", "bpe:300"]
    elif case.startswith("val"):
        flags = ["--val-fraction", case.split()[1]]
    elif case == "shards 0":
        flags = ["--shard-tokens", "0"]
    elif case == "workers 0":
        flags = ["--workers", "0"]
    code, lines, err = run(capsys, *inputs, *([] if case == "no out" else ["--out", out]), *flags)
    assert code == 2 and lines == [] and len(err) == 1 and err[0].startswith("minidist.data.prepare: "), err
    assert says in err[0], err
    assert not (out / "manifest.json").exists() and not (tmp_path / "real" / "manifest.json").exists()


def test_two_prepares_of_one_folder_at_once_are_refused_one_line(tmp_path, capsys):
    from minidist.folder_lock import FolderLock
    text = tmp_path / "t.txt"
    text.write_text("hello world\n" * 50)
    held = FolderLock(tmp_path / "out", "--out")  # as another prepare holding it
    try:
        with pytest.raises(SystemExit) as exit_:
            main([str(text), "--out", str(tmp_path / "out")])
    finally:
        held.release()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "is in use by another run" in err


# --- what a refused, killed or failed prepare leaves behind


@pytest.mark.parametrize("existed", [False, True], ids=["new-out", "empty-out"])
def test_a_refused_prepare_leaves_no_lock_and_no_folder_of_its_own(tmp_path, capsys, existed):
    """Was: the refusal (a text too short) left .minidist.lock, and the folder it had created."""
    out = tmp_path / "out"
    if existed:
        out.mkdir()
    code, _, err = run(capsys, write(tmp_path / "t.txt", "x"), "--out", out)
    assert code == 2 and "too few for a training and a validation token" in err[0], err
    assert (sorted(os.listdir(out)) == [] if existed else not os.path.lexists(out)), os.listdir(out)


KILLED_WRITING_A_SHARD = ("import os, signal, sys; os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL); "
                          "from minidist.data.prepare import main; main(sys.argv[1:])")
"""prepare, SIGKILLed while it makes its first shard durable (the shard's temporary written, the
token stream beside it)."""


def test_a_rerun_removes_what_a_killed_prepare_left_and_names_it(texts, tmp_path, capsys):
    """Was: train_000000.bin.tmp30012 (the shard being written when SIGKILL came) and tokens.tmp stayed
    in the folder for good; the rerun kept them."""
    out = tmp_path / "out"
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITING_A_SHARD, *map(str, texts), "--out", str(out),
                             "--shard-tokens", "2000", "--workers", "1"], capture_output=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    left = sorted(name for name in os.listdir(out) if name != LOCK)
    assert left == ["tokens.tmp", f"train_000000.bin.tmp{left[1].split('.tmp')[-1]}"], left
    (out / "notes.txt").write_text("mine")  # not prepare's: kept
    (out / "manifest.json.tmp30012").write_text("{")  # a manifest being written when the kill came
    left.insert(0, "manifest.json.tmp30012")
    code, lines, err = run(capsys, *texts, "--out", out, "--shard-tokens", 2000)
    assert code == 0 and err == [], err
    assert lines[0] == f"removed what an interrupted prepare left in {out}: {', '.join(sorted(left))}", lines
    assert not [name for name in left if (out / name).exists()] and (out / "notes.txt").read_text() == "mine"
    for name in left:  # and a folder already up to date is cleaned too
        (out / name).write_bytes(b"")
    code, lines, _ = run(capsys, *texts, "--out", out, "--shard-tokens", 2000)
    assert code == 0 and lines[0].startswith("removed what an interrupted prepare left") and "up to date" in lines[1]


def test_a_full_disk_names_the_file_it_was_writing(texts, tmp_path, capsys, monkeypatch):
    """Was: "[Errno 28] No space left on device", no file named."""
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)  # the disk fills while the first shard is made durable
    out = tmp_path / "out"
    code, lines, err = run(capsys, *texts, "--out", out)
    assert code == 1 and lines == [] and len(err) == 1, err
    assert err[0] == f"minidist.data.prepare: [Errno 28] No space left on device: '{out / 'train_000000.bin'}'", err
    assert not os.path.lexists(out)  # the folder it made, and the stream, the lock, the shard's temporary in it


def test_a_file_size_limit_names_the_token_stream_it_was_writing(texts, tmp_path):
    """Was: "OSError: 53092 requested and 32768 written" (numpy's words: no file, no reason)."""
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (8000, 8000)); from minidist.data.prepare import main; "
            "sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, *map(str, texts), "--out", str(tmp_path / "out"), "--workers", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert f"[Errno 27] File too large: '{tmp_path / 'out' / 'tokens.tmp'}'" in done.stderr, done.stderr
