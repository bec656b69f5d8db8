"""From a trainer's model and optimizer to checkpoint pieces, and back: where a layout meets the format.

A checkpoint holds GLOBAL tensors under single-process names: the GPT-2 parameters and, per
optimizer slot, ``slot/name`` (``exp_avg/transformer.h.0.attn.c_attn.weight``). This file says which
part of them this rank holds, as boxes (regions.py), using the tensor-parallel layout by name
(:func:`~minidist.parallel.tensor.tensor_parallel.tp_layout`):

    replicated   the whole tensor               written by tp rank 0 only
    column/row   one block along axis 0 / 1
    qkv          three row blocks: q_r, k_r, v_r (local rows [q_r; k_r; v_r])
    vocab        rows [r V_pad/n, (r+1) V_pad/n) clipped to V: padding rows are not stored, and
                 are zero when loaded

Data-parallel replicas (and context-parallel ranks, which hold the same parameters) hold the same
values, so only rank 0 of the dp x cp group writes (of an expert parameter: rank 0 of the ranks
holding the same experts, :func:`~minidist.parallel.compose.grad_ownership.replica_group`; under expert
parallelism each ep rank holds a block of the experts, written as its box along axis 0). Under ZeRO each dp x cp rank holds
elements ``lo:hi`` of every unit's flat vector (flat_buffer.py), so each writes its own flat pieces:
where the shard crosses a parameter (or one box of its tp shard), a
:class:`~minidist.checkpoint.regions.Flat` range of that box. Pipeline stages hold different
parameters under their GPT names; the last stage's copy of a tied embedding (``tied_copy``) is not
written and loads from ``transformer.wte.weight``. Loading asks for this rank's boxes of every
tensor it holds, whatever layout wrote them: that is resharding.
"""
from __future__ import annotations

import math

from minidist.autograd import get_array_module, to_numpy
from minidist.checkpoint.regions import Flat, Piece
from minidist.parallel.compose.grad_ownership import counted_in_norm, replica_group
from minidist.parallel.tensor.layout import full_shape, regions as tp_regions  # where a tp shard's rows sit
from minidist.parallel.zero.full_state import masters_to_model


def _stored_name(name: str, p) -> str:
    """The checkpoint name of parameter ``p``: a pipeline stage's tied copy is the tensor it copies."""
    return "transformer.wte.weight" if p.tied_copy else name


def _held(model, mesh, amp=None):
    """(name in the checkpoint, local array name, Parameter, global shape) for every parameter this
    rank holds, tied copies under the name of the tensor they copy. Under mixed precision (``amp``)
    the parameters are its float32 masters: what a checkpoint keeps and a resume continues from."""
    tp = mesh.tp_group.size
    for name, p in amp.master_parameters() if amp is not None else model.named_parameters():
        stored = _stored_name(name, p)
        yield stored, name, p, full_shape(stored, p.data.shape, model.config, tp)


def _written_here(p, mesh) -> bool:
    """Whether this rank writes its part of ``p``: the rank that owns its
    gradient elements in the norm (:func:`~minidist.parallel.compose.grad_ownership.counted_in_norm`), so
    a tied copy never, a tp-replicated tensor on tp rank 0 only, a tp shard on every tp rank."""
    return counted_in_norm(p, mesh.tp_rank)


def _regions(stored: str, shape, mesh) -> list:
    """This rank's boxes of tensor ``stored`` (global ``shape``): its tp shard, and of a stacked
    expert parameter its ep block (tensor/layout.py)."""
    return tp_regions(stored, shape, mesh.tp_rank, mesh.tp_group.size, mesh.ep_rank, mesh.shape.ep)


def zero_regions(unit, config, mesh):
    """Where this rank's ZeRO shard ``unit.lo:unit.hi`` of a unit's flat vector sits in the global
    tensors: (stored name, Parameter, global shape, shard start, shard stop, :class:`Flat` region)
    for every stretch of the shard inside one parameter and one box of its tp shard. Vocabulary
    padding rows lie in no stretch."""
    for (name, p), start, shape in zip(unit.params, unit.starts, unit.shapes):
        stored = _stored_name(name, p)
        global_shape = full_shape(stored, shape, config, mesh.tp_group.size)
        row = math.prod(shape[1:])  # elements per local row
        for r0, r1, box in _regions(stored, global_shape, mesh):
            first, last = start + r0 * row, start + r1 * row  # the box's elements in the flat vector
            lo, hi = max(unit.lo, first), min(unit.hi, last)
            if lo < hi:
                yield stored, p, global_shape, lo - unit.lo, hi - unit.lo, Flat(box, lo - first, hi - first)


