"""Sharded checkpoints, in-process (ranks as threads): the rules.

- A piece is a box of a GLOBAL tensor; a ZeRO flat range is cut into at most 2*ndim-1 boxes that,
  read in order, are exactly those elements.
- Whatever boxes the ranks wrote, ANY region of ANY tensor reads back exactly (bitwise): that is
  resharding. Saving at one layout and reading at another needs nothing else.
- A checkpoint counts only when complete: no manifest -> skipped; a truncated or corrupted file ->
  skipped with a message naming the file and the problem; the previous valid one is used. A save
  that fails half-way (a rank dies between writes) leaves the previous checkpoint valid.
- Unwritten parts and inconsistent ranks are refused at save time: such a checkpoint never counts.
- An asynchronous save stores the values at the moment of the call, even if training overwrites
  them at once; it equals a blocking save.
- Only the newest ``keep`` complete checkpoints stay.
- The export is one safetensors file of whole parameters under GPT-2 names.
"""
import math

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st

import minidist
from minidist.checkpoint import (Checkpoint, CheckpointError, CheckpointWriter, Flat, Piece, export_safetensors,
                                 flat_boxes, full_box, latest_valid, step_dir)
from minidist.checkpoint import writer as writer_module
from minidist.checkpoint.format import MANIFEST, rank_file
from minidist.files import write_atomically
from minidist.checkpoint.regions import box_shape, slices

# ---- regions ------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=0, max_size=4), st.data())
def test_flat_range_cut_into_boxes_is_exactly_those_elements_in_order(shape, data):
    numel = math.prod(shape)
    lo = data.draw(st.integers(0, numel))
    hi = data.draw(st.integers(lo, numel))
    offset = data.draw(st.lists(st.integers(0, 3), min_size=len(shape), max_size=len(shape)))
    box = tuple((o, o + n) for o, n in zip(offset, shape))  # a box anywhere inside a bigger tensor
    big = np.arange(math.prod(o + n for o, n in zip(offset, shape))).reshape([o + n for o, n in zip(offset, shape)])
    boxes = flat_boxes(box, lo, hi)
    got = np.concatenate([big[slices(b, full_box(big.shape))].reshape(-1) for b in boxes] or [np.zeros(0, int)])
    assert got.tolist() == big[slices(box, full_box(big.shape))].reshape(-1)[lo:hi].tolist()
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_flat_boxes_example():
    assert flat_boxes(((0, 3), (0, 4)), 2, 11) == [((0, 1), (2, 4)), ((1, 2), (0, 4)), ((2, 3), (0, 3))]


# ---- helpers: a few global tensors, cut into pieces several ways -----------------------------------

TENSORS = {
    "transformer.wte.weight": (11, 6),
    "transformer.h.0.attn.c_attn.weight": (18, 6),
    "transformer.h.0.ln_1.bias": (6,),
    "exp_avg/transformer.wte.weight": (11, 6),
    "step": (),
}


def global_values(dtype="float64", seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(dtype) for n, s in TENSORS.items()}


def grid_pieces(values, rank, world):
    """Rank ``rank``'s pieces: each tensor split along axis 0 into ``world`` row blocks (tp-like)."""
    pieces = []
    for name, v in values.items():
        if v.ndim == 0:
            if rank == 0:
                pieces.append(Piece(name, v, v.shape, ()))
            continue
        lo, hi = _rows(v, rank, world)
        box = ((lo, hi),) + full_box(v.shape[1:])
        pieces.append(Piece(name, v[lo:hi], v.shape, box))
    return pieces


def _rows(v, rank, world):
    counts = [len(c) for c in np.array_split(np.arange(v.shape[0]), world)]
    lo = sum(counts[:rank])
    return lo, lo + counts[rank]


def flat_pieces(values, rank, world):
    """Rank ``rank``'s pieces as ZeRO would hold them: elements lo:hi of each flattened tensor."""
    pieces = []
    for name, v in values.items():
        counts = [len(c) for c in np.array_split(np.arange(v.size), world)]
        lo = sum(counts[:rank])
        hi = lo + counts[rank]
        pieces.append(Piece(name, v.reshape(-1)[lo:hi], v.shape, Flat(full_box(v.shape), lo, hi)))
    return pieces


def save_local(root, step, world, make_pieces, values, keep=3, async_=False, meta=None):
    def rank_fn(group):
        writer = CheckpointWriter(root, group, keep=keep)
        writer.save(step, make_pieces(values, group.rank, group.size), meta=meta or {"layout": {"world": world}},
                    rank_meta={"rank": group.rank}, async_=async_)
        writer.wait()
    minidist.run_local(rank_fn, world)


