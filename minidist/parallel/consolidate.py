"""One full-model state_dict from a model spread over tensor-parallel ranks.

Replicated parameters are already whole on every rank. A tensor-parallel parameter is a distinct
shard on each tp rank: the tp group all-gathers the shards and ``unshard`` (the TP engineer's inverse
of ``shard_for``) puts them back together. The result uses GPT-2 names and full shapes, the same
dict a single-process ``GPT.state_dict()`` gives, so it can be compared with one process or loaded
into PyTorch.
"""
from __future__ import annotations

from minidist.autograd import to_numpy
from minidist.parallel.tensor_parallel import unshard


def consolidated_state_dict(model, mesh) -> dict:
    """{GPT-2 name: full NumPy array} for every parameter name of ``model`` (a GPT or a
    tensor-parallel GPT with ``config``; tied weights under each name). Collective over ``mesh.tp_group``: each tensor-parallel parameter costs one all-gather of
    its shard (shards of one parameter have the same shape on every tp rank)."""
    full = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        value = to_numpy(p.data)
        if getattr(p, "tensor_parallel", False):
            gathered = mesh.tp_group.all_gather(value.reshape(-1).copy())  # (tp * shard size,)
            shards = [s.reshape(value.shape) for s in gathered.reshape(mesh.tp_group.size, -1)]
            value = unshard(name, shards, vocab_size=model.config.vocab_size)
        full[name] = value.copy()
    return full