def whole_pieces(model, optimizer, mesh, amp=None) -> list:
    """This rank's pieces of the model and of the optimizer state (SGD/AdamW over
    ``model.named_parameters()`` or mixed precision's masters, ``amp``), each tensor written once over
    the whole mesh: by rank 0 of its replicas, each tp shard's box by its tp rank."""
    pieces = []
    for stored, name, p, shape in _held(model, mesh, amp):
        if replica_group(p, mesh.dp_cp_group, mesh.expert_dp_group).rank != 0 or not _written_here(p, mesh):
            continue
        arrays = [(stored, p.data)] + [(f"{slot}/{stored}", state[name]) for slot, state in optimizer.state.items()]
        for global_name, local in arrays:
            local = to_numpy(local)
            for r0, r1, box in _regions(stored, shape, mesh):
                pieces.append(Piece(global_name, local[r0:r1], shape, box))
    return pieces


def zero_pieces(zero, mesh) -> list:
    """Every dp x cp rank's own flat pieces of a ZeroOptimizer ``zero``: its shard of the parameters
    (``shard.param``, which ZeRO-3 keeps alone; float32 masters under mixed precision) and of each
    optimizer slot. Stage 0 (offload without ZeRO) shards nothing: each unit's first replica writes it whole."""
    pieces = []
    for s in zero.shards:
        if not zero.partitions.optimizer_states and s.group.rank != 0:
            continue
        arrays = [("", s.param.data)] + [(f"{slot}/", state) for slot, state in s.state.items()]
        for stored, p, shape, a, b, flat in zero_regions(s.unit, zero.model.config, mesh):
            if _written_here(p, mesh):
                pieces += [Piece(prefix + stored, to_numpy(array[a:b]), shape, flat) for prefix, array in arrays]
    return pieces


def training_meta(mesh, optimizer, scaler=None) -> dict:
    """The layout and optimizer step count, for the manifest (other fields are the trainer's); under
    mixed precision the loss scaler's state (scale, clean and skipped steps) too."""
    s = mesh.shape
    meta = {"layout": {"dp": s.dp, "pp": s.pp, "cp": s.cp, "tp": s.tp, "ep": s.ep}, "optimizer_step": optimizer.step_count}
    if scaler is not None:
        meta["loss_scaler"] = {k: v.item() for k, v in scaler.state_dict().items()}
    return meta


def load_whole(ckpt, model, optimizer, mesh, amp=None, scaler=None) -> None:
    """Fill ``model``'s parameters and ``optimizer``'s state, in place, with this rank's regions of
    the checkpoint ``ckpt`` (a :class:`~minidist.checkpoint.reader.Checkpoint` written by ANY
    layout); padding rows become zeros. Under mixed precision ``amp``'s float32 masters are read and
    the model gets them rounded to its dtype exactly as after an update, and ``scaler`` its saved
    state. Reads files only, sends nothing."""
    _load_boxes(ckpt, model, optimizer.state, mesh, amp)
    if amp is not None:
        amp.cast_to_model()
    _load_meta(ckpt, optimizer, scaler)


def load_zero(ckpt, zero, mesh) -> None:
    """The same for a ZeroOptimizer ``zero``: its flat shards; in stages 0-2 the full parameters as
    well (every dp rank computes with all of them), in stage 3 the shards are all it keeps; the model's
    values then from the masters (zero/full_state.py). Reads files only, sends nothing."""
    if zero.stage != 3:
        _load_boxes(ckpt, zero.model, {}, mesh)
    _load_zero(ckpt, zero.model, zero, mesh)
    masters_to_model(zero)
    _load_meta(ckpt, zero, zero.scaler)


def _load_meta(ckpt, optimizer, scaler) -> None:
    if scaler is not None:
        scaler.load_state_dict(ckpt.meta["loss_scaler"])
    optimizer.step_count = ckpt.meta["optimizer_step"]


def _check_shape(ckpt, stored: str, shape) -> None:
    if shape != ckpt.global_shape(stored):
        raise ValueError(f"{stored}: the checkpoint holds {ckpt.global_shape(stored)}, this model {shape}")


def _load_boxes(ckpt, model, state: dict, mesh, amp=None) -> None:
    """Every parameter's tp shard (and its ``state`` slots: {slot: {name: array}}) from its boxes;
    ``amp``'s float32 masters instead of the model's parameters under mixed precision."""
    for stored, name, p, shape in _held(model, mesh, amp):
        _check_shape(ckpt, stored, shape)
        targets = [(stored, p.data)] + [(f"{slot}/{stored}", arrays[name]) for slot, arrays in state.items()]
        for global_name, local in targets:
            local[...] = 0
            for r0, r1, box in _regions(stored, shape, mesh):
                local[r0:r1] = get_array_module(local).asarray(ckpt.read(global_name, box))  # host -> its memory


def _load_zero(ckpt, model, optimizer, mesh) -> None:
    """Each ZeRO shard's parameter values and optimizer slots from their flat regions."""
    for s in optimizer.shards:
        arrays = [("", s.param.data)] + [(f"{slot}/", state) for slot, state in s.state.items()]
        for _, array in arrays:
            array[...] = 0
        for stored, _, shape, a, b, flat in zero_regions(s.unit, model.config, mesh):
            _check_shape(ckpt, stored, shape)
            for prefix, array in arrays:
                array[a:b] = get_array_module(array).asarray(ckpt.read(prefix + stored, flat))
