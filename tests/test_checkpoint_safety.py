"""A checkpoint never trusts its own files, and never reads or writes outside its folder.

- The manifest carries the sha256 of its own content: one flipped digit (data_position 200 -> 210)
  and the checkpoint is skipped for the previous one, with one line naming the file.
- Every field is checked against the schema before it is used: a manifest whose ``ranks`` is
  missing, [], null or [1, 2] (even with a correct checksum) is skipped with a message, never a
  KeyError or TypeError; so is anything a fuzzer makes of a manifest or a rank's JSON.
- A file a manifest names must be exactly ``rank-0000i.*`` inside the step folder and a regular
  file of the recorded size, checked BEFORE it is opened: ``../`` paths, absolute paths, links and
  ``/dev/zero`` are refused without reading them (the /dev/zero case runs under a time limit).
- Saving goes through a fresh hidden folder renamed into place: a ``step-*`` link planted in the
  checkpoint folder is replaced, never written through; removing old checkpoints never follows a
  link; stale corrupt folders do not confuse a fresh run's saves.
- ``--ckpt-dir`` that is a file or a link is refused at start-up.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minidist
from minidist.checkpoint import Checkpoint, CheckpointError, CheckpointWriter, Piece, latest_valid, step_dir, verify
from minidist.checkpoint.format import MANIFEST, manifest_digest, rank_file, rank_meta_file, sha256_bytes
from minidist.checkpoint.paths import ckpt_dir_problems
from minidist.train.config import ConfigError, TrainConfig, check_config

W = np.arange(12, dtype=np.float64)


def save(root, steps, world=2, meta=None, keep=5):
    """Checkpoints ``steps`` of a 12-vector cut in ``world`` row blocks (meta: data_position = step)."""
    def rank_fn(group):
        writer = CheckpointWriter(root, group, keep=keep)
        rows = np.array_split(np.arange(12), group.size)[group.rank]
        for step in steps:
            writer.save(step, [Piece("w", W[rows] + step, (12,), ((int(rows[0]), int(rows[-1]) + 1),))],
                        meta={"data_position": step, **(meta or {})})
    minidist.run_local(rank_fn, world)


def edit_manifest(folder, edit, resign=True):
    """Apply ``edit`` to the parsed manifest of ``folder``; ``resign``: store its new checksum, as a
    careful forger (or a buggy tool) would, so that only the schema can catch it."""
    path = Path(folder) / MANIFEST
    manifest = json.loads(path.read_text())
    edit(manifest)
    if resign:
        manifest["sha256"] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest, indent=1))


def edit_rank_meta(folder, rank, edit):
    """Apply ``edit`` to rank ``rank``'s JSON and re-sign it in the manifest."""
    path = Path(folder) / rank_meta_file(rank)
    info = json.loads(path.read_text())
    edit(info)
    data = json.dumps(info).encode()
    path.write_bytes(data)

    def record(m):
        m["ranks"][rank].update(meta_bytes=len(data), meta_sha256=sha256_bytes(data))
    edit_manifest(folder, record)


def skipped(root):
    """(latest_valid's choice, the lines it logged)."""
    lines = []
    return latest_valid(root, log=lines.append), lines


# ---- the manifest's own checksum, and its schema ---------------------------------------------------


def test_one_edited_digit_in_the_manifest_is_caught_by_its_checksum(tmp_path):
    save(tmp_path, [200, 201])
    path = step_dir(tmp_path, 201) / MANIFEST
    path.write_text(path.read_text().replace('"data_position": 201', '"data_position": 211'))
    found, lines = skipped(tmp_path)
    assert found == step_dir(tmp_path, 200)
    assert lines == [f"checkpoint step-000201 skipped: {path}: checksum mismatch " + lines[0].split("mismatch ")[1]]
    assert "the manifest was corrupted or edited" in lines[0]


