"""ZeRO (Rajbhandari et al., 2020): data parallelism without N copies of the model states.

Plain data parallelism keeps on every one of the N ranks the full parameters (P bytes), gradients
(G) and optimizer state (O: SGD's momentum, AdamW's two moments; under mixed precision also the
float32 master weights). ZeRO partitions them across the dp ranks, unit by unit (flat_buffer.py:
each unit is a flat vector cut by ``numpy.array_split``). :data:`~minidist.optim.zero_stages.STAGES` is the whole difference
between the stages:

    stage  what each rank holds      per step it sends (per rank, ring algorithms)
    0      P + G + O                 all-reduce G                                 2 (N-1)/N G
    1      P + G + O/N               reduce-scatter G, all-gather P               (N-1)/N (G + P)
    2      P + (G + O)/N             the same, the reduce-scatters during backward (N-1)/N (G + P)
    3      (P + G + O)/N             all-gather P twice, reduce-scatter G         3 (N-1)/N P

Stage 1: backward fills the full gradients as usual; then each unit's gradient is reduce-scattered
(op "avg"), so rank r receives the average of ITS shard only; it updates its shard with its shard
of the optimizer state, and an all-gather brings every rank the updated parameters.
Stage 2: the same, but each unit is reduce-scattered as soon as backward has finished its gradients
(grad-ready hooks) and the full gradients are dropped: only the shard is kept. Under ``no_sync()``
(a pipeline's micro-batches but the last) the full gradients accumulate instead, and the last
backward reduce-scatters them once: torchtitan's FSDP with pipelining does the same.
Stage 3: the parameters are sharded as well, gathered around each use (stage3.py).

Mixed precision (float32 masters of the shards) is shard.py's; offload (ZeRO-Offload, ZeRO-Infinity:
the shards' state in host memory or files, updated there, bitwise the same run) is the storage the
shards delegate to (storage.py, offload.py).

What ZeRO does NOT do itself: complete the gradients over the other axes (sequence-parallel sums over
tp, tied embedding copies), agree on overflow, clip, or scale the loss. Those steps belong to the one
gradient pipeline every layout runs (minidist/parallel/compose/gradients.py), which calls this class
for the three things ZeRO changes: how gradients are reduced (:meth:`reduce`), where the optimizer
state lives and is updated (the shards, their storage: :meth:`update`), and how parameters are
published (cast to the compute dtype, all-gathered).

    zero = ZeroOptimizer(model, mesh.dp_group, stage=2, optimizer="adamw", lr=3e-3, weight_decay=0.1)
    zero.zero_grad()
    loss.backward()                              # stage 2: reduce-scatters run inside backward
    apply_gradients(zero, lr=3e-3, max_norm=1.0) # reduce, complete, clip, update, publish
"""
from __future__ import annotations

from contextlib import contextmanager

from minidist.amp import to_compute, unscale
from minidist.optim import OPTIMIZERS
from minidist.optim.zero_stages import STAGES
from minidist.parallel.compose.clip import clip_shards
from minidist.parallel.compose.complete import complete_shards, tied_copies
from minidist.parallel.compose.grad_ownership import ReplicaGroups
from minidist.parallel.zero import stage3
from minidist.parallel.zero.flat_buffer import FlatUnit, units_by_module
from minidist.parallel.zero.shard import Shard, make_shard
from minidist.parallel.zero.storage import OnDevice


