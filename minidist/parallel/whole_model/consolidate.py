"""One full-model state_dict from a model spread over tensor-parallel ranks and pipeline stages.

Replicated parameters are already whole on every rank. A tensor-parallel parameter is a distinct
shard on each tp rank: the tp group all-gathers the shards and ``unshard`` (tensor/layout.py's inverse
of ``shard_for``) puts them back together. Pipeline stages hold different parameters under their
GPT-2 names: pp rank 0 receives every other stage's dict and takes the union. The result uses GPT-2
names and full shapes, the same dict a single-process ``GPT.state_dict()`` gives, so it can be
compared with one process or loaded into PyTorch.
"""
from __future__ import annotations

import json
import math

import numpy as np

from minidist.autograd import get_array_module, to_numpy
from minidist.parallel.tensor.layout import unshard


def consolidated_state_dict(model, mesh) -> dict:
    """{GPT-2 name: full NumPy array} for every parameter name of ``model`` (a GPT, a tensor-parallel
    GPT or a PipelineStage, with ``config``; tied weights under each name). Collective over
    ``mesh.tp_group``: each tensor-parallel parameter costs one all-gather of its shard (shards of one
    parameter have the same shape on every tp rank), in the parameter's memory (host or GPU); under
    expert parallelism also over ``mesh.ep_group``: each stacked expert parameter costs one
    all-gather of this rank's block of experts (blocks in ep-rank order along axis 0). The result is
    copied to the host."""
    full = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        value = p.data
        if p.tensor_parallel:
            value = unshard(name, _gather_blocks(value, mesh.tp_group), vocab_size=model.config.vocab_size)
        if p.expert and mesh.ep_group is not None:
            value = get_array_module(value).concatenate(_gather_blocks(value, mesh.ep_group))
        full[name] = to_numpy(value).copy()
    return full


def _gather_blocks(value, group) -> list:
    """Every rank of ``group``'s ``value`` (one shape on all), in rank order: one all-gather."""
    gathered = group.all_gather(value.reshape(-1).copy(), label=f"parameter: every {group.name.split('[')[0]} "
                                "rank's shard, for the whole model")  # (n * size,)
    return [block.reshape(value.shape) for block in gathered.reshape(group.size, -1)]


def gather_state_dicts(state: dict, group, dst: int = 0) -> dict | None:
    """On rank ``dst`` of ``group``: the union of every rank's ``state`` ({name: array}), in rank
    order (a name held by several ranks keeps the value of the last); None elsewhere.

    No pickle: each rank sends two ``group.gather_bytes``, a JSON header (name, shape, dtype per
    array) and the arrays' bytes back to back in the header's order."""
    header = json.dumps([[name, value.shape, value.dtype.str] for name, value in state.items()]).encode()
    headers = group.gather_bytes(header, dst, label="parameter: each stage's names, shapes and dtypes, to rank 0")
    payloads = group.gather_bytes(b"".join(np.ascontiguousarray(v).tobytes() for v in state.values()), dst,
                                  label="parameter: each stage's whole parameters, to rank 0")
    if headers is None:
        return None
    merged = {}
    for header, payload in zip(headers, payloads):
        offset = 0
        for name, shape, dtype in json.loads(header):
            value = np.frombuffer(payload, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)
            merged[name] = value.copy()  # writable, like the arrays it was sent from
            offset += value.nbytes
    return merged


def full_state_dict(model, mesh) -> dict | None:
    """The whole model's {GPT-2 name: full array} on global rank 0, None elsewhere. ``model`` is this
    rank's GPT, tensor-parallel GPT or PipelineStage. Collective over the mesh: dp x cp rank 0's tp groups
    (and its ep group's, which hold the other experts) consolidate their shards
    (:func:`consolidated_state_dict`), then dp x cp rank 0's tp rank 0 sends its stage's dict to pp
    rank 0 (:func:`gather_state_dicts`); the other dp replicas and cp ranks hold the same values and
    send nothing. With tied embeddings ``lm_head.weight`` comes from the last stage (the same values)."""
    if mesh.expert_dp_group.rank != 0:  # dp replicas and cp ranks hold the same parameters
        return None
    state = consolidated_state_dict(model, mesh)
    if mesh.dp_cp_group.rank != 0 or mesh.tp_rank != 0:  # an ep rank > 0 gave its experts above
        return None
    return gather_state_dicts(state, mesh.pp_group, dst=0)