@pytest.mark.parametrize("ranks", ["missing", [], None, [1, 2], [{"rank": 0}], "rank-00000.safetensors"])
def test_a_manifest_with_bad_ranks_is_skipped_with_a_message(tmp_path, ranks):
    save(tmp_path, [1, 2])

    def edit(m):
        if ranks == "missing":
            del m["ranks"]
        else:
            m["ranks"] = ranks
    edit_manifest(step_dir(tmp_path, 2), edit)
    found, lines = skipped(tmp_path)
    assert found == step_dir(tmp_path, 1)
    manifest = step_dir(tmp_path, 2) / MANIFEST
    assert len(lines) == 1 and lines[0].startswith(f"checkpoint step-000002 skipped: {manifest}: ")
    assert "ranks" in lines[0]


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(step=7), "step 7 is not the step of its folder"),
    (lambda m: m.update(world_size=0), "world_size 0 is not an integer >= 1"),
    (lambda m: m.update(world_size=True), "world_size True"),
    (lambda m: m["ranks"][1].update(bytes=-1), "ranks[1] has a size"),
    (lambda m: m["ranks"][0].update(sha256="00"), "ranks[0].sha256 is not 64 hex digits"),
    (lambda m: m["tensors"]["w"].update(dtype="object"), "dtype 'object'"),
    (lambda m: m["tensors"]["w"].update(dtype=["float64"]), "dtype ['float64']"),
    (lambda m: m["tensors"]["w"].update(global_shape=[12, -1]), "global_shape"),
    (lambda m: m["tensors"]["w"].update(global_shape=[10 ** 12]), "the manifest [1000000000000]"),
    (lambda m: m.update(world_size=1, ranks=m["ranks"][:1]), "w [12] has only 6 elements in the rank files"),
    (lambda m: m.update(meta=[]), "meta is not a JSON object"),
    (lambda m: m["meta"].update(data_position="3"), "meta.data_position '3'"),
    (lambda m: m.update(extra=1), "unknown fields extra"),
    (lambda m: m.update(version=1), "not a minidist-checkpoint version 2 manifest"),
])
def test_every_manifest_field_is_checked_against_the_schema(tmp_path, edit, message):
    save(tmp_path, [3])
    edit_manifest(step_dir(tmp_path, 3), edit)
    with pytest.raises(CheckpointError, match=rf"\.json: .*{_re(message)}"):
        verify(step_dir(tmp_path, 3))


@pytest.mark.parametrize("edit, message", [
    (lambda i: i["tensors"]["w[0:6]"].update(box=[[0, 13]]), "not inside w"),
    (lambda i: i["tensors"]["w[0:6]"].update(box=[[6, 0]]), "not inside w"),
    (lambda i: i["tensors"]["w[0:6]"].update(dtype="float32"), "the manifest"),
    (lambda i: i["tensors"]["w[0:6]"].update(name="v"), "a tensor the manifest does not list"),
    (lambda i: i["tensors"].update({"w[0:7]": i["tensors"].pop("w[0:6]")}), "stored under the wrong key"),
    (lambda i: i.update(file="../rank-00001.safetensors"), "file is"),
    (lambda i: i.update(rank=1), "rank is 1"),
    (lambda i: i.update(tensors=None), "tensors is not a JSON object"),
])
def test_every_rank_file_description_is_checked(tmp_path, edit, message):
    save(tmp_path, [3])
    edit_rank_meta(step_dir(tmp_path, 3), 0, edit)
    with pytest.raises(CheckpointError, match=f"{rank_meta_file(0)}: .*{_re(message)}"):
        verify(step_dir(tmp_path, 3))


def test_the_safetensors_header_must_hold_exactly_the_described_pieces(tmp_path):
    save(tmp_path, [3])
    edit_rank_meta(step_dir(tmp_path, 3), 1, lambda i: i["tensors"].update(
        {"w[6:12]": {**i["tensors"]["w[6:12]"], "box": [[0, 6]]}}))  # says w[0:6] lives under key w[6:12]
    with pytest.raises(CheckpointError, match="stored under the wrong key"):
        verify(step_dir(tmp_path, 3))


def _re(text):
    import re
    return re.escape(text)


SCALARS = (st.none() | st.booleans() | st.integers(-3, 2 ** 70) | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(max_size=4))  # JSON has no inf: a number too large for a float is the test below
JSON = st.recursive(SCALARS,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=6)