class ZeroOptimizer:
    """SGD (with momentum) or AdamW over ZeRO-partitioned model states.

    ``model``'s parameters (a GPT, its tensor-parallel shard, or a pipeline stage of either) are
    grouped into units (one per block, one per other module). ``group``: the dp group, or a
    :class:`~minidist.parallel.compose.grad_ownership.ReplicaGroups` (dp x cp with its data replicas,
    and the experts' own group). ``stage`` 0-3 as in :data:`STAGES`; ``optimizer`` "sgd" or "adamw"
    with its hyper-parameters ``hyper`` (those of :class:`~minidist.optim.SGD` / :class:`~minidist.optim.AdamW`;
    weight decay 0 unless given), run over the shards. ``mixed_precision`` ("float16" / "bfloat16")
    with ``scaler`` (its DynamicLossScaler over the world): float32 masters and moments.
    ``offload``: an :class:`~minidist.parallel.zero.offload.Offload` keeping the shards' state (and
    under stage 3 with its ``params`` the parameter shards) off the device. ``reshard_after_forward``
    (stage 3): False keeps a unit gathered from its first forward of a step to its last backward
    (pipelines).
    """

    def __init__(self, model, group, stage: int, optimizer: str = "adamw", *, mixed_precision: str | None = None,
                 scaler=None, offload=None, reshard_after_forward: bool = True, **hyper):
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
        if (mixed_precision is None) != (scaler is None):
            raise ValueError("mixed precision needs both its compute dtype and a loss scaler")
        self.replicas = group if isinstance(group, ReplicaGroups) else ReplicaGroups(group)
        self.model, self.group, self.stage, self.partitions = model, self.replicas.group, stage, STAGES[stage]
        self.mixed_precision, self.scaler = mixed_precision, scaler
        self.offload, self.storage = offload, offload if offload is not None else OnDevice()
        if self.storage.params and not self.partitions.parameters:
            raise ValueError("offloading the parameters moves ZeRO-3's parameter shards: stages 0-2 keep every "
                             "parameter whole on each rank")
        self._in_flight, self._no_sync = None, False  # stages 2, 3: the shard whose reduce-scatter is queued
        self._reduced = False  # this step's gradients are reduced (reduce() runs once per step)
        self.shards, tied = [], tied_copies(model)
        for name, params in units_by_module(model.named_parameters()):
            unit_group = self.replicas.of(params[0][1])  # a unit holds experts only, or none
            rank, size = (unit_group.rank, unit_group.size) if self.partitions.optimizer_states else (0, 1)
            self.shards.append(make_shard(FlatUnit(name, params, rank, size), unit_group, self.storage,
                                          sharded_params=self.partitions.parameters,
                                          full_grads=not self.partitions.gradients, tied=tied,
                                          slots=OPTIMIZERS[optimizer].slots, mixed_precision=mixed_precision))
        self.optimizer = OPTIMIZERS[optimizer]([(s.name, s.param) for s in self.shards], **{"weight_decay": 0.0, **hyper})
        self.optimizer.decay_masks = {s.name: s.decay for s in self.shards}
        for s in self.shards:  # the state the storage placed (on the device, the host or in files)
            for slot, array in s.state.items():
                self.optimizer.state[slot][s.name] = array
        self._hooks = [p.register_grad_ready_hook(lambda p, s=s: self._grad_ready(s))
                       for s in self.shards for _, p in s.unit.params] if self.partitions.gradients else []
        self.gatherer = (stage3.fully_shard(model, self.shards, reshard_after_forward, offload)
                         if self.partitions.parameters else None)
        self.zero_grad()

    @property
    def step_count(self) -> int:
        return self.optimizer.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.optimizer.step_count = value

    # ---- reduce: over the data replicas ------------------------------------------------------------

    def zero_grad(self) -> None:
        """Forget the gradients: the next backward starts from nothing. Stages 0 and 1 zero the flat
        gradient buffers and point every ``p.grad`` at its view (backward accumulates in place);
        stages 2 and 3 drop the full gradients and the shards."""
        self.storage.begin_step()
        self._reduced = False
        for s in self.shards:
            s.grad, s.param.grad, s.ready, s.work = None, None, 0, None
            if s.grad_flat is not None:
                s.grad_flat[...] = 0
            views = s.unit.views(s.grad_flat) if s.grad_flat is not None else [None] * len(s.unit.params)
            for (_, p), view in zip(s.unit.params, views):
                p.grad = view

    @contextmanager
    def no_sync(self):
        """Backwards inside accumulate full gradients without reducing them (stages 2, 3; stages 0 and
        1 reduce after backward anyway): the next backward outside reduces the sum once."""
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def _grad_ready(self, s: Shard) -> None:
        """Stages 2, 3 hook: once every parameter of the unit has its final gradient of this backward,
        queue the unit's reduce-scatter (async: it overlaps the rest of backward) and drop the full
        gradients; stage 3 frees the full parameters too. The previous unit's reduce-scatter is
        collected first, so at most one unit's full gradient is alive beside the shards. Under
        :meth:`no_sync` nothing is sent (stage 3 still frees when it reshards after forward)."""
        s.ready += 1
        if s.ready < len(s.unit.params):
            return
        s.ready = 0
        if not self._no_sync:
            self._collect()
            s.work = reduce_scatter_grads(s.unit, s.group, self.replicas, async_op=True)
            self._in_flight = s
        if self.gatherer is not None and (not self._no_sync or self.gatherer.reshard_after_forward):
            self.gatherer.free([s])

    def _collect(self) -> None:
        """Wait for the reduce-scatter in flight and add it into its unit's gradient shard (and tell
        the storage: offload copies it down now when nothing else will change it)."""
        s, self._in_flight = self._in_flight, None
        if s is not None:
            grad = s.work.wait()  # (hi - lo,)
            s.grad = grad if s.grad is None else s.grad + grad
            s.work = None
            self.storage.reduced(s)

    def reduce(self) -> None:
        """Step 1 of the gradient pipeline: make ``shard.grad`` the gradient averaged over the unit's
        replicas, in the model's dtype. Stage 0 all-reduces each unit's flat gradient (numel,), stage
        1 reduce-scatters it (each rank receives its (hi - lo,) part); stages 2 and 3 sent their
        reduce-scatters during backward and collect the last one here. Once per step: a second call
        (a lesson measuring memory after it, then running the pipeline) does nothing."""
        if self._reduced:
            return
        self._reduced = True
        for s in self.shards:
            if s.grad_flat is None:
                continue
            op = self.replicas.reduce_op(s.grad_flat, s.group)
            if self.partitions.optimizer_states:  # my part of the average, written over my part of the buffer
                s.grad = s.group.reduce_scatter(s.grad_flat, op=op, out=s.grad_flat[s.unit.lo:s.unit.hi],
                                                label=f"gradient: ZeRO-1 reduce-scatter {s.name}")
            else:
                s.grad = s.group.all_reduce(s.grad_flat, op=op, label=f"gradient: average {s.name}")  # (numel,)
        self._collect()
        missing = [s.name for s in self.shards if s.ready or s.grad is None]
        if missing:
            raise RuntimeError(f"no complete gradient for units {missing}: did backward reach every parameter?")

    def complete(self, tp_group, tied_group) -> None:
        """Step 2, on the shards (:func:`~minidist.parallel.compose.complete.complete_shards`)."""
        complete_shards(self.shards, tied_copies(self.model), tp_group, tied_group)

    def reduced_grads(self) -> list:
        """The reduced gradient shards, still scaled (what found-inf reads)."""
        return [s.grad for s in self.shards]

    def unscale(self, scale: float) -> None:
        """Step 3: each shard's gradient where the update runs (the storage's, e.g. host memory), as
        ``shard.param.grad``: divided by ``scale`` into float32 under mixed precision."""
        for s, g in zip(self.shards, self.storage.to_update(self.shards)):
            s.param.grad = unscale(g, scale, self.mixed_precision) if self.mixed_precision else g

    def clip(self, max_norm: float, mesh) -> float:
        """Step 4, on the shards (:func:`~minidist.parallel.compose.clip.clip_shards`)."""
        return clip_shards(self.shards, max_norm, self.partitions.optimizer_states, self.group, mesh)

    # ---- update and publish -----------------------------------------------------------------------

    def update(self, lr: float) -> None:
        """Steps 5 and 6: update this rank's shard of every unit with its gradient shard and optimizer
        state (one SGD / AdamW update per shard, where the storage keeps it), cast it to the model's
        dtype, then, in stages 1 and 2, all-gather each unit's shards so every rank holds the new full
        parameters (sends its shard to every rank of the unit's group, in the model's dtype)."""
        self.optimizer.lr = lr
        self.optimizer.step_count += 1
        gathers = []
        for s in self.storage.visit(self.shards):  # offload: its state read (ahead) before, written back after
            self.optimizer.update(s.name)
            self.storage.publish(self.compute_value(s), s.compute)
            if self.partitions.optimizer_states and not self.partitions.parameters:  # overlaps the next update
                gathers.append(s.group.all_gather(s.compute, count=s.unit.numel, out=s.flat, async_op=True,
                                                  label=f"parameter: ZeRO all-gather {s.name}"))
        for work in gathers:
            work.wait()
        self.skip()

    def compute_value(self, s: Shard):
        """The shard's new parameters in the model's dtype, from its master (rounded under mixed precision)."""
        return to_compute(s.param.data, self.mixed_precision) if self.mixed_precision else s.param.data

    def skip(self) -> None:
        """The step ends (updated, or skipped on overflow): nothing gathered outlives it."""
        if self.gatherer is not None:
            self.gatherer.free_all()

    def close(self) -> None:
        """Remove the offload files, if any, and the gradient hooks (the end of a run, or of this
        optimizer when a new one takes the model over, e.g. on the survivors of a lost replica)."""
        for hook in self._hooks:
            hook.remove()
        self.storage.close()


def reduce_scatter_grads(unit: FlatUnit, group, replicas: ReplicaGroups, async_op: bool = False):
    """Flatten the unit's full parameter gradients, drop them, and reduce-scatter the flat vector
    (averaged over the data replicas of ``group``: ``replicas.reduce_op``), in the gradients' dtype:
    returns this rank's averaged gradient shard (hi - lo,), or with ``async_op`` the Work whose
    ``wait()`` returns it."""
    flat = unit.flatten([p.grad for _, p in unit.params])  # (numel,)
    for _, p in unit.params:
        p.grad = None
    return group.reduce_scatter(flat, op=replicas.reduce_op(flat, group), async_op=async_op,
                                label=f"gradient: ZeRO reduce-scatter {unit.name}")  # (hi - lo,)
