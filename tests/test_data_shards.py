"""Training on token shards (data/folder.py, data/tokens.py, data/prefetch.py, train/feed.py).

Shards are written here by hand in each format: llm.c's (a 256-int32 header, uint16 tokens), nanoGPT's
(raw uint16 train.bin / val.bin) and a prepared folder (llm.c shards + manifest.json). Every layout
trains on them as one process does (float64, 1e-10): the batches are a pure function of (seed, step)
over the concatenated shards, and a rank that reads only some positions of a window (a cp rank, a
pipeline stage) trains on exactly those. Each rank reads its share of the bytes and no more; the
prefetched batches are the synchronous ones, bitwise; bad folders are refused with one message.
"""
import dataclasses
import hashlib
import json
import os
import re
import shutil
import types

import numpy as np
import pytest

from minidist import run_local
from minidist.checkpoint import step_dir
from minidist.data import get_batch, grammar_text
from minidist.data.folder import open_corpus
from minidist.data.prefetch import Prefetcher
from minidist.data.shards import HEADER_BYTES, header, write_shard
from minidist.data.tokens import DataError
from minidist.parallel.data.sampler import DistributedSampler, window_spans
from minidist.train import train
from minidist.train.build import load_data
from minidist.train.config import ConfigError, TrainConfig
from minidist.train.feed import rank_spans
from minidist.train.outputs import estimate_val_loss
from tests.mpi.harness import run_mpi

VOCAB = 300
RUN = dict(n_layer=4, n_head=4, n_embd=16, block_size=16, batch_size=8, steps=4, eval_every=2, eval_iters=1,
           dtype="float64", sample_tokens=0, warmup=1, lr=1e-2, optimizer="adamw")


def corpus_tokens(n: int = 60_000) -> np.ndarray:
    """(n,) token ids below VOCAB: the grammar's bytes, every 7th moved above 255 (so uint8 cannot hold them)."""
    tokens = np.frombuffer(grammar_text(n).encode(), dtype=np.uint8)[:n].astype(np.uint16)
    tokens[::7] = 256 + tokens[::7] % (VOCAB - 256)
    tokens[[5, -5]] = VOCAB - 1  # the largest id, in the train and in the val part
    return tokens


def llmc_folder(root, tokens, shard_tokens=20_000):
    """An llm.c folder: train shards of ``shard_tokens`` (the last 10% of ``tokens`` in one val shard)."""
    root.mkdir(parents=True, exist_ok=True)
    n_val = len(tokens) // 10
    train, val = tokens[:-n_val], tokens[-n_val:]
    for i in range(0, len(train), shard_tokens):
        write_shard(root / f"corpus_train_{i // shard_tokens:06d}.bin", train[i:i + shard_tokens])
    write_shard(root / "corpus_val_000000.bin", val)
    return root


def nanogpt_folder(root, tokens):
    root.mkdir(parents=True, exist_ok=True)
    n_val = len(tokens) // 10
    (root / "train.bin").write_bytes(tokens[:-n_val].astype("<u2").tobytes())
    (root / "val.bin").write_bytes(tokens[-n_val:].astype("<u2").tobytes())
    return root


def prepared_folder(root, tokens, shard_tokens=20_000):
    """A prepared folder written by hand: llm.c shards train_NNNNNN.bin / val_NNNNNN.bin and their manifest."""
    root.mkdir(parents=True, exist_ok=True)
    n_val = len(tokens) // 10
    shards = []
    for split, part in (("train", tokens[:-n_val]), ("val", tokens[-n_val:])):
        for i in range(0, len(part), shard_tokens):
            name = f"{split}_{i // shard_tokens:06d}.bin"
            write_shard(root / name, part[i:i + shard_tokens])
            shards.append(dict(name=name, split=split, tokens=len(part[i:i + shard_tokens]),
                               largest=int(part[i:i + shard_tokens].max()),
                               sha256=hashlib.sha256((root / name).read_bytes()).hexdigest()))
    manifest = dict(format="minidist-shards", version=1, vocab_size=VOCAB, tokenizer=dict(kind="bpe", vocab=VOCAB),
                    inputs=[], val_fraction=0.1, shard_tokens=shard_tokens, shards=shards)
    (root / "tokenizer.json").write_text("{}")  # named by the manifest; read only to write the sample
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    tokens = corpus_tokens()
    return dict(tokens=tokens, llmc=str(llmc_folder(root / "llmc", tokens)),
                nanogpt=str(nanogpt_folder(root / "nanogpt", tokens)),
                prepared=str(prepared_folder(root / "prepared", tokens)))


