"""``verify`` checks that the saved boxes of each tensor cover it exactly once: counting elements is not enough.

A checkpoint whose boxes add up to a tensor's size but overlap (and so leave a hole), every checksum
valid, used to pass ``verify``, then fail at load with no fallback, and the launcher's
``latest_valid`` picked it again on every restart. Now it is skipped for the previous checkpoint like
any other damage, with a line naming the tensor; and the writer never commits such a save.
"""
import json
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save

import minidist
from minidist.checkpoint import Checkpoint, CheckpointError, CheckpointWriter, Piece, latest_valid, step_dir, verify
from minidist.checkpoint.format import MANIFEST, manifest_digest, piece_key, rank_file, rank_meta_file, sha256_bytes
from minidist.checkpoint.regions import coverage_problem

W = np.arange(24, dtype=np.float64).reshape(4, 6)


def save_grid(root, steps):
    """Checkpoints ``steps`` of the (4, 6) tensor ``w``, 2 ranks of 2 rows each."""
    def rank_fn(group):
        writer = CheckpointWriter(root, group, keep=5)
        rows = (2 * group.rank, 2 * group.rank + 2)
        for step in steps:
            writer.save(step, [Piece("w", W[rows[0]:rows[1]] + step, W.shape, (rows, (0, 6)))],
                        meta={"data_position": step})
    minidist.run_local(rank_fn, 2)


def move_box(folder, rank, box):
    """Re-key rank ``rank``'s one piece of ``w`` to ``box`` (same shape: the element count still adds up)
    and re-sign everything as the writer does: the rank file's size and sha256 in its JSON, the JSON's
    in the manifest, the manifest's own. Only the boxes can tell."""
    folder = Path(folder)
    (old_key, array), = load_file(folder / rank_file(rank)).items()
    new_key = piece_key("w", box)
    data = save({new_key: array})
    (folder / rank_file(rank)).write_bytes(data)
    info = json.loads((folder / rank_meta_file(rank)).read_text())
    desc = info["tensors"].pop(old_key)
    info["tensors"][new_key] = {**desc, "box": [list(pair) for pair in box]}
    info.update(bytes=len(data), sha256=sha256_bytes(data))
    raw = json.dumps(info).encode()
    (folder / rank_meta_file(rank)).write_bytes(raw)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["ranks"][rank].update(bytes=len(data), sha256=sha256_bytes(data), meta_bytes=len(raw),
                                   meta_sha256=sha256_bytes(raw))
    manifest["sha256"] = manifest_digest(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("box, twice, hole", [
    (((1, 3), (0, 6)), 6, [3, 0]),  # rows 1:3 instead of 2:4: row 1 twice, row 3 in no box
    (((0, 2), (0, 6)), 12, [2, 0]),  # the same rows as rank 0: rows 2 and 3 in no box
])
def test_boxes_that_add_up_but_leave_a_hole_are_skipped_for_the_previous_checkpoint(tmp_path, box, twice, hole):
    save_grid(tmp_path, [1, 2])
    move_box(step_dir(tmp_path, 2), 1, box)
    with pytest.raises(CheckpointError, match=rf"tensor w \[4, 6\] has boxes that overlap \({twice} elements stored "
                                              rf"twice\) and leave {twice} elements in no box, the first at \{hole}"):
        verify(step_dir(tmp_path, 2))
    lines = []
    assert latest_valid(tmp_path, log=lines.append) == step_dir(tmp_path, 1)
    assert len(lines) == 1 and lines[0].startswith("checkpoint step-000002 skipped: ") and "tensor w" in lines[0]
    np.testing.assert_array_equal(Checkpoint(latest_valid(tmp_path, log=lambda line: None)).read_full("w"), W + 1)


def test_an_intact_checkpoint_still_verifies_after_re_signing(tmp_path):
    save_grid(tmp_path, [1])
    verify(step_dir(tmp_path, 1))
    move_box(step_dir(tmp_path, 1), 1, ((2, 4), (0, 6)))  # the same box, re-signed: still exact
    verify(step_dir(tmp_path, 1))


def test_the_writer_never_commits_pieces_that_overlap(tmp_path):
    def rank_fn(group):  # both ranks write all of w: every element twice
        with pytest.raises(CheckpointError, match="exactly once: tensor w .* boxes overlap|rank 0 could not commit"):
            CheckpointWriter(tmp_path, group).save(0, [Piece("w", W, W.shape, ((0, 4), (0, 6)))])
    minidist.run_local(rank_fn, 2)
    assert latest_valid(tmp_path, log=lambda line: None) is None


@pytest.mark.parametrize("shape, boxes, problem", [
    ((4, 6), [((0, 2), (0, 6)), ((2, 4), (0, 6))], None),
    ((4, 6), [((0, 4), (0, 3)), ((0, 4), (3, 6))], None),
    ((), [()], None),
    ((0, 3), [], None),
    ((4, 6), [((0, 2), (0, 6))], "has only 12 elements"),
    ((4, 6), [((0, 4), (0, 6)), ((0, 1), (0, 1))], "has 25 elements .* boxes overlap"),
    ((4, 6), [((0, 4), (0, 3)), ((0, 4), (2, 5))], r"leave 4 elements in no box, the first at \[0, 5\]"),
    ((), [(), ()], "has 2 elements"),
])
def test_coverage_problem(shape, boxes, problem):
    found = coverage_problem(shape, boxes)
    assert found is None if problem is None else re.search(problem, found), found
