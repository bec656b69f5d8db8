"""Tokenizer, the generated default corpus, memmapped token files and deterministic batches."""
import threading

import numpy as np
import pytest

from minidist.data import (ByteTokenizer, default_corpus, get_batch, grammar_text, inputs_and_targets,
                           load_tokens, train_val_split)
from minidist.data.corpus import NOUNS, VERBS, plural_of, third_person


def test_tokenizer_round_trips_any_text_byte_by_byte():
    tok = ByteTokenizer()
    text = "Hello, world! Grüße — ∑ 🙂\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint8 and len(ids) == len(text.encode("utf-8")) and tok.vocab_size == 256
    assert tok.decode(ids) == text
    assert tok.decode([104, 105]) == "hi"
    assert tok.decode([0xF0, 0x9F]) == "\ufffd"          # a cut multi-byte character decodes safely


def test_grammar_corpus_is_deterministic_and_agrees_in_number():
    a = grammar_text(5000, seed=0)
    assert a == grammar_text(5000, seed=0) and a != grammar_text(5000, seed=1) and len(a) >= 5000
    singular, plural = set(NOUNS), {plural_of(n) for n in NOUNS}
    base_verbs, s_verbs = set(VERBS), {third_person(v) for v in VERBS}
    n_plural = 0
    for line in a.splitlines():
        assert line[0].isupper() and line.endswith(".")
        words = line[:-1].lower().split()
        subject = next(w for w in words if w in singular | plural)
        verb = next(w for w in words if w in base_verbs | s_verbs)
        assert (subject in plural) == (verb in base_verbs), line      # "the cats see", "the cat sees"
        n_plural += subject in plural
    assert n_plural > 0


def test_default_corpus_is_cached_as_a_uint8_token_file(tmp_path):
    path = default_corpus(tmp_path, n_bytes=20_000, seed=0)
    assert path.parent == tmp_path and path.suffix == ".bin"
    mtime = path.stat().st_mtime_ns
    assert default_corpus(tmp_path, n_bytes=20_000, seed=0) == path and path.stat().st_mtime_ns == mtime
    tokens = load_tokens(path)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint8
    assert ByteTokenizer().decode(tokens) == grammar_text(20_000, seed=0)


def test_ranks_starting_at_once_as_threads_all_get_the_same_complete_corpus(tmp_path):
    paths = [None] * 8

    def start(rank):
        paths[rank] = default_corpus(tmp_path, n_bytes=50_000)

    threads = [threading.Thread(target=start, args=(rank,)) for rank in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 1 and sorted(p.name for p in tmp_path.iterdir()) == [paths[0].name,
                                                                                   paths[0].name + ".json"]
    assert paths[0].read_bytes() == grammar_text(50_000).encode()


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "no record"])
def test_a_damaged_corpus_cache_is_regenerated_with_a_message_naming_it(tmp_path, capsys, damage):
    path = default_corpus(tmp_path, n_bytes=20_000)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[:5000])  # a full disk, a killed writer
    elif damage == "flipped byte":
        path.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    else:
        (tmp_path / (path.name + ".json")).unlink()
    capsys.readouterr()
    assert default_corpus(tmp_path, n_bytes=20_000) == path
    message = capsys.readouterr().err
    assert f"the corpus cache {path}" in message and "regenerating it" in message
    assert path.read_bytes() == data == grammar_text(20_000).encode()
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".json"]  # no temporary left


def test_an_intact_corpus_cache_is_used_silently(tmp_path, capsys):
    default_corpus(tmp_path, n_bytes=20_000)
    capsys.readouterr()
    default_corpus(tmp_path, n_bytes=20_000)
    assert capsys.readouterr().err == ""


def test_a_text_file_is_a_token_file_and_splits_without_copying(tmp_path):
    path = tmp_path / "any.txt"
    path.write_text("abcdefghij" * 10)
    tokens = load_tokens(path)
    train, val = train_val_split(tokens, val_fraction=0.1)
    assert len(train) == 90 and len(val) == 10
    assert np.shares_memory(train, tokens) and np.shares_memory(val, tokens)
    assert ByteTokenizer().decode(val) == "abcdefghij"


def test_batches_depend_only_on_seed_and_step():
    tokens = np.arange(1000)                             # token i is i: a row's first token is its start
    a = get_batch(tokens, step=7, batch_size=4, block_size=16, seed=0)
    assert a.shape == (4, 17) and a.dtype == np.int64
    np.testing.assert_array_equal(a, get_batch(tokens, step=7, batch_size=4, block_size=16, seed=0))
    assert not np.array_equal(a, get_batch(tokens, step=8, batch_size=4, block_size=16, seed=0))
    assert not np.array_equal(a, get_batch(tokens, step=7, batch_size=4, block_size=16, seed=1))
    np.testing.assert_array_equal(a, a[:, :1] + np.arange(17))   # each row a contiguous window


def test_targets_are_the_inputs_shifted_by_one():
    batch = get_batch(np.arange(100), step=0, batch_size=3, block_size=8)
    x, y = inputs_and_targets(batch)
    assert x.shape == y.shape == (3, 8)
    np.testing.assert_array_equal(y, x + 1)           # in 0, 1, 2, ... the next token is token + 1


def test_data_parallel_ranks_take_rows_of_the_same_global_batch():
    tokens = np.arange(500)
    global_batch = get_batch(tokens, step=3, batch_size=8, block_size=4, seed=5)
    rows = [global_batch[r * 4:(r + 1) * 4] for r in range(2)]   # 2 ranks, 4 rows each
    np.testing.assert_array_equal(np.concatenate(rows), global_batch)


def test_windows_cover_the_whole_file_including_its_last_token():
    tokens = np.arange(10)
    ends = {int(get_batch(tokens, s, 64, 4)[:, -1].max()) for s in range(5)}
    assert max(ends) == 9
    with pytest.raises(ValueError, match="cannot fill"):
        get_batch(tokens, 0, 1, block_size=10)
