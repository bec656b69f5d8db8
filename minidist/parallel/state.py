"""The model's state as one object: what the gradient pipeline drives, and everything a reader asks of it.

A training run holds its parameters, gradients, optimizer state, float32 masters, loss scaler and
offload files in one of two ways, and the trainer builds exactly one of them (``train/build.py``):

    WholeState     whole tensors on every replica: SGD / AdamW (over mixed precision's float32
                   masters), DDP's buckets (compose/gradients.py's WholeGradients)
    ShardedState   ZeRO's flat shards over the replicas, their state on the device, the host or in
                   files (parallel/zero/optimizer.py's ZeroOptimizer)

Both answer the same questions, so nothing else asks which one runs:

    scaler                       mixed precision's loss scaler
    no_sync, between_micro_batches      backward without reducing: a pipeline's, a plain loop's
    parameter_count()            the parameters this rank holds (ZeRO-3: its shards)
    pieces(mesh), load(ckpt, mesh)      what a checkpoint saves and loads (checkpoint/layout.py)
    full_parameters()            a block in which the model holds its full values (the masters under
                                 mixed precision): what an export writes
    held_bytes(), master_bytes() the bytes of parameters, gradients and optimizer state it holds now;
                                 of them, the float32 masters
    memory_rows()                ZeRO's formula beside what it measures (none for whole tensors)
    explained()                  what --explain says of it (its ZeRO shards, its offload story)
    set_weight_decay(rate)       a population member's explored weight decay
    close()                      its offload files removed (however the run ends)
"""
from __future__ import annotations

import contextlib

from minidist.checkpoint.layout import load_whole, load_zero, whole_pieces, zero_pieces
from minidist.inspect import zero_memory
from minidist.inspect.accounting import unique_nbytes
from minidist.inspect.write import model_state_bytes
from minidist.parallel.compose.gradients import WholeGradients
from minidist.parallel.zero.full_state import full_parameters
from minidist.parallel.zero.optimizer import ZeroOptimizer


class WholeState(WholeGradients):
    """Whole tensors on every replica: ``model``'s parameters (or ``amp``'s float32 masters) updated by
    ``optimizer``, gradients averaged by the DataParallel ``dp`` (None: one replica)."""

    @property
    def scaler(self):
        return self.amp.scaler if self.amp is not None else None

    @property
    def no_sync(self):
        return self.dp.no_sync if self.dp is not None else contextlib.nullcontext

    @property
    def between_micro_batches(self):
        """What a step's backwards before its last micro-batch run in: DDP's no_sync (one reduction after
        the last), without data parallelism nothing."""
        return self.no_sync

    @property
    def step_count(self) -> int:
        return self.optimizer.step_count

    def parameter_count(self) -> int:
        return sum(p.data.size for p in self.model.parameters())

    def pieces(self, mesh) -> list:
        """This rank's checkpoint pieces (checkpoint/layout.py); reads memory only."""
        return whole_pieces(self.model, self.optimizer, mesh, self.amp)

    def load(self, ckpt, mesh) -> None:
        """This rank's regions of ``ckpt``, in place (parameters, masters, slots, scaler, step); reads files only."""
        load_whole(ckpt, self.model, self.optimizer, mesh, self.amp, self.scaler)

    @contextlib.contextmanager
    def full_parameters(self):
        """Inside the block the model's parameters hold mixed precision's float32 masters (whole tensors
        already hold their full values); sends nothing."""
        if self.amp is None:
            yield self.model
            return
        stored = [p.data for _, p in self.amp.pairs]
        for (_, p), master in zip(self.amp.pairs, self.amp.masters):
            p.data = master.data
        try:
            yield self.model
        finally:
            for (_, p), data in zip(self.amp.pairs, stored):
                p.data = data

    def held_bytes(self) -> dict:
        """Parameters, gradients and optimizer state (its moments, and mixed precision's float32 masters,
        as ZeRO counts them) this rank holds now, from the live arrays."""
        held = model_state_bytes(self.model, self.optimizer)
        held["optimizer"] += self.master_bytes()
        return held

    def master_bytes(self) -> int:
        """Of :meth:`held_bytes`'s optimizer bytes, mixed precision's float32 masters."""
        return unique_nbytes([m.data for m in self.amp.masters]) if self.amp is not None else 0

    def memory_rows(self) -> list:
        return []

    def explained(self) -> dict:
        return dict(zero=None, shards=None, notes=None)

    def set_weight_decay(self, rate: float) -> None:
        self.optimizer.set_weight_decay(rate)

    def close(self) -> None:
        """Nothing to remove."""


class ShardedState(ZeroOptimizer):
    """ZeRO's flat shards (its stage, its storage, its masters and scaler): :class:`ZeroOptimizer` with
    the questions of the module docstring answered."""

    @property
    def between_micro_batches(self):
        """Nothing: each micro-batch's gradients are reduced as its backward ends (stages 2 and 3
        reduce-scatter them, never holding a whole accumulated gradient); a pipeline engine, whose
        micro-batches interleave, accumulates inside :meth:`no_sync` instead."""
        return contextlib.nullcontext

    def parameter_count(self) -> int:
        return sum(s.unit.numel for s in self.shards)

    def pieces(self, mesh) -> list:
        return zero_pieces(self, mesh)

    def load(self, ckpt, mesh) -> None:
        load_zero(ckpt, self, mesh)

    def full_parameters(self):
        """Collective over the shards' groups: stage 3 all-gathers the parameters, mixed precision the
        float32 masters (zero/full_state.py)."""
        return full_parameters(self, masters=True)

    def held_bytes(self) -> dict:
        return zero_memory.model_state_bytes(self)

    def master_bytes(self) -> int:
        """Of :meth:`held_bytes`'s device optimizer bytes, the float32 master shards (none on the device
        under offload: they live with the moments)."""
        if not self.mixed_precision or self.offload is not None:
            return 0
        return sum(s.param.data.nbytes for s in self.shards)

    def memory_rows(self) -> list:
        offload = f" + offload to the {self.offload.where}" if self.offload is not None else ""
        return [{"label": f"ZeRO-{self.stage}{offload} formula", **zero_memory.formula(self)},
                {"label": "measured on rank 0", **zero_memory.model_state_bytes(self)}]

    def explained(self) -> dict:
        return dict(zero=(self.stage, self.shards), shards=self.shards if self.stage == 3 else None,
                    notes=self.offload.story() if self.offload is not None else None)

    def set_weight_decay(self, rate: float) -> None:
        self.optimizer.set_weight_decay(rate)
