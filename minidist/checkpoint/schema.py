"""What a manifest and a rank's JSON must look like, checked field by field before anything in them is used.

A checkpoint read back is untrusted input: every field's type and range is checked here, so a
damaged or hand-edited file is refused with one :class:`CheckpointError` naming the file and the
field, never a KeyError or TypeError half-way through loading. The rules:

    manifest.json   format, version; sha256 = its own checksum (format.manifest_digest);
                    step: int >= 0, the step in the folder's name; world_size: int >= 1;
                    ranks: exactly world_size entries, entry i = {rank: i, file: rank-0000i.safetensors,
                    meta_file: rank-0000i.json, bytes / meta_bytes: ints >= 0, sha256 / meta_sha256:
                    64 hex digits}; tensors: {name: {global_shape: ints >= 0 (at most 8 axes),
                    dtype: one of DTYPES}}; meta: a dict (data_position, if there, an int >= 0)
    rank-i.json     format, version, rank i, the manifest's step, file, bytes and sha256;
                    tensors: {key: {name (a tensor of the manifest), its global_shape and dtype,
                    box: one [start, stop] per axis inside the global shape}}, key = name[box];
                    rank_meta: a dict; and the safetensors header holds exactly those keys, each of
                    its box's shape and dtype
"""
from __future__ import annotations

import math
import re

from minidist.checkpoint.format import FORMAT, VERSION, CheckpointError, manifest_digest, piece_key, rank_file, \
    rank_meta_file, step_of
from minidist.checkpoint.paths import MAX_JSON_BYTES
from minidist.untrusted import json_of

DTYPES = {"float16": "F16", "float32": "F32", "float64": "F64", "int8": "I8", "int16": "I16", "int32": "I32",
          "int64": "I64", "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL"}
"""The dtypes a checkpoint may hold (NumPy name -> safetensors code)."""
MAX_NDIM = 8
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
MANIFEST_KEYS = {"format", "version", "step", "world_size", "meta", "ranks", "tensors", "sha256"}
RANK_ENTRY_KEYS = {"rank", "file", "bytes", "sha256", "meta_file", "meta_bytes", "meta_sha256"}
RANK_META_KEYS = {"format", "version", "rank", "step", "file", "bytes", "sha256", "tensors", "rank_meta"}


def _no_constants(name):
    raise ValueError(f"{name} is not a number a checkpoint holds")


def _finite(text):
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a number a checkpoint holds")
    return value


def parse_json(data: bytes, where, what: str = "a checkpoint's JSON") -> object:
    """The JSON value in ``data`` (read from ``where``), read as every untrusted file is
    (minidist/untrusted.py: nested at most 64 deep); CheckpointError if it is not strict JSON, or
    holds a number no float can (``1e400``: Python would read it as inf, which no checkpoint writes)."""
    return json_of(data, where, what, CheckpointError, parse_constant=_no_constants, parse_float=_finite)


