"""PipelineStage: the part of the model one pipeline rank holds, as a module.

The GPT is cut where ``minidist.model`` cuts it: ``embed`` on the first stage, then the blocks in
order (split by cost: partition.py), then ``head`` (final LayerNorm, LM head, loss) on the last.
"""
from __future__ import annotations

import numpy as np

from minidist import nn
from minidist.model import dropout_of
from minidist.parallel.pipeline.actions import rank_stages
from minidist.parallel.pipeline.partition import layers_for, partition_layers  # noqa: F401 (plan/models.py)
from minidist.parallel.pipeline.tied_embeddings import tied_head

_SHARED_ATTRIBUTES = ("config", "tp_group", "sequence_parallel", "context_parallel", "cross_entropy",
                      "heads")  # what embed, head and dropout read


class PipelineStage(nn.Module):
    """The part of ``model`` (a GPT, maybe already tensor-, context- or expert-parallel) that rank
    ``pp_rank`` of ``pp_size`` holds: ``virtual_stages`` chunks, chunk c being global stage
    ``self.stages[c]`` (placed as actions.py says). ``layers_per_stage`` (one count per stage)
    overrides the split by ``costs`` (partition.py). Parameters keep their GPT names, so optimizers,
    data parallelism and state dicts work unchanged. The tied embedding's ends: tied_embeddings.py."""

    def __init__(self, model, pp_rank: int, pp_size: int, virtual_stages: int = 1, layers_per_stage=None,
                 costs=None, placement: str = "loop"):
        super().__init__()
        for name in _SHARED_ATTRIBUTES:
            if hasattr(model, name):
                setattr(self, name, getattr(model, name))
        self._model_type = type(model)
        n_layer, n_stages = model.config.n_layer, pp_size * virtual_stages
        layers_per_stage = layers_for(model.config, n_stages, costs) if layers_per_stage is None else layers_per_stage
        if len(layers_per_stage) != n_stages or sum(layers_per_stage) != n_layer or min(layers_per_stage) < 1:
            raise ValueError(f"layers_per_stage {list(layers_per_stage)} must give each of the {n_stages} stages "
                             f"at least one block, {n_layer} in all")
        starts = np.concatenate([[0], np.cumsum(layers_per_stage)])
        self.layers_per_stage = list(layers_per_stage)
        self.pp_rank, self.pp_size, self.n_stages, self.placement = pp_rank, pp_size, n_stages, placement
        self.stages = rank_stages(pp_rank, pp_size, virtual_stages, placement)  # chunk -> global stage
        self.holds_first, self.holds_last = 0 in self.stages, n_stages - 1 in self.stages
        self.layers = [range(int(starts[s]), int(starts[s + 1])) for s in self.stages]  # chunk -> blocks
        t = model.transformer
        parts = dict(wte=t.wte, wpe=t.wpe) if self.holds_first else {}
        parts["h"] = nn.ModuleDict({str(i): t.h[i] for layers in self.layers for i in layers})
        if self.holds_last:
            parts["ln_f"] = t.ln_f
        self.transformer = nn.ModuleDict(parts)
        if self.holds_last:
            self.lm_head = tied_head(self, model)

    def forward(self, chunk: int, x, targets=None, dropout=None):
        """Chunk ``chunk``: ids (B, T) or activations (B, T, C) in; activations (B, T, C) out, or on
        the last stage the mean cross-entropy (the logits (B, T, V), or this tp rank's slice of them,
        without ``targets``: generation). ``dropout``: the micro-batch's DropoutKey, or None."""
        stage, drop = self.stages[chunk], dropout_of(self, dropout)
        if stage == 0:
            x = self._model_type.embed(self, x, drop)  # (B, T, C)
        for i in self.layers[chunk]:
            x = self.transformer.h[str(i)](x, drop)  # (B, T, C)
        if stage == self.n_stages - 1:
            logits, loss = self._model_type.head(self, x, targets)
            return logits if targets is None else loss
        return x

    def activation_shape(self, batch_rows: int, seq_len: int) -> tuple[int, int, int]:
        """The (B, T, C) shape stages send each other (T / cp under context parallelism, and / tp
        under sequence parallelism)."""
        if self.context_parallel is not None:
            seq_len //= self.context_parallel.size
        if getattr(self, "sequence_parallel", False):
            seq_len //= self.tp_group.size
        return batch_rows, seq_len, self.config.n_embd