def _paths(obj, prefix=()):
    """Every (path, value) inside a JSON value."""
    yield prefix, obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from _paths(v, prefix + (k,))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_whatever_a_fuzzer_makes_of_the_json_verify_only_raises_checkpoint_error(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("fuzz")
    save(root, [1], world=2)
    folder = step_dir(root, 1)
    target = data.draw(st.sampled_from(["manifest", "rank"]))
    doc = json.loads((folder / (MANIFEST if target == "manifest" else rank_meta_file(1))).read_text())
    path, _ = data.draw(st.sampled_from(list(_paths(doc))[1:]))
    delete = data.draw(st.booleans())
    value = data.draw(JSON)

    def edit(obj):
        for k in path[:-1]:
            obj = obj[k]
        if delete:
            del obj[path[-1]]
        else:
            obj[path[-1]] = value
    if target == "manifest":
        edit_manifest(folder, edit)
    else:
        edit_rank_meta(folder, 1, edit)
    try:
        Checkpoint(folder).read_full("w")
    except CheckpointError:
        pass
    assert latest_valid(root, log=lambda line: None) in (None, folder)


def test_a_manifest_number_too_large_for_a_float_is_refused_not_a_crash(tmp_path):
    # json reads 1e400 as inf, which the manifest's own checksum cannot even be computed over: before
    # this check, resuming died with a ValueError instead of skipping the checkpoint
    save(tmp_path, [1], world=2)
    path = step_dir(tmp_path, 1) / MANIFEST
    text = path.read_text()
    path.write_text(text.replace('"step": 1', '"step": 1e400', 1))
    assert path.read_text() != text
    lines = []
    assert latest_valid(tmp_path, log=lines.append) is None
    assert "1e400 is not a number a checkpoint holds" in lines[0]


# ---- paths: only plain regular files inside the step folder, checked before opening ---------------


@pytest.mark.parametrize("where", ["relative", "absolute", "link"])
def test_a_manifest_naming_a_file_outside_its_folder_is_refused(tmp_path, where):
    save(tmp_path / "ckpt", [1, 2])
    folder = step_dir(tmp_path / "ckpt", 2)
    outside = tmp_path / "elsewhere" / "x.safetensors"  # a perfect copy, so only the path is wrong
    outside.parent.mkdir()
    shutil.copy(folder / rank_file(1), outside)
    if where == "link":
        (folder / rank_file(1)).unlink()
        (folder / rank_file(1)).symlink_to(outside)
    else:
        name = "../../elsewhere/x.safetensors" if where == "relative" else str(outside)
        edit_manifest(folder, lambda m: m["ranks"][1].update(file=name))
    found, lines = skipped(tmp_path / "ckpt")
    assert found == step_dir(tmp_path / "ckpt", 1) and len(lines) == 1
    assert ("a symbolic link, not a regular file" if where == "link" else
            "a checkpoint names only its own files") in lines[0]


DEV_ZERO_SCRIPT = """
import sys
from pathlib import Path
from minidist.checkpoint import latest_valid
root = Path(sys.argv[1])
print(latest_valid(root, log=print))
"""


def test_dev_zero_in_place_of_a_rank_file_is_refused_without_reading_it(tmp_path):
    save(tmp_path, [1, 2])
    folder = step_dir(tmp_path, 2)
    (folder / rank_file(0)).unlink()
    (folder / rank_file(0)).symlink_to("/dev/zero")
    edit_manifest(folder, lambda m: m["ranks"][0].update(bytes=0))  # what once made it read forever
    done = subprocess.run([sys.executable, "-c", DEV_ZERO_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "a symbolic link, not a regular file (refused without opening it)" in done.stdout
    assert done.stdout.strip().endswith(str(step_dir(tmp_path, 1)))


def test_a_device_named_by_the_manifest_is_refused_by_name(tmp_path):
    save(tmp_path, [1])
    edit_manifest(step_dir(tmp_path, 1), lambda m: m["ranks"][0].update(file="/dev/zero", bytes=0))
    with pytest.raises(CheckpointError, match="a checkpoint names only its own files"):
        verify(step_dir(tmp_path, 1))


def test_a_step_folder_that_is_a_link_is_never_read_and_never_written_through(tmp_path):
    outside = tmp_path / "outside"
    save(outside, [5])  # a valid checkpoint elsewhere
    before = {p.name: p.read_bytes() for p in step_dir(outside, 5).iterdir()}
    root = tmp_path / "ckpt"
    save(root, [4])
    step_dir(root, 5).symlink_to(step_dir(outside, 5), target_is_directory=True)
    found, lines = skipped(root)
    assert found == step_dir(root, 4) and "a symbolic link (refused" in lines[0]
    save(root, [5])  # the next save replaces the link; it writes nothing through it
    assert not step_dir(root, 5).is_symlink() and latest_valid(root) == step_dir(root, 5)
    assert {p.name: p.read_bytes() for p in step_dir(outside, 5).iterdir()} == before
    assert sorted(p.name for p in root.iterdir()) == ["step-000004", "step-000005"]  # no hidden leftovers


def test_removing_old_checkpoints_never_follows_a_link(tmp_path):
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data.txt").write_text("keep me")
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "step-000001").symlink_to(outside, target_is_directory=True)
    save(root, [2, 3, 4], keep=1)
    assert (outside / "data.txt").read_text() == "keep me"
    assert sorted(p.name for p in root.iterdir()) == ["step-000004"]


def test_a_root_that_is_a_link_is_refused_by_every_rank(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    with pytest.raises(CheckpointError, match="a symbolic link"):
        save(tmp_path / "link", [1])
    assert not list((tmp_path / "real").iterdir())
    found, lines = skipped(tmp_path / "link")
    assert found is None and "is a symbolic link" in lines[0]


def test_stale_corrupt_folders_do_not_confuse_a_fresh_runs_saves(tmp_path):
    for step, junk in ((2, b"{not json"), (9, b"")):
        step_dir(tmp_path, step).mkdir(parents=True)
        (step_dir(tmp_path, step) / MANIFEST).write_bytes(junk)
        (step_dir(tmp_path, step) / rank_file(0)).write_bytes(b"stale")
    (tmp_path / ".saving-0123456789abcdef-1-step-000002").mkdir()  # a crashed save of another session
    save(tmp_path, [2, 4], keep=2)
    found, lines = skipped(tmp_path)
    assert found == step_dir(tmp_path, 4) and len(lines) == 1 and "step-000009 skipped" in lines[0]
    assert Checkpoint(step_dir(tmp_path, 2)).read_full("w").tolist() == (W + 2).tolist()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000004", "step-000009"]


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    save(tmp_path, [3], world=3)
    save(tmp_path, [3], world=2)  # no rank-00002 files of the first save survive in the folder
    assert sorted(p.name for p in step_dir(tmp_path, 3).iterdir()) == [
        MANIFEST, rank_meta_file(0), rank_file(0), rank_meta_file(1), rank_file(1)]
    assert Checkpoint(step_dir(tmp_path, 3)).world_size == 2


# ---- --ckpt-dir at start-up --------------------------------------------------------------------------


def test_ckpt_dir_that_is_a_file_or_a_link_is_refused_at_start_up(tmp_path):
    (tmp_path / "file").write_text("")
    (tmp_path / "link").symlink_to(tmp_path, target_is_directory=True)
    assert ckpt_dir_problems(tmp_path / "new" / "ckpt") == [] and ckpt_dir_problems(tmp_path) == []
    assert "exists and is not a folder" in ckpt_dir_problems(tmp_path / "file")[0]
    assert "is a symbolic link" in ckpt_dir_problems(tmp_path / "link")[0]
    assert f"{tmp_path / 'file'} is not a folder" in ckpt_dir_problems(tmp_path / "file" / "sub")[0]
    with pytest.raises(ConfigError, match="--ckpt-dir .*file exists and is not a folder"):
        check_config(TrainConfig(ckpt_dir=str(tmp_path / "file"), save_every=1), 1)


def test_ckpt_dir_that_is_a_file_exits_with_status_2_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    done = subprocess.run([sys.executable, "-m", "minidist.train", "--steps", "1", "--ckpt-dir",
                           str(tmp_path / "file"), "--save-every", "1"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "exists and is not a folder" in done.stderr and "parameters" not in done.stdout