# ---- round trips and resharding -----------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("make_pieces", [grid_pieces, flat_pieces])
def test_every_tensor_reads_back_bitwise_whatever_the_cut(tmp_path, world, make_pieces):
    values = global_values()
    save_local(tmp_path, 5, world, make_pieces, values)
    ckpt = Checkpoint(latest_valid(tmp_path))
    assert ckpt.step == 5 and ckpt.world_size == world and ckpt.names == sorted(TENSORS)
    assert ckpt.meta == {"layout": {"world": world}} and ckpt.rank_meta[world - 1] == {"rank": world - 1}
    for name, v in values.items():
        got = ckpt.read_full(name)
        assert got.dtype == v.dtype and got.shape == v.shape and np.array_equal(got, v)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_any_region_of_any_tensor_reads_back_from_any_cut(tmp_path_factory, data):
    """The resharding engine: saved as row blocks on 3 ranks, read as random boxes and flat ranges."""
    root = tmp_path_factory.mktemp("ckpt")
    values = global_values(seed=data.draw(st.integers(0, 10)))
    save_local(root, 0, 3, data.draw(st.sampled_from([grid_pieces, flat_pieces])), values)
    ckpt = Checkpoint(step_dir(root, 0))
    for name, v in values.items():
        box = tuple(sorted(data.draw(st.lists(st.integers(0, n), min_size=2, max_size=2))) for n in v.shape)
        assert np.array_equal(ckpt.read(name, box), v[slices(box, full_box(v.shape))])
        lo = data.draw(st.integers(0, v.size))
        hi = data.draw(st.integers(lo, v.size))
        assert np.array_equal(ckpt.read(name, Flat(full_box(v.shape), lo, hi)), v.reshape(-1)[lo:hi])


def test_reading_outside_the_tensor_or_an_unknown_name_is_a_clear_error(tmp_path):
    save_local(tmp_path, 0, 2, grid_pieces, global_values())
    ckpt = Checkpoint(step_dir(tmp_path, 0))
    with pytest.raises(CheckpointError, match="not inside"):
        ckpt.read("transformer.wte.weight", ((0, 12), (0, 6)))  # 11 rows: padding is not stored
    with pytest.raises(CheckpointError, match="no tensor named 'nope'"):
        ckpt.read_full("nope")


# ---- what counts as a checkpoint ---------------------------------------------------------------


def two_checkpoints(root):
    values = [global_values(seed=1), global_values(seed=2)]
    save_local(root, 10, 2, grid_pieces, values[0])
    save_local(root, 20, 2, grid_pieces, values[1])
    return values


def test_missing_manifest_means_incomplete_and_the_previous_is_used(tmp_path):
    two_checkpoints(tmp_path)
    (step_dir(tmp_path, 20) / MANIFEST).unlink()
    lines = []
    assert latest_valid(tmp_path, log=lines.append) == step_dir(tmp_path, 10)
    assert lines == [f"checkpoint step-000020 skipped: {step_dir(tmp_path, 20) / MANIFEST}: missing "
                     f"(the save never finished)"]


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:len(b) // 2], "truncated"),
    (lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:], "checksum mismatch"),
])
def test_truncated_or_corrupted_rank_file_is_detected_and_the_previous_used(tmp_path, damage, message, capsys):
    values = two_checkpoints(tmp_path)
    bad = step_dir(tmp_path, 20) / rank_file(1)
    bad.write_bytes(damage(bad.read_bytes()))
    found = latest_valid(tmp_path)
    err = capsys.readouterr().err
    assert found == step_dir(tmp_path, 10)
    assert str(bad) in err and message in err
    assert np.array_equal(Checkpoint(found).read_full("transformer.wte.weight"), values[0]["transformer.wte.weight"])
    with pytest.raises(CheckpointError, match=message):
        Checkpoint(step_dir(tmp_path, 20))


def test_no_valid_checkpoint_gives_none(tmp_path):
    assert latest_valid(tmp_path / "never-written") is None
    (tmp_path / "step-000003").mkdir()
    assert latest_valid(tmp_path, log=lambda line: None) is None


def test_a_rank_dying_between_writes_leaves_the_previous_checkpoint_valid(tmp_path, monkeypatch):
    values = global_values()
    save_local(tmp_path, 10, 2, grid_pieces, values, keep=1)

    def dies_before_its_metadata(path, data):
        if path.name == "rank-00001.json":  # rank 1 wrote its tensors, then dies
            raise RuntimeError("rank 1 killed mid-save")
        write_atomically(path, data)

    monkeypatch.setattr(writer_module, "write_atomically", dies_before_its_metadata)
    with pytest.raises(Exception, match="killed mid-save"):
        save_local(tmp_path, 20, 2, grid_pieces, values, keep=1)
    assert not step_dir(tmp_path, 20).exists()  # the partial save never took a checkpoint's name
    assert latest_valid(tmp_path, log=lambda line: None) == step_dir(tmp_path, 10)  # keep=1 removed nothing