def fit(cfg, world_size=1):
    """Every rank's (losses, val losses, final state) of ``cfg`` on ``world_size`` thread ranks."""
    def run(group):
        model, history = train(cfg, progress=False, world=group)
        return [r["loss"] for r in history], [r.get("val_loss") for r in history], model.state_dict()
    return run_local(run, world_size) if world_size > 1 else [run(None)]


@pytest.fixture(scope="module")
def reference(folders):
    return fit(TrainConfig(**RUN, data=folders["llmc"], vocab_size=VOCAB))[0]


def test_the_three_formats_give_the_same_tokens_and_the_same_run(folders):
    tokens = folders["tokens"]
    n_val = len(tokens) // 10
    for kind in ("llmc", "nanogpt", "prepared"):
        corpus = open_corpus(folders[kind])
        assert np.array_equal(corpus.train.read(0, len(corpus.train)), tokens[:-n_val]), kind
        assert np.array_equal(corpus.val.read(0, len(corpus.val)), tokens[-n_val:]), kind
        assert corpus.largest == VOCAB - 1
    assert open_corpus(folders["prepared"]).vocab_size == VOCAB and open_corpus(folders["llmc"]).vocab_size is None
    runs = [fit(TrainConfig(**dict(RUN, steps=2), data=folders[k], vocab_size=VOCAB))[0][:2] for k in
            ("llmc", "nanogpt", "prepared")]
    assert runs[0] == runs[1] == runs[2]


def test_a_window_across_two_shards_reads_both(folders):
    corpus = open_corpus(folders["llmc"])  # train shards of 20,000 tokens
    assert np.array_equal(corpus.train[19_990:20_010], folders["tokens"][19_990:20_010])
    assert corpus.train.bytes_read == 40


