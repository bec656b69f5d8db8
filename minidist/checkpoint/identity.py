"""A run's identity: what must be equal for a checkpoint to be continued, and what may differ.

``--resume`` continues THIS run. A checkpoint records the run that wrote it (the manifest's
``meta.run``), and resuming refuses a checkpoint whose identity differs in any field, naming each
one with its saved and its current value. The identity holds whatever changes the numbers:

    model         n_layer, n_head, n_embd, block_size; vocab_size when it is not the byte tokenizer's 256;
                  with experts also n_experts, top_k, moe_every, capacity_factor, aux_loss_coef
    seed          the initial weights and the order of the batches
    data          data_tokens and data_sha256: the training tokens themselves (not the file's name; of a
                  prepared shard folder, its manifest's train shards and their SHA-256)
    the math      optimizer, lr, min_lr, warmup, steps (the cosine schedule ends at ``steps``),
                  weight_decay, grad_clip, batch_size, dtype; momentum for SGD only; beta1, beta2 for
                  AdamW, no_bias and dropout (nanoGPT's knobs) where they are not the defaults;
                  loss_scale and loss_scale_window in mixed precision only

and nothing that only says HOW the same math is laid out: dp, tp, pp, ep, zero, offload, schedule, virtual
stages, sequence parallelism, recomputation, bucket size, device, backend and the world size may all
change (that is resharding), and so may ``micro_batches``: cutting a batch into micro-batches sums
the same per-example gradients with the same 1/B factor, equal in exact arithmetic; in floating point
it changes only the order of the sums, as changing dp does (the layouts agree to ~1e-10 in float64).
Nor what a run prints or writes (evaluation, outputs, checkpoint frequency).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

from minidist.amp import COMPUTE_DTYPES

MATH = ("n_layer", "n_head", "n_embd", "block_size", "seed", "optimizer", "lr", "min_lr", "warmup", "steps",
        "weight_decay", "grad_clip", "batch_size", "dtype")
EXPERTS = ("n_experts", "top_k", "moe_every", "capacity_factor", "aux_loss_coef")  # a mixture of experts' math


def data_identity(tokens) -> dict:
    """``data_tokens`` and ``data_sha256`` of a token array (its bytes: uint8 tokens, ~1 ms per MB)."""
    tokens = np.ascontiguousarray(tokens)
    return {"data_tokens": int(tokens.size), "data_sha256": hashlib.sha256(memoryview(tokens).cast("B")).hexdigest()}


def run_identity(cfg, data: dict, exempt=()) -> dict:
    """The identity of the run ``cfg`` (a TrainConfig) training on the data whose identity is ``data``
    (``data_tokens``, ``data_sha256``: :func:`data_identity`, or a shard folder's, data/folder.py), as
    stored in a checkpoint: a flat JSON object {field: value} (module docstring: which fields and why).
    ``exempt``: hyper-parameters left out, which a population-based member may change (train/pbt.py)."""
    fields = tuple(f for f in MATH if f not in exempt) + (("momentum",) if cfg.optimizer == "sgd" else ())
    fields += ("loss_scale", "loss_scale_window") if cfg.dtype in COMPUTE_DTYPES else ()
    fields += EXPERTS if cfg.n_experts else ()
    identity = {name: getattr(cfg, name) for name in fields}
    if getattr(cfg, "vocab_size", 0) not in (0, 256):  # a vocabulary other than bytes' (recorded since it exists)
        identity["vocab_size"] = cfg.vocab_size
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)} if dataclasses.is_dataclass(cfg) else {}
    knobs = ("no_bias", "dropout") + (("beta1", "beta2") if cfg.optimizer == "adamw" else ())
    identity.update({name: getattr(cfg, name) for name in knobs  # likewise: once set apart from the config's default
                     if hasattr(cfg, name) and getattr(cfg, name) != defaults.get(name)})
    identity.update(data)
    return json.loads(json.dumps(identity))  # as it reads back from the manifest: compared like for like


def identity_differences(saved, current: dict) -> list[str]:
    """One line per field in which the ``saved`` identity (read from a checkpoint) differs from the
    ``current`` one: ``seed: saved 0, now 1``. Empty when they are the same run."""
    if not isinstance(saved, dict):
        return [f"run identity: saved {saved!r}, now {current!r}"]
    lines = []
    for name in sorted(saved.keys() | current.keys(), key=lambda n: (n not in current, n)):
        before, now = saved.get(name, "(absent)"), current.get(name, "(absent)")
        if before != now or type(before) is not type(now) and not _same_number(before, now):
            lines.append(f"{name}: saved {before!r}, now {now!r}")
    return lines


def _same_number(a, b) -> bool:
    """1 and 1.0 are the same learning rate (JSON keeps what was written); True is not 1."""
    numbers = (int, float)
    return (isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool)
            and not isinstance(b, bool) and a == b)