def test_pieces_that_leave_part_of_a_tensor_unwritten_never_count(tmp_path):
    values = global_values()

    def rank_fn(group):
        pieces = [p for p in grid_pieces(values, group.rank, group.size)
                  if not (group.rank == 1 and p.name == "transformer.h.0.ln_1.bias")]
        with pytest.raises(CheckpointError, match="transformer.h.0.ln_1.bias|rank 0 could not commit"):
            CheckpointWriter(tmp_path, group).save(0, pieces)

    minidist.run_local(rank_fn, 2)
    assert latest_valid(tmp_path, log=lambda line: None) is None


def test_bad_pieces_are_refused_before_anything_is_written(tmp_path):
    def rank_fn(group):
        writer = CheckpointWriter(tmp_path, group)
        with pytest.raises(ValueError, match="region .* has shape"):
            writer.save(0, [Piece("w", np.zeros((2, 3)), (4, 3), ((0, 3), (0, 3)))])
        with pytest.raises(ValueError, match="does not lie inside"):
            writer.save(0, [Piece("w", np.zeros((2, 3)), (4, 3), ((3, 5), (0, 3)))])
        with pytest.raises(ValueError, match="1-D array of 4"):
            writer.save(0, [Piece("w", np.zeros((2, 3)), (4, 3), Flat(((0, 4), (0, 3)), 0, 4))])

    minidist.run_local(rank_fn, 1)
    assert not list(tmp_path.iterdir())


def test_only_the_newest_keep_checkpoints_stay(tmp_path):
    values = global_values()

    def rank_fn(group):
        writer = CheckpointWriter(tmp_path, group, keep=2)
        for step in (1, 2, 3, 4):
            writer.save(step, grid_pieces(values, group.rank, group.size))

    minidist.run_local(rank_fn, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003", "step-000004"]


# ---- asynchronous saves -------------------------------------------------------------------------


def test_async_save_stores_the_values_at_the_call_and_equals_a_blocking_save(tmp_path):
    values = global_values()

    def rank_fn(group):
        live = {n: v.copy() for n, v in values.items()}  # what "training" keeps updating
        writer = CheckpointWriter(tmp_path / "async", group)
        writer.save(7, grid_pieces(live, group.rank, group.size), async_=True)
        for v in live.values():  # the next optimizer step, while the save runs
            v[...] = -1.0
        group.all_reduce(np.ones(4))  # training collectives on the training group meanwhile
        writer.wait()
        CheckpointWriter(tmp_path / "sync", group).save(7, grid_pieces(values, group.rank, group.size))

    minidist.run_local(rank_fn, 3)
    a, s = Checkpoint(step_dir(tmp_path / "async", 7)), Checkpoint(step_dir(tmp_path / "sync", 7))
    for name, v in values.items():
        assert np.array_equal(a.read_full(name), v) and np.array_equal(s.read_full(name), v)
    for r in range(3):
        assert (a.dir / rank_file(r)).read_bytes() == (s.dir / rank_file(r)).read_bytes()


def test_async_save_error_is_raised_by_wait(tmp_path):
    values = global_values()

    def rank_fn(group):
        pieces = [p for p in grid_pieces(values, group.rank, group.size) if group.rank == 0 or p.name != "step"]
        if group.rank == 1:
            pieces = pieces[1:]  # leaves rows of the first tensor unwritten
        writer = CheckpointWriter(tmp_path, group)
        writer.save(0, pieces, async_=True)
        with pytest.raises(CheckpointError):
            writer.wait()

    minidist.run_local(rank_fn, 2)


# ---- export ----------------------------------------------------------------------------------------


def test_export_is_one_safetensors_file_of_whole_parameters_with_gpt2_names(tmp_path):
    values = global_values(dtype="float32")
    save_local(tmp_path, 3, 4, flat_pieces, values)
    written = export_safetensors(step_dir(tmp_path, 3), tmp_path / "model.safetensors")
    loaded = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    params = {n for n in TENSORS if "/" not in n}
    assert set(loaded) == set(written) == params
    for name in params:
        assert loaded[name].shape == box_shape(full_box(TENSORS[name])) and np.array_equal(loaded[name], values[name])


def test_export_loads_into_pytorch(tmp_path):
    torch_safetensors = pytest.importorskip("safetensors.torch")
    values = global_values(dtype="float32")
    save_local(tmp_path, 3, 2, grid_pieces, values)
    export_safetensors(step_dir(tmp_path, 3), tmp_path / "model.safetensors")
    loaded = torch_safetensors.load_file(tmp_path / "model.safetensors")
    assert np.array_equal(loaded["transformer.wte.weight"].numpy(), values["transformer.wte.weight"])