SLOW = pytest.mark.slow  # with --slow: the layouts the default sample's others already hold the reads of
LAYOUTS = {
    "dp2": dict(dp=2),
    "tp2+sp": dict(tp=2, sequence_parallel=True),
    "pp2 1f1b": pytest.param(dict(pp=2, micro_batches=2), marks=SLOW),
    "pp2 zbv": dict(pp=2, micro_batches=2, schedule="zbv", virtual_stages=2),  # rank 0 holds the first and last
    "pp2 interleaved": pytest.param(dict(pp=2, micro_batches=2, schedule="interleaved", virtual_stages=2), marks=SLOW),
    "cp2 ring": pytest.param(dict(cp=2), marks=SLOW),
    "cp2 zigzag": dict(cp=2, cp_algorithm="zigzag"),
    "cp2 ulysses": pytest.param(dict(cp=2, cp_algorithm="ulysses"), marks=SLOW),
    "pp2 cp2 zigzag recompute": dict(pp=2, cp=2, cp_algorithm="zigzag", micro_batches=2, recompute="full"),
    "dp2 zero3": dict(dp=2, zero=3),
    "dp2 cp2": pytest.param(dict(dp=2, cp=2), marks=SLOW),
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_every_layout_on_shards_trains_as_one_process(folders, reference, layout):
    cfg = TrainConfig(**RUN, data=folders["llmc"], vocab_size=VOCAB, **layout)
    world = cfg.dp * cfg.pp * cfg.tp * cfg.cp
    for losses, val_losses, state in fit(cfg, world):
        np.testing.assert_allclose(losses, reference[0], rtol=1e-10)
        np.testing.assert_allclose([v for v in val_losses if v is not None],
                                   [v for v in reference[1] if v is not None], rtol=1e-10)
        for name, value in state.items():  # a tp rank's shard: compared by the loss (the whole model's)
            if value.shape == reference[2][name].shape:
                np.testing.assert_allclose(value, reference[2][name], rtol=1e-10, atol=1e-13, err_msg=name)


@pytest.mark.parametrize("layout, share", [
    (dict(), lambda T, c: T + 1),                    # one process: whole windows
    (dict(dp=2), lambda T, c: T + 1),                # its rows, whole windows
    (dict(cp=2), lambda T, c: T // 2 + 1),           # its half of each window and one target more
    (dict(cp=2, cp_algorithm="zigzag"),              # two quarters, each with a target more (cp rank 1's two
     lambda T, c: T // 2 + 2 - c),                   # quarters touch: one target more)
    (dict(pp=2), lambda T, c: T),                    # stage 0 the ids, stage 1 the targets
], ids=["one", "dp2", "cp2", "cp2-zigzag", "pp2"])
def test_each_rank_reads_exactly_its_share_of_the_bytes(folders, layout, share):
    cfg = TrainConfig(**RUN, vocab_size=VOCAB, **layout)
    T, ranks = cfg.block_size, [(d, p, c) for d in range(cfg.dp) for p in range(cfg.pp) for c in range(cfg.cp)]
    full = get_batch(open_corpus(folders["llmc"]).train, 3, cfg.batch_size, T, cfg.seed)  # (B, T+1)
    covered = np.zeros_like(full, dtype=int)
    for d, p, c in ranks:
        mesh = types.SimpleNamespace(dp_rank=d, pp_rank=p, cp_rank=c)
        tokens = open_corpus(folders["llmc"]).train
        sampler = DistributedSampler(tokens, cfg.batch_size, T, cfg.seed, d, cfg.dp, spans=rank_spans(cfg, mesh))
        batch = sampler.batch(3)
        rows = cfg.batch_size // cfg.dp
        assert tokens.bytes_read == sampler.bytes_per_step() == rows * share(T, c) * 2
        for a, b in sampler.spans:  # what it read is the one-process batch's, there
            assert np.array_equal(batch[:, a:b], full[d * rows:(d + 1) * rows, a:b])
            covered[d * rows:(d + 1) * rows, a:b] += 1
    assert covered.min() >= 1  # together the ranks read every token of the batch


@pytest.mark.parametrize("layout, share", [(dict(), lambda T: T + 1), (dict(dp=2), lambda T: T + 1),
                                           (dict(pp=2), lambda T: T)], ids=["one", "dp2", "pp2 stage 0"])
def test_validation_reads_every_row_but_only_the_ranks_positions(folders, layout, share):
    """Each rank evaluates every row (the loss one process gets) and reads of each window its spans."""
    cfg = TrainConfig(**dict(RUN, eval_iters=3), vocab_size=VOCAB, **layout)
    T, val = cfg.block_size, open_corpus(folders["llmc"]).val
    seen = []

    class Recording:  # a model that records what it is given
        def eval(self):
            pass

        def train(self):
            pass

        def __call__(self, idx, targets):
            seen.append((idx.copy(), targets.copy()))
            return None, types.SimpleNamespace(item=lambda: 1.0)

    spans = rank_spans(cfg, types.SimpleNamespace(dp_rank=0, pp_rank=0, cp_rank=0))
    assert estimate_val_loss(Recording(), val, cfg, spans=spans) == 1.0
    assert val.bytes_read == 3 * cfg.batch_size * share(T) * 2  # every row, its positions, uint16
    for i, (idx, targets) in enumerate(seen):
        full = get_batch(open_corpus(folders["llmc"]).val, i, cfg.batch_size, T, cfg.seed)  # (B, T+1)
        assert np.array_equal(idx, full[:, :-1])  # stage 0 holds the ids; its targets were not read
        assert np.array_equal(targets, full[:, 1:]) == (cfg.pp == 1)


def test_window_spans_merge_a_ranks_inputs_and_targets():
    assert window_spans(8) == [(0, 9)]
    assert window_spans(8, [(0, 2), (6, 8)]) == [(0, 3), (6, 9)]
    assert window_spans(8, inputs=True, targets=False) == [(0, 8)]
    assert window_spans(8, inputs=False, targets=False) == []


def test_prefetched_batches_are_the_synchronous_ones_bitwise(folders):
    tokens = open_corpus(folders["prepared"]).train
    sampler = DistributedSampler(tokens, 8, 16, 0, 1, 2)
    with Prefetcher(sampler.batch, range(0, 20)) as ahead, Prefetcher(sampler.batch, range(0, 20), ahead=False) as now:
        for step in range(20):
            a, b = ahead.get(step), now.get(step)
            assert a.batch.tobytes() == b.batch.tobytes() and a.read_end <= a.got
    run = [fit(TrainConfig(**RUN, data=folders["llmc"], vocab_size=VOCAB, no_prefetch=flag))[0][:2] for flag in (False, True)]
    assert run[0] == run[1]


def test_a_run_resumes_on_shards_in_another_layout(folders, reference, tmp_path):
    cfg = TrainConfig(**RUN, data=folders["prepared"], dp=2, save_every=2, ckpt_dir=str(tmp_path / "ckpt"))
    fit(cfg, 2)
    shutil.rmtree(step_dir(cfg.ckpt_dir, 4))  # as if the job died before its last save
    resumed = fit(dataclasses.replace(cfg, dp=1, tp=2, resume=True), 2)
    for losses, _, _ in resumed:
        np.testing.assert_allclose(losses, reference[0][2:], rtol=1e-10)


def test_the_identity_follows_the_tokens_not_the_folder(folders):
    ids = {k: open_corpus(folders[k]).identity for k in ("llmc", "nanogpt")}
    assert ids["llmc"] == ids["nanogpt"]  # the same tokens read whole
    assert load_data(TrainConfig(data=folders["prepared"]))[1].identity["data_tokens"] == ids["llmc"]["data_tokens"]


def test_the_vocabulary_comes_from_the_manifest_else_vocab_size(folders):
    assert load_data(TrainConfig(data=folders["prepared"]))[0].vocab_size == VOCAB
    with pytest.raises(ConfigError, match="its vocabulary is not recorded .* its largest token is 299.*--vocab-size"):
        load_data(TrainConfig(data=folders["llmc"]))
    with pytest.raises(ConfigError, match=r"token id 299 \(in train.bin\) is outside the model's vocabulary of 299"):
        load_data(TrainConfig(data=folders["nanogpt"], vocab_size=299))
    with pytest.raises(ConfigError, match="--vocab-size 299 is below the vocabulary of --data"):
        load_data(TrainConfig(data=folders["prepared"], vocab_size=299))


def bad(tmp_path, name):
    """A folder with one thing wrong, and the words that must say so."""
    root = tmp_path / name
    tokens = corpus_tokens(5_000)
    if name == "empty":
        root.mkdir()
        return root, "no token shards"
    if name == "mixed":
        llmc_folder(root, tokens)
        (root / "train.bin").write_bytes(b"\0" * 100)
        return root, "mixed formats"
    if name == "truncated":
        llmc_folder(root, tokens)
        shard = root / "corpus_train_000000.bin"
        shard.write_bytes(shard.read_bytes()[:-10])
        return root, "corpus_train_000000.bin: truncated: its header counts"
    if name == "magic":
        llmc_folder(root, tokens)
        shard = root / "corpus_val_000000.bin"
        h = header(10)
        h[0] = 12345
        shard.write_bytes(h.tobytes() + shard.read_bytes()[HEADER_BYTES:])
        return root, "mixed formats"
    if name == "version":
        llmc_folder(root, tokens)
        shard = root / "corpus_val_000000.bin"
        data = bytearray(shard.read_bytes())
        data[4] = 2
        shard.write_bytes(bytes(data))
        return root, "llm.c shard version 2"
    if name == "manifest":
        prepared_folder(root, tokens)
        (root / "manifest.json").write_text('{"format": "minidist-shards", "version": 1, "vocab_size": "many"}')
        return root, "manifest.json: vocab_size must be an integer"
    if name == "manifest-count":
        prepared_folder(root, tokens)
        write_shard(root / "val_000000.bin", tokens[:10])
        return root, "val_000000.bin: 10 tokens, its manifest says"
    if name == "unfinished":
        prepared_folder(root, tokens)
        (root / "manifest.json").unlink()
        return root, "holds prepared shards (train_000000.bin, val_000000.bin...) but no manifest.json"
    if name == "missing-shard":
        prepared_folder(root, tokens)
        (root / "train_000000.bin").unlink()
        return root, "train_000000.bin: missing"
    if name == "fifo-manifest":
        prepared_folder(root, tokens)
        (root / "manifest.json").unlink()
        os.mkfifo(root / "manifest.json")
        return root, "manifest.json is a FIFO, not a regular file"
    if name == "odd":
        nanogpt_folder(root, tokens)
        (root / "val.bin").write_bytes(b"\1" * 101)
        return root, "val.bin: 101 bytes, an odd number"
    if name in ("deep-manifest", "deep-object-manifest"):  # was: a RecursionError traceback
        prepared_folder(root, tokens)
        (root / "manifest.json").write_text("[" * 100_000 if name == "deep-manifest" else '{"a": ' * 100_000)
        return root, "manifest.json: not a data manifest (not JSON: nested too deep"
    if name == "changed-shard":  # was: trained to the end, exit 0
        prepared_folder(root, tokens)
        shard = root / "train_000000.bin"
        data = bytearray(shard.read_bytes())
        data[HEADER_BYTES:HEADER_BYTES + 2] = data[HEADER_BYTES + 2:HEADER_BYTES + 4]  # same size, a token changed
        shard.write_bytes(bytes(data))
        return root, "train_000000.bin: its SHA-256 is not its manifest's"
    if name == "zeroed-hash":  # was: trained to the end, exit 0
        prepared_folder(root, tokens)
        manifest = json.loads((root / "manifest.json").read_text())
        manifest["shards"][-1]["sha256"] = "0" * 64
        (root / "manifest.json").write_text(json.dumps(manifest))
        return root, "val_000000.bin: its SHA-256 is not its manifest's"
    raise ValueError(name)


@pytest.mark.parametrize("name", ["empty", "mixed", "truncated", "magic", "version", "manifest", "manifest-count",
                                  "unfinished", "missing-shard", "fifo-manifest", "odd", "deep-manifest",
                                  "deep-object-manifest", "changed-shard", "zeroed-hash"])
def test_a_bad_folder_is_refused_with_one_message(tmp_path, name):
    root, words = bad(tmp_path, name)
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_data(TrainConfig(data=str(root), vocab_size=VOCAB))


@pytest.mark.parametrize("name", ["truncated", "changed-shard"])
def test_a_bad_folder_exits_2_on_every_rank_before_anything_is_sent(tmp_path, name):
    root, words = bad(tmp_path, name)
    run = run_mpi(2, "-m", "minidist.train", "--steps", 2, "--dp", 2, "--data", root, "--vocab-size", VOCAB, check=False)
    assert run.returncode == 2, run.output
    assert words in run.stderr and run.stderr.count("python -m minidist.train:") == 1 and "Traceback" not in run.stderr


def test_a_shard_changed_during_the_run_is_named(folders, tmp_path):
    root = shutil.copytree(folders["prepared"], tmp_path / "p")
    corpus = open_corpus(root)
    shard = root / "train_000000.bin"
    data = bytearray(shard.read_bytes())
    data[HEADER_BYTES:HEADER_BYTES + 2] = (VOCAB + 5).to_bytes(2, "little")
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="train_000000.bin: token id 305 is outside the vocabulary of 300"):
        corpus.train.read(0, 10)


def test_each_ranks_trace_holds_the_bytes_it_read_and_a_data_row_per_step(folders, tmp_path):
    """End to end on 8 thread ranks (dp 2 x cp 2 x pp 2): every rank's trace has one ``read`` and one
    ``wait`` event of kind ``data`` per step, and each read's bytes, counted by the reader, are its share."""
    from minidist.inspect.load import load_run
    cfg = TrainConfig(**dict(RUN, n_layer=2), data=folders["llmc"], vocab_size=VOCAB, dp=2, cp=2, pp=2,
                      micro_batches=2, cp_algorithm="zigzag", trace=str(tmp_path / "run"))
    fit(cfg, 8)
    traces = load_run(tmp_path / "run").traces
    assert len(traces) == 8
    T, rows = cfg.block_size, cfg.batch_size // cfg.dp
    for t in traces:
        data = [e for e in t.events if e.kind == "data"]
        assert [e.op for e in data] == ["read", "wait"] * cfg.steps and [e.seq for e in data[::2]] == list(range(cfg.steps))
        assert {e.nbytes for e in data if e.op == "read"} == {rows * T // cfg.cp * 2}  # stage 0 ids, stage 1 targets