def is_int(value, low: int = 0, high: float = math.inf) -> bool:
    """Whether ``value`` is a JSON integer (not a bool) in [low, high]."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _need(ok: bool, where, what: str) -> None:
    if not ok:
        raise CheckpointError(f"{where}: {what}")


def _keys(obj, keys: set, where, what: str) -> None:
    _need(isinstance(obj, dict), where, f"{what} is not a JSON object")
    missing, extra = sorted(keys - obj.keys()), sorted(obj.keys() - keys)
    _need(not missing, where, f"{what} lacks {', '.join(missing)}")
    _need(not extra, where, f"{what} has unknown fields {', '.join(extra)}")


def check_manifest(manifest, path, step_dir) -> dict:
    """``manifest`` (parsed from ``path`` in folder ``step_dir``) if it passes its checksum and the
    schema, else CheckpointError naming ``path`` and the first problem."""
    _need(isinstance(manifest, dict), path, "not a JSON object")
    _need(manifest.get("format") == FORMAT and manifest.get("version") == VERSION, path,
          f"not a {FORMAT} version {VERSION} manifest")
    digest = manifest.get("sha256")
    _need(isinstance(digest, str) and _HEX64.match(digest) is not None, path, "no sha256 of its own content")
    _need(manifest_digest(manifest) == digest, path, f"checksum mismatch (sha256 {manifest_digest(manifest)[:12]}..., "
          f"it says {digest[:12]}...): the manifest was corrupted or edited")
    _keys(manifest, MANIFEST_KEYS, path, "the manifest")
    step, world = manifest["step"], manifest["world_size"]
    _need(is_int(step) and step == step_of(step_dir), path, f"step {step!r} is not the step of its folder")
    _need(is_int(world, 1), path, f"world_size {world!r} is not an integer >= 1")
    ranks = manifest["ranks"]
    _need(isinstance(ranks, list) and len(ranks) == world, path, f"ranks is not a list of world_size = {world} entries")
    for i, entry in enumerate(ranks):
        _keys(entry, RANK_ENTRY_KEYS, path, f"ranks[{i}]")
        _need(is_int(entry["rank"]) and entry["rank"] == i, path, f"ranks[{i}] says rank {entry['rank']!r}")
        _need(entry["file"] == rank_file(i) and entry["meta_file"] == rank_meta_file(i), path,
              f"ranks[{i}] names files {entry['file']!r}, {entry['meta_file']!r}, not {rank_file(i)}, "
              f"{rank_meta_file(i)} (refused: a checkpoint names only its own files)")
        _need(is_int(entry["bytes"]) and is_int(entry["meta_bytes"], 0, MAX_JSON_BYTES), path,
              f"ranks[{i}] has a size that is not an integer in range")
        for field in ("sha256", "meta_sha256"):
            _need(isinstance(entry[field], str) and _HEX64.match(entry[field]) is not None, path,
                  f"ranks[{i}].{field} is not 64 hex digits")
    tensors = manifest["tensors"]
    _need(isinstance(tensors, dict), path, "tensors is not a JSON object")
    for name, spec in tensors.items():
        _need(name != "", path, "a tensor has an empty name")
        _keys(spec, {"global_shape", "dtype"}, path, f"tensor {name!r}")
        shape = spec["global_shape"]
        _need(isinstance(shape, list) and len(shape) <= MAX_NDIM and all(is_int(n) for n in shape), path,
              f"tensor {name!r} has global_shape {shape!r}, not at most {MAX_NDIM} integers >= 0")
        _need(isinstance(spec["dtype"], str) and spec["dtype"] in DTYPES, path,
              f"tensor {name!r} has dtype {spec['dtype']!r}, not one of {', '.join(DTYPES)}")
    meta = manifest["meta"]
    _need(isinstance(meta, dict), path, "meta is not a JSON object")
    _need("data_position" not in meta or is_int(meta["data_position"]), path,
          f"meta.data_position {meta.get('data_position')!r} is not an integer >= 0")
    return manifest


def check_rank_meta(info, path, rank: int, manifest: dict) -> dict:
    """``info`` (rank ``rank``'s JSON, read from ``path``) if it agrees with ``manifest`` and the
    schema, else CheckpointError naming ``path`` and the first problem."""
    _keys(info, RANK_META_KEYS, path, "the rank file description")
    entry = manifest["ranks"][rank]
    _need(info["format"] == FORMAT and info["version"] == VERSION, path, f"not a {FORMAT} version {VERSION} file")
    for field, expected in (("rank", rank), ("step", manifest["step"]), ("file", entry["file"]),
                            ("bytes", entry["bytes"]), ("sha256", entry["sha256"])):
        _need(info[field] == expected and not isinstance(info[field], bool), path,
              f"{field} is {info[field]!r}, the manifest says {expected!r}")
    _need(isinstance(info["rank_meta"], dict), path, "rank_meta is not a JSON object")
    _need(isinstance(info["tensors"], dict), path, "tensors is not a JSON object")
    for key, desc in info["tensors"].items():
        _keys(desc, {"name", "global_shape", "dtype", "box"}, path, f"piece {key!r}")
        name, box = desc["name"], desc["box"]
        spec = manifest["tensors"].get(name) if isinstance(name, str) else None
        _need(spec is not None, path, f"piece {key!r} is of {name!r}, a tensor the manifest does not list")
        _need(desc["global_shape"] == spec["global_shape"] and desc["dtype"] == spec["dtype"], path,
              f"piece {key!r} says {name} is {desc['global_shape']!r} {desc['dtype']!r}, the manifest "
              f"{spec['global_shape']} {spec['dtype']}")
        shape = spec["global_shape"]
        _need(isinstance(box, list) and len(box) == len(shape) and all(
            isinstance(pair, list) and len(pair) == 2 and is_int(pair[0]) and is_int(pair[1], pair[0], n)
            for pair, n in zip(box, shape)), path, f"piece {key!r} has box {box!r}, not inside {name} {shape}")
        _need(key == piece_key(name, box), path, f"piece {key!r} is stored under the wrong key")
    return info


def check_safetensors_header(header: dict, path, info: dict) -> None:
    """CheckpointError unless ``header`` ({key: (shape, safetensors dtype code)} of the file
    ``path``) holds exactly the pieces ``info`` describes, each of its box's shape and dtype."""
    pieces = info["tensors"]
    _need(header.keys() == pieces.keys(), path, f"holds keys {sorted(header.keys() ^ pieces.keys())[:3]} "
          "that its description does not list, or lacks ones it does")
    for key, desc in pieces.items():
        shape, code = header[key]
        want = [b - a for a, b in desc["box"]]
        _need(list(shape) == want and code == DTYPES[desc["dtype"]], path,
              f"piece {key!r} is {code} {list(shape)}, its description says {desc['dtype']} {want}")


def check_training_meta(meta: dict, step: int, where) -> None:
    """CheckpointError unless ``meta`` is a trainer's: layout {dp, pp, tp} ints >= 1 (and cp, ep, written
    since context and expert parallelism, also ints >= 1 when there), optimizer_step
    an int >= 0, data_position equal to the checkpoint's ``step`` (the state after that many steps),
    run a JSON object (identity.py)."""
    layout = meta.get("layout")
    _need(isinstance(layout, dict) and all(is_int(layout.get(a), 1) for a in ("dp", "pp", "tp"))
          and is_int(layout.get("cp", 1), 1) and is_int(layout.get("ep", 1), 1), where,
          f"meta.layout {layout!r} is not {{dp, pp, cp, tp, ep}} of integers >= 1")
    _need(is_int(meta.get("optimizer_step")), where, f"meta.optimizer_step {meta.get('optimizer_step')!r} is not an "
          "integer >= 0")
    _need(is_int(meta.get("data_position")) and meta["data_position"] == step, where,
          f"meta.data_position {meta.get('data_position')!r} is not the checkpoint's step {step}")
    _need(isinstance(meta.get("run"), dict), where, "meta.run (the run identity) is missing: written by an older "
          "minidist, or not by the trainer")
    if meta["run"].get("dtype") in ("float16", "bfloat16"):  # mixed precision: the loss scaler's state
        scaler = meta.get("loss_scaler")
        _need(isinstance(scaler, dict) and isinstance(scaler.get("scale"), (int, float))
              and 0 < scaler["scale"] < float("inf") and is_int(scaler.get("clean_steps"))
              and is_int(scaler.get("skipped_steps")), where,
              f"meta.loss_scaler {scaler!r} is not {{scale: a positive finite number, clean_steps, skipped_steps: "
              "integers >= 0}}")
