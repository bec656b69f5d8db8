"""From a trainer's model and optimizer to checkpoint pieces, and back: where a layout meets the format.

A checkpoint holds GLOBAL tensors under single-process names: the GPT-2 parameters and, per
optimizer slot, ``slot/name`` (``exp_avg/transformer.h.0.attn.c_attn.weight``). This file says which
part of them this rank holds, as boxes (regions.py), using the tensor-parallel layout by name
(:func:`~minidist.parallel.tensor_parallel.tp_layout`):

    replicated   the whole tensor               written by tp rank 0 only
    column/row   one block along axis 0 / 1
    qkv          three row blocks: q_r, k_r, v_r (local rows [q_r; k_r; v_r])
    vocab        rows [r V_pad/n, (r+1) V_pad/n) clipped to V: padding rows are not stored, and
                 are zero when loaded

Data-parallel replicas hold the same values, so only dp rank 0 writes (ZeRO shards would each write
their own flat pieces: :class:`~minidist.checkpoint.regions.Flat`). Pipeline stages hold different
parameters under their GPT names; the last stage's copy of a tied embedding (``tied_copy``) is not
written and loads from ``transformer.wte.weight``. Loading asks for this rank's boxes of every
tensor it holds, whatever layout wrote them: that is resharding.
"""
from __future__ import annotations

from minidist.autograd import to_numpy
from minidist.checkpoint.regions import Piece, full_box
from minidist.parallel.tensor_parallel import padded_vocab_size, tp_layout
from minidist.parallel.tp_model import full_shape


def tp_regions(name: str, global_shape, tp_rank: int, tp_size: int) -> list:
    """Where this rank's local shard of parameter ``name`` (global ``global_shape``, ndim >= 1) sits
    in the global tensor: a list of (local row start, local row stop, global box). Local rows in no
    entry are vocabulary padding."""
    layout = tp_layout(name) if tp_size > 1 else "replicated"
    rest = full_box(global_shape[1:])
    if layout == "replicated":
        return [(0, global_shape[0], full_box(global_shape))]
    if layout == "vocab":
        rows = padded_vocab_size(global_shape[0], tp_size) // tp_size
        lo, hi = tp_rank * rows, min((tp_rank + 1) * rows, global_shape[0])
        return [(0, hi - lo, ((lo, hi),) + rest)] if hi > lo else []
    if layout == "qkv":
        rows = global_shape[0] // 3 // tp_size  # rows of q_r (= of k_r, v_r)
        return [(i * rows, (i + 1) * rows, ((i * rows * tp_size + tp_rank * rows,
                                             i * rows * tp_size + (tp_rank + 1) * rows),) + rest) for i in range(3)]
    axis = 0 if layout == "column" else 1
    width = global_shape[axis] // tp_size
    box = list(full_box(global_shape))
    box[axis] = (tp_rank * width, (tp_rank + 1) * width)
    return [(0, width if axis == 0 else global_shape[0], tuple(box))]


def _held(model, mesh):
    """(name in the checkpoint, local array name, Parameter, global shape) for every parameter this
    rank holds, tied copies under the name of the tensor they copy."""
    tp = mesh.tp_group.size
    for name, p in model.named_parameters():
        stored = "transformer.wte.weight" if getattr(p, "tied_copy", False) else name
        yield stored, name, p, full_shape(stored, p.data.shape, model.config, tp)


def training_pieces(model, optimizer, mesh) -> list:
    """This rank's pieces of the model and of the optimizer state (SGD/AdamW over
    ``model.named_parameters()``), each tensor written once over the whole mesh."""
    if mesh.dp_rank != 0:
        return []
    pieces = []
    for stored, name, p, shape in _held(model, mesh):
        if getattr(p, "tied_copy", False) or (tp_layout(stored) == "replicated" and mesh.tp_rank != 0):
            continue
        arrays = [(stored, p.data)] + [(f"{slot}/{stored}", state[name]) for slot, state in optimizer.state.items()]
        for global_name, local in arrays:
            local = to_numpy(local)
            for r0, r1, box in tp_regions(stored, shape, mesh.tp_rank, mesh.tp_group.size):
                pieces.append(Piece(global_name, local[r0:r1], shape, box))
    return pieces


def training_meta(mesh, optimizer) -> dict:
    """The layout and optimizer step count, for the manifest (other fields are the trainer's)."""
    s = mesh.shape
    return {"layout": {"dp": s.dp, "pp": s.pp, "tp": s.tp}, "optimizer_step": optimizer.step_count}


def load_training_state(ckpt, model, optimizer, mesh) -> None:
    """Fill ``model``'s parameters and ``optimizer``'s state, in place, with this rank's regions of
    the checkpoint ``ckpt`` (a :class:`~minidist.checkpoint.reader.Checkpoint` written by ANY
    layout); padding rows become zeros. Reads files only, sends nothing."""
    for stored, name, p, shape in _held(model, mesh):
        if shape != ckpt.global_shape(stored):
            raise ValueError(f"{stored}: the checkpoint holds {ckpt.global_shape(stored)}, this model {shape}")
        targets = [(stored, p.data)] + [(f"{slot}/{stored}", state[name]) for slot, state in optimizer.state.items()]
        for global_name, local in targets:
            local[...] = 0
            for r0, r1, box in tp_regions(stored, shape, mesh.tp_rank, mesh.tp_group.size):
                local[r0:r1] = ckpt.read(global_name, box)
    optimizer.step_count = ckpt.meta["optimizer_step"]
