"""ZeRO (Rajbhandari et al., 2020): data parallelism without N copies of the model states.

Plain data parallelism keeps on every one of the N ranks the full parameters (P bytes), gradients
(G) and optimizer state (O: SGD's momentum, AdamW's two moments; under mixed precision also the
float32 master weights). ZeRO partitions them across the dp ranks, unit by unit (flat_buffer.py:
each unit is a flat vector cut by ``numpy.array_split``). :data:`STAGES` is the whole difference
between the stages:

    stage  what each rank holds      per step it sends (per rank, ring algorithms)
    0      P + G + O                 all-reduce G                                 2 (N-1)/N G
    1      P + G + O/N               reduce-scatter G, all-gather P               (N-1)/N (G + P)
    2      P + (G + O)/N             the same, the reduce-scatters during backward (N-1)/N (G + P)
    3      (P + G + O)/N             all-gather P twice, reduce-scatter G         3 (N-1)/N P

Mixed precision, the paper's way (its memory model: 2Ψ + 2Ψ + 12Ψ for Adam): the model's
parameters and gradients are in the compute dtype (float16 / bfloat16: P = G = 2Ψ bytes), and the
optimizer holds float32 MASTER weights and moments, sharded like the rest of O (4 + 4 + 4 = K = 12
bytes per parameter). The gradients are reduced in the compute dtype (half the bytes), each rank
unscales ITS gradient shard into float32, one found-inf flag is agreed over the whole world, and the
update runs on the master shard; the shard is cast to the compute dtype and (stages 1, 2) all-gathered,
or (stage 3) kept to be gathered at its next use.

Stage 1: backward fills the full gradients as usual; then each unit's gradient is reduce-scattered
(op "avg"), so rank r receives the average of ITS shard only; it updates its shard with its shard
of the optimizer state, and an all-gather brings every rank the updated parameters.
Stage 2: the same, but each unit is reduce-scattered as soon as backward has finished its gradients
(grad-ready hooks) and the full gradients are dropped: only the shard is kept. Under ``no_sync()``
(a pipeline's micro-batches but the last) the full gradients accumulate instead, and the last
backward reduce-scatters them once: torchtitan's FSDP with pipelining does the same.
Stage 3: the parameters are sharded as well, gathered around each use (zero3.py).

Offload (offload.py, ZeRO-Offload and ZeRO-Infinity) moves a shard's optimizer state (and under
ZeRO-3 its parameter shard) to host memory or files: the reduced gradient shard goes down, the
update runs on the host, the new parameter shard goes up. The arithmetic is the same, so an
offloaded run equals the run without, bitwise; with stage 0 each rank offloads the whole state.

After the dp reduction the gradient shards are completed over the other axes, on shards: the
sequence-parallel elements all-reduced over tp, and a pipeline's tied embedding copies over the
first and last stage (their units have the same length, so their shards line up).

    zero = ZeroOptimizer(model, mesh.dp_group, stage=2, optimizer="adamw", lr=3e-3, weight_decay=0.1)
    zero.zero_grad()
    loss.backward()                          # stage 2: reduce-scatters run inside backward
    if not zero.found_inf():                 # mixed precision: skip an overflowing step everywhere
        norm = zero.clip_grad_norm(1.0)      # global norm over all shards
        zero.step(lr)                        # update own shard, all-gather parameters (stages 1, 2)
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from minidist.amp import to_compute, unscale
from minidist.autograd import Tensor, get_array_module, to_numpy
from minidist.optim import adamw_update, clip_coef, sgd_update
from minidist.inspect import accounting
from minidist.parallel.zero import stage3 as zero3
from minidist.parallel.data.data_parallel import average_over_replicas
from minidist.parallel.zero.flat_buffer import FlatUnit, units_by_module
from minidist.parallel.compose.grad_ownership import replica_group

SLOTS = {"sgd": ("momentum_buf",), "adamw": ("exp_avg", "exp_avg_sq")}


@dataclass(frozen=True)
class Stage:
    """What one ZeRO stage partitions over the dp ranks."""
    optimizer_states: bool  # each rank updates 1/N of the parameters (stages 1-3)
    gradients: bool  # reduce-scattered in backward, only the shard kept (stages 2, 3)
    parameters: bool  # only the shard kept between uses (stage 3)


STAGES = {0: Stage(False, False, False), 1: Stage(True, False, False), 2: Stage(True, True, False),
          3: Stage(True, True, True)}


@dataclass
class Shard:
    """This rank's part of one unit, over ``group`` (the ranks that hold the same unit: the dp (x cp)
    group, or for a unit of experts the expert-data-parallel group). ``param`` is the optimizer's Tensor over the shard (float32
    masters under mixed precision, else a view of ``compute``), its ``.grad`` the averaged, unscaled
    gradient shard; ``compute`` the shard in the model's dtype (what stage 3 all-gathers);
    ``flat`` the unit's full flat parameters (stages 0-2; the model's parameters are views of it);
    ``grad`` the reduced gradient shard in the model's dtype, still scaled; ``state`` the optimizer
    slots. Stages 0 and 1 keep the full gradient in ``grad_flat`` (numel,), ``p.grad`` being views.
    Under offload ``param`` (the master) and ``state`` live in the offload store (with parameter
    offload ``compute`` too: ``stored`` lists them), and ``host_grad`` is the gradient's host buffer,
    from which ``param.grad`` is computed."""
    unit: FlatUnit
    group: object
    param: Tensor
    compute: np.ndarray
    flat: np.ndarray | None
    state: dict = field(default_factory=dict)
    decay: np.ndarray | None = None  # 0/1 per shard element
    tensor_parallel: np.ndarray | None = None  # bool per shard element
    counted: np.ndarray | None = None  # bool per shard element: False on a pipeline stage's tied copy
    sequence_parallel: np.ndarray | None = None  # bool per shard element: a partial sum over tp
    grad_flat: np.ndarray | None = None  # stages 0 and 1
    grad: np.ndarray | None = None
    host_grad: np.ndarray | None = None  # offload: the gradient shard's host buffer (hi - lo,)
    stored: list = field(default_factory=list)  # offload: the arrays kept in the offload store
    downloaded: object = None  # offload: the ``grad`` array already copied into ``host_grad``
    ready: int = 0  # stages 2, 3: parameters of the unit whose gradient is final in this backward
    work: object = None  # stages 2, 3: the reduce-scatter in flight


class ZeroOptimizer:
    """SGD (with momentum) or AdamW over ZeRO-partitioned model states, on the dp group.

    ``model``'s parameters (a GPT, its tensor-parallel shard, or a pipeline stage of either) are
    grouped into units (one per block, one per other module); ``stage`` 0-3 as in :data:`STAGES`;
    the hyper-parameters are those of :class:`minidist.optim.SGD` / :class:`minidist.optim.AdamW`
    (decay only on >= 2-D parameters). ``tp_group`` / ``pp_group`` (optional) make
    :meth:`clip_grad_norm` global over tensor-parallel shards and pipeline stages, and sum
    sequence-parallel gradients over tp; ``tied_group`` is a pipeline's embedding group (first and
    last stage). ``mixed_precision`` ("float16" / "bfloat16") with ``scaler`` (a DynamicLossScaler
    over the world): float32 masters and moments, as in the module docstring.
    ``reshard_after_forward`` (stage 3): False keeps a unit gathered from its first forward of a step
    to its last backward (pipelines). ``offload``: an :class:`~minidist.parallel.zero.offload.Offload`
    keeping the optimizer shards (and under stage 3 with its ``params`` the parameter shards) off
    the device, the step run where they live. ``expert_group`` / ``ep_group`` (expert parallelism): the
    group the experts' units (``p.expert``) are sharded and reduced over instead (the ranks holding the
    same experts), and the ep group whose ranks hold the other experts (their squares add up in the norm).
    """

    def __init__(self, model, dp_group, stage: int, optimizer: str = "adamw", *, lr: float,
                 momentum: float = 0.0, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 tp_group=None, pp_group=None, tied_group=None, mixed_precision: str | None = None, scaler=None,
                 reshard_after_forward: bool = True, replicas: int | None = None, expert_group=None,
                 ep_group=None, offload=None):
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
        if optimizer not in SLOTS:
            raise ValueError(f"optimizer must be one of {sorted(SLOTS)}, got {optimizer!r}")
        if (mixed_precision is None) != (scaler is None):
            raise ValueError("mixed precision needs both its compute dtype and a loss scaler")
        self.model, self.group, self.stage, self.optimizer = model, dp_group, stage, optimizer
        self.replicas = replicas  # data replicas among the group's ranks (None: all; cp ranks add up)
        self.partitions = STAGES[stage]
        self.lr, self.momentum, self.betas, self.eps, self.weight_decay = lr, momentum, betas, eps, weight_decay
        self.tp_group, self.pp_group, self.tied_group, self.ep_group = tp_group, pp_group, tied_group, ep_group
        self.mixed_precision, self.scaler = mixed_precision, scaler
        if offload is not None and offload.params and not self.partitions.parameters:
            raise ValueError("offloading the parameters moves ZeRO-3's parameter shards: stages 0-2 keep every "
                             "parameter whole on each rank")
        self.offload = offload
        self.step_count = 0
        self._reduced = False  # gradients of this step already reduced over dp
        self._in_flight = None  # stages 2, 3: the shard whose reduce-scatter is queued
        self._no_sync = False
        self.shards = []
        for name, params in units_by_module(model.named_parameters()):
            group = replica_group(params[0][1], dp_group, expert_group)  # a unit holds experts only, or none
            rank, size = (group.rank, group.size) if self.partitions.optimizer_states else (0, 1)
            self.shards.append(self._make_shard(FlatUnit(name, params, rank, size), group))
        if self.partitions.gradients:
            for s in self.shards:
                for _, p in s.unit.params:
                    p.register_grad_ready_hook(lambda p, s=s: self._grad_ready(s))
        self.gatherer = (zero3.fully_shard(model, self.shards, reshard_after_forward, offload)
                         if self.partitions.parameters else None)
        self.zero_grad()

    def _make_shard(self, unit: FlatUnit, group) -> Shard:
        flat = unit.flatten([p.data for _, p in unit.params])  # (numel,) full values, the model's dtype
        if self.partitions.parameters:
            compute, flat = flat[unit.lo:unit.hi].copy(), None  # keep the shard only
        else:
            unit.bind(flat)  # parameters become views of the flat vector
            compute = flat[unit.lo:unit.hi]  # a view: writing it writes the parameters
        master = compute
        if self.mixed_precision:  # float32 masters of the initial values; the model gets them rounded
            master = compute.astype(np.float32)
            whole = compute if flat is None else flat
            whole[...] = to_compute(whole.astype(np.float32), self.mixed_precision)
        masks = [unit.decay_mask(), unit.tensor_parallel_mask().astype(bool), unit.counted_mask().astype(bool)]
        grad_flat = unit.xp.zeros(unit.numel, dtype=unit.dtype) if not self.partitions.gradients else None  # (numel,)
        if self.offload is not None:
            return self._offloaded_shard(unit, group, compute, flat, master, masks, grad_flat)
        state = {slot: unit.xp.zeros(unit.hi - unit.lo, dtype=master.dtype) for slot in SLOTS[self.optimizer]}
        return Shard(unit, group, Tensor(master), compute, flat, state, *masks,
                     unit.sequence_parallel_mask().astype(bool), grad_flat)

    def _offloaded_shard(self, unit: FlatUnit, group, compute, flat, master, masks, grad_flat) -> Shard:
        """A Shard whose master and optimizer slots (and with parameter offload its parameter shard)
        live in the offload store (:meth:`~minidist.parallel.zero.offload.Offload.place`); the masks the
        host update reads are host copies."""
        master, compute, state, stored, host_grad = self.offload.place(unit.name, master, compute,
                                                                        SLOTS[self.optimizer], self.mixed_precision)
        return Shard(unit, group, Tensor(master), compute, flat, state, *(to_numpy(m) for m in masks),
                     unit.sequence_parallel_mask().astype(bool), grad_flat, host_grad=host_grad, stored=stored)

    # ---- gradients --------------------------------------------------------------------------------

    def zero_grad(self) -> None:
        """Forget the gradients: the next backward starts from nothing. Stages 0 and 1 zero the flat
        gradient buffers and point every ``p.grad`` at its view (backward accumulates in place);
        stages 2 and 3 drop the full gradients and the shards."""
        if self.offload is not None:
            self.offload.moved.clear()  # from here on: this step's bytes
        for s in self.shards:
            s.grad, s.param.grad, s.ready, s.work = None, None, 0, None
            if s.grad_flat is not None:
                s.grad_flat[...] = 0
            for (_, p), view in zip(s.unit.params, s.unit.views(s.grad_flat) if s.grad_flat is not None
                                    else [None] * len(s.unit.params)):
                p.grad = view
        self._reduced = False

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
        queue the unit's reduce-scatter (op "avg", async: it overlaps the rest of backward) and drop
        the full gradients; stage 3 frees the full parameters too. The previous unit's reduce-scatter
        is collected first, so at most one unit's full gradient is alive beside the shards. Under
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
        """Wait for the reduce-scatter in flight and add it into its unit's gradient shard."""
        s, self._in_flight = self._in_flight, None
        if s is not None:
            grad = s.work.wait()  # (hi - lo,)
            s.grad = grad if s.grad is None else s.grad + grad
            s.work = None
            if self.offload is not None and not self._completed_later(s):  # final now: down during backward
                self.offload.down(s.grad, s.host_grad)
                s.downloaded = s.grad

    def _completed_later(self, s: Shard) -> bool:
        """Whether the shard's reduced gradient still changes after the dp reduction: summed over tp
        (sequence-parallel elements) or with its tied copy."""
        return (self.tp_group is not None and self.tp_group.size > 1 and bool(s.sequence_parallel.any())) or \
            any(t is s for t in self._tied_shards())

    def reduce_gradients(self) -> None:
        """Make ``shard.grad`` the dp-averaged, tp- and tied-complete gradient of every shard in the
        model's dtype, and ``shard.param.grad`` it unscaled in the optimizer's (once per step; clip,
        found_inf and step call it). Stage 0 all-reduces each unit's flat gradient; stage 1
        reduce-scatters it; stages 2 and 3 did their reduce-scatters during backward. Then
        sequence-parallel elements are all-reduced over tp and tied copies over ``tied_group``."""
        if self._reduced:
            return
        for s in self.shards:
            if s.grad_flat is None:
                continue
            op = average_over_replicas(s.grad_flat, s.group, self.replicas)
            if self.partitions.optimizer_states:  # my part of the average, written over my part of the buffer
                s.grad = s.group.reduce_scatter(s.grad_flat, op=op, out=s.grad_flat[s.unit.lo:s.unit.hi])
            else:
                s.grad = s.group.all_reduce(s.grad_flat, op=op)  # in place: (numel,)
        self._collect()
        missing = [s.unit.name for s in self.shards if s.ready or s.grad is None]
        if missing:
            raise RuntimeError(f"no complete gradient for units {missing}: did backward reach every parameter?")
        self._complete_over_tp_and_tied()
        grads = [s.grad for s in self.shards]  # the optimizer's input: on the device, or its host copy
        if self.offload is not None:
            for s in self.shards:
                if s.downloaded is not s.grad:
                    self.offload.down(s.grad, s.host_grad)
                s.downloaded = None
            self.offload.wait()
            grads = [s.host_grad for s in self.shards]
        scale = self.scaler.scale if self.scaler else 1.0
        for s, g in zip(self.shards, grads):
            s.param.grad = unscale(g, scale, self.mixed_precision) if self.mixed_precision else g
        self._reduced = True

    def _complete_over_tp_and_tied(self) -> None:
        """Sum the sequence-parallel elements of every gradient shard over tp (each tp rank saw only
        its tokens), and the shards of the tied embedding copies over the embedding group."""
        if self.tp_group is not None and self.tp_group.size > 1:
            for s in self.shards:
                if s.sequence_parallel.any():
                    partial = s.grad[s.sequence_parallel]  # (k,) a copy
                    s.grad[s.sequence_parallel] = self.tp_group.all_reduce(partial)
        pair = self._tied_shards()
        if len(pair) == 2:  # both copies on this rank (ZB-V's placement): added here, nothing sent
            total = pair[0].grad + pair[1].grad
            for s in pair:
                s.grad[...] = total
        if self.tied_group is not None:
            if len(pair) != 1:
                raise RuntimeError(f"a tied-embedding group, but {len(pair)} units hold only a tied embedding")
            self.tied_group.all_reduce(pair[0].grad, op="sum")

    def _tied_shards(self) -> list:
        """The shards of the units that hold a pipeline's tied embedding copies (each holds nothing
        else, so the copies' shards line up element by element): one on the first and on the last
        stage, both where one rank holds the two (ZB-V's rank 0); none without tied copies."""
        names = ("transformer.wte.weight", "lm_head.weight")
        alone = [s for s in self.shards if len(s.unit.params) == 1 and s.unit.params[0][0] in names]
        tied = self.tied_group is not None or any(s.unit.params[0][1].tied_copy for s in alone)
        return alone if tied else []

    def found_inf(self) -> bool:
        """Mixed precision: whether any gradient element on ANY rank of the scaler's group (the world:
        dp, tp and pp together) is inf or NaN, after the reduction. If so the step is skipped on every
        rank and the scale lowered. Sends one 8-byte all-reduce over the world. False (sending
        nothing) without mixed precision."""
        if self.scaler is None:
            return False
        self.reduce_gradients()
        if not self.scaler.found_inf([s.grad for s in self.shards]):
            return False
        self.scaler.update(found_inf=True)
        self._end_step()
        return True

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale the gradient shards so that the global L2 norm of the full gradient is at most
        ``max_norm``; returns the norm before clipping. Each rank sums the squares of its shards
        (tensor-parallel and replicated elements apart), all-reduces the two sums over its shards'
        group (stages >= 1, where each element lives on one rank of it: dp, or for experts the
        expert-dp group, whose sums then add over ep too), the tensor-parallel sum over tp
        (replicated parameters are the same on every tp rank: counted once), and the total over pp
        (a last stage's tied copy of the embedding, ``p.tied_copy``, is not counted: stage 0 counts
        it). The squares are summed (in float64) and sent where the shards live; one float crosses
        to the host."""
        self.reduce_gradients()
        xp = get_array_module(self.shards[0].param.grad)  # where the update runs: the host under offload
        sums = {}  # shard group -> [tensor-parallel elements, replicated elements]
        for s in self.shards:
            g = s.param.grad
            group_sums = sums.setdefault(s.group, xp.zeros(2))
            group_sums[0] += (g[s.tensor_parallel & s.counted] ** 2).sum()
            group_sums[1] += (g[~s.tensor_parallel & s.counted] ** 2).sum()
        sums = {group: self.shards[0].unit.xp.asarray(v) for group, v in sums.items()}  # sent from the device
        for group, group_sums in sums.items():
            if self.partitions.optimizer_states:
                group.all_reduce(group_sums)
            if group is not self.group and self.ep_group is not None:  # the experts: other ep ranks hold others
                self.ep_group.all_reduce(group_sums)
        sums = sum(sums.values())
        if self.tp_group is not None:
            self.tp_group.all_reduce(sums[:1])
        total = sums.sum(keepdims=True)  # (1,)
        if self.pp_group is not None:
            self.pp_group.all_reduce(total)
        norm = float(total[0]) ** 0.5
        coef = clip_coef(norm, max_norm)
        if coef < 1.0:
            for s in self.shards:
                s.param.grad *= coef
        return norm

    # ---- the update ---------------------------------------------------------------------------------

    def step(self, lr: float | None = None) -> None:
        """Update this rank's shard of every unit with its gradient shard and optimizer state (the
        element-wise SGD / AdamW of minidist.optim), cast it to the model's dtype, then, in stages 1
        and 2, all-gather each unit's shards so every rank holds the new full parameters (sends its
        shard to every dp rank, in the model's dtype)."""
        self.reduce_gradients()
        if lr is not None:
            self.lr = lr
        self.step_count += 1
        gathers, off = [], self.offload
        if off is not None and self.shards:
            off.read_ahead(self.shards[0].stored)
        for i, s in enumerate(self.shards):
            if off is not None:  # this unit's state is used now, the next one's soon
                off.read(s.stored)
                off.read_ahead(self.shards[i + 1].stored if i + 1 < len(self.shards) else [])
            decay = self.weight_decay * s.decay if self.weight_decay else 0.0
            if self.optimizer == "sgd":
                sgd_update(s.param.data, s.param.grad, s.state["momentum_buf"], lr=self.lr,
                           momentum=self.momentum, weight_decay=decay)
            else:
                adamw_update(s.param.data, s.param.grad, s.state["exp_avg"], s.state["exp_avg_sq"],
                             step=self.step_count, lr=self.lr, beta1=self.betas[0], beta2=self.betas[1],
                             eps=self.eps, weight_decay=decay)
            self._publish(s)
            if off is not None:
                off.write_back(s.stored)
            if self.partitions.optimizer_states and not self.partitions.parameters:  # overlaps the next update
                gathers.append(s.group.all_gather(s.compute, count=s.unit.numel, out=s.flat, async_op=True))
        for work in gathers:
            work.wait()
        if self.scaler is not None:
            self.scaler.update(found_inf=False)
        self._end_step()

    def _publish(self, s: Shard) -> None:
        """Write the shard's parameters in the model's dtype from its master (rounded under mixed
        precision) where the model reads them: up to the device when the master is offloaded, or into
        the store when the parameters are offloaded too; nothing when the master is the shard itself."""
        value = to_compute(s.param.data, self.mixed_precision) if self.mixed_precision else s.param.data
        if value is s.compute:
            return
        if self.offload is not None and not self.offload.params:
            self.offload.up(value, s.compute)
            self.offload.wait()  # the all-gather below reads it
        else:
            s.compute[...] = value

    def _end_step(self) -> None:
        if self.gatherer is not None:
            self.gatherer.free_all()  # nothing gathered outlives the step: the shards just changed
        self._reduced = False

    def masters_to_model(self) -> None:
        """After a checkpoint loaded the master shards: bring the model's values from them (stage 3's
        shards, rounded under mixed precision, up to the device under offload; stages 0-2 read their
        full parameters from the checkpoint and round them here), and write offloaded arrays back."""
        if self.partitions.parameters:
            for s in self.shards:
                self._publish(s)
        elif self.mixed_precision:
            for s in self.shards:
                s.flat[...] = to_compute(s.flat.astype(np.float32), self.mixed_precision)
        if self.offload is not None:
            for s in self.shards:
                self.offload.store.write_back(s.stored)

    # ---- inspection -----------------------------------------------------------------------------------

    @contextmanager
    def full_parameters(self, masters: bool = False):
        """Inside the block every parameter of the model holds its full value (stage 3 all-gathers
        them, collectively, and frees them after): for export, evaluation by hand, checkpoints. With
        ``masters`` under mixed precision they hold the float32 masters instead (every stage
        all-gathers the master shards, float32, and rebinds the model's own values after)."""
        if masters and self.mixed_precision:
            for s in self.shards:
                full = s.unit.xp.asarray(s.param.data)  # stage 0: the masters are whole (on the device)
                if self.partitions.optimizer_states:
                    full = s.unit.xp.empty(s.unit.numel, dtype=s.param.data.dtype)  # (numel,) float32
                    s.group.all_gather(s.unit.xp.asarray(s.param.data), count=s.unit.numel, out=full)
                s.unit.bind(full)
        elif self.gatherer is not None:
            self.gatherer.ensure(self.shards)
        try:
            yield self.model
        finally:
            for s in self.shards:
                if s.flat is not None:
                    s.unit.bind(s.flat)
            if self.gatherer is not None:
                self.gatherer.free(self.shards)
                for s in self.shards:
                    s.unit.release()

    def model_state_bytes(self) -> dict:
        """Bytes this rank holds now in parameters and gradients (the model's dtype) and optimizer
        state (moments, and the float32 masters under mixed precision), measured from the live arrays
        (a buffer counted once however many views share it). Call it after backward and
        :meth:`reduce_gradients`, when the model states are at their largest. Those three are device
        memory; under offload ``host`` and ``disk`` hold what lives there (offload.py)."""
        params = [p for s in self.shards for _, p in s.unit.params]
        stored = {id(a) for s in self.shards for a in s.stored}
        on_device = lambda arrays: [a for a in arrays if a is not None and id(a) not in stored]  # noqa: E731
        masters = [s.param.data for s in self.shards] if self.mixed_precision else []
        grads = [p.grad for p in params] + [s.grad for s in self.shards]
        if not self.mixed_precision and self.offload is None:
            grads += [s.param.grad for s in self.shards]
        held = {
            "parameters": accounting.unique_nbytes(on_device([p.data for p in params] + [s.compute for s in self.shards])),
            "gradients": accounting.unique_nbytes(grads),
            "optimizer": accounting.unique_nbytes(on_device(masters + [a for s in self.shards for a in s.state.values()])),
        }
        if self.offload is not None:
            offloaded = accounting.unique_nbytes([a for s in self.shards for a in s.stored])
            host_grads = accounting.unique_nbytes([s.host_grad for s in self.shards])
            held["host"] = host_grads + offloaded * (self.offload.where == "host")
            held["disk"] = offloaded * (self.offload.where == "disk")
        return held

    def activation_bytes(self, loss) -> int:
        """Bytes the still-unused graph behind ``loss`` keeps for backward (weights not counted)."""
        return accounting.activation_bytes(loss, exclude=[p.data for s in self.shards for _, p in s.unit.params])

    @property
    def optimizer_bytes_per_parameter(self) -> int:
        """K of the ZeRO paper: slots x 4 (+ 4 for the float32 masters) under mixed precision, slots
        x the model's itemsize without it (mixed-precision AdamW: 12)."""
        itemsize = self.shards[0].unit.dtype.itemsize if self.shards else 0
        return len(SLOTS[self.optimizer]) * (4 if self.mixed_precision else itemsize) + 4 * bool(self.mixed_precision)

    def formula(self) -> dict:
        """The ZeRO paper's bytes per rank for this stage: P = G = numel x the model's itemsize,
        O = K x numel (:attr:`optimizer_bytes_per_parameter`). Stage 1 P + G + O/N, 2 P + (G + O)/N,
        3 (P + G + O)/N. Under offload O/N leaves the device for the store (the host or the disk), with
        the parameter shard P/N (ZeRO-3 parameters offloaded, or without mixed precision the master
        copy), and the host holds the gradient shard (numel/N x itemsize) too."""
        itemsize = self.shards[0].unit.dtype.itemsize if self.shards else 0
        total = {}
        for group in {id(s.group): s.group for s in self.shards}.values():  # experts: over their own group
            numel = sum(s.unit.numel for s in self.shards if s.group is group)
            part = accounting.zero_formula(self.stage, numel * itemsize, numel * self.optimizer_bytes_per_parameter,
                                           group.size)
            if self.offload is not None:
                part = accounting.offload_formula(part, numel * itemsize / (group.size if self.stage else 1),
                                                  self.offload.where, self.offload.params,
                                                  master_copy=not self.mixed_precision)
            total = {key: total.get(key, 0) + value for key, value in part.items()}
        return total

    def close(self) -> None:
        """Remove the offload files, if any (the end of a run)."""
        if self.offload is not None:
            self.offload.close()


def reduce_scatter_grads(unit: FlatUnit, group, replicas: int | None = None, async_op: bool = False):
    """Flatten the unit's full parameter gradients, drop them, and reduce-scatter the flat vector
    (op "avg" over the dp group, in the gradients' dtype; over ``replicas`` of a dp x cp group:
    :func:`~minidist.parallel.data.data_parallel.average_over_replicas`): returns this rank's averaged
    gradient shard (hi - lo,), or with ``async_op`` the Work whose ``wait()`` returns it."""
    flat = unit.flatten([p.grad for _, p in unit.params])  # (numel,)
    for _, p in unit.params:
        p.grad = None
    return group.reduce_scatter(flat, op=average_over_replicas(flat, group, replicas), async_op=async_op)  # (hi - lo,)
