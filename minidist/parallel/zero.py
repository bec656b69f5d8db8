"""ZeRO (Rajbhandari et al., 2020): data parallelism without N copies of the model states.

Plain data parallelism keeps on every one of the N ranks the full parameters (P bytes), gradients
(G) and optimizer state (O: SGD's momentum, AdamW's two moments). ZeRO partitions them across the
dp ranks, unit by unit (flat_buffer.py: each unit is a flat vector cut by ``numpy.array_split``):

    stage  what each rank holds               per step it sends (per rank, ring algorithms)
    0      P + G + O                          all-reduce G                   2 (N-1)/N G
    1      P + G + O/N                        reduce-scatter G, all-gather P  (N-1)/N (G + P)
    2      P + (G + O)/N                      the same, during backward      (N-1)/N (G + P)
    3      (P + G + O)/N                      all-gather P twice, reduce-scatter G: 3 (N-1)/N P

Stage 1: backward fills the full gradients as usual; then each unit's gradient is reduce-scattered
(op "avg"), so rank r receives the average of ITS shard only; it updates its shard of the parameters
with its shard of the optimizer state, and an all-gather brings every rank the updated parameters.
(Reduce-scatter is the first half of a ring all-reduce; its second half, an all-gather of averaged
gradients, would deliver gradients no rank updates with: that is why stages 1 and 2 send exactly
what plain data parallelism sends.)
Stage 2: the same, but each unit is reduce-scattered as soon as backward has finished its gradients
(grad-ready hooks) and the full gradients are dropped: only the shard is kept.
Stage 3: the parameters are sharded as well; see zero3.py.

    zero = ZeroOptimizer(model, mesh.dp_group, stage=2, optimizer="adamw", lr=3e-3, weight_decay=0.1)
    zero.zero_grad()
    loss.backward()                          # stage 2: reduce-scatters run inside backward
    norm = zero.clip_grad_norm(1.0)          # global norm over all shards
    zero.step(lr)                            # update own shard, all-gather parameters (stages 1, 2)
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from minidist.autograd import Tensor
from minidist.optim import adamw_update, clip_coef, sgd_update
from minidist.parallel import accounting, zero3
from minidist.parallel.flat_buffer import FlatUnit, units_by_module

SLOTS = {"sgd": ("momentum_buf",), "adamw": ("exp_avg", "exp_avg_sq")}


@dataclass
class Shard:
    """This rank's part of one unit: ``param`` (a Tensor over the shard's values; its ``.grad`` is
    the averaged gradient shard), the optimizer ``state`` per slot, and the unit's full flat
    parameter vector ``flat`` (stages 0-2; None in stage 3, which keeps only the shard). Stages 0 and
    1 keep the full gradient in ``grad_flat`` (numel,), the parameters' ``.grad`` being views of it."""
    unit: FlatUnit
    param: Tensor
    flat: np.ndarray | None
    state: dict = field(default_factory=dict)
    decay: np.ndarray | None = None  # 0/1 per shard element
    tensor_parallel: np.ndarray | None = None  # bool per shard element
    counted: np.ndarray | None = None  # bool per shard element: False on a pipeline stage's tied copy
    grad_flat: np.ndarray | None = None  # stages 0 and 1
    ready: int = 0  # stage 2: parameters of the unit whose gradient is final in this backward
    work: object = None  # stage 2: the reduce-scatter in flight


class ZeroOptimizer:
    """SGD (with momentum) or AdamW over ZeRO-partitioned model states, on the dp group.

    ``model``'s parameters are grouped into units (one per block, one per other module); ``stage``
    0-3 as in the module docstring; the hyper-parameters are those of :class:`minidist.optim.SGD` /
    :class:`minidist.optim.AdamW` (decay only on >= 2-D parameters). ``tp_group`` / ``pp_group``
    (optional) make :meth:`clip_grad_norm` global over tensor-parallel shards and pipeline stages.
    Stage 3 needs a GPT-structured model (``embed``, ``transformer.h``, ``head``) and no pipeline;
    stage 2 and 3 are refused with pipeline parallelism (their per-micro-batch gradient traffic is
    not what ZeRO promises there; DeepSpeed refuses the same).
    """

    def __init__(self, model, dp_group, stage: int, optimizer: str = "adamw", *, lr: float,
                 momentum: float = 0.0, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 tp_group=None, pp_group=None):
        check_zero_layout(stage, pp_group.size if pp_group is not None else 1, model)
        if optimizer not in SLOTS:
            raise ValueError(f"optimizer must be one of {sorted(SLOTS)}, got {optimizer!r}")
        self.model, self.group, self.stage, self.optimizer = model, dp_group, stage, optimizer
        self.lr, self.momentum, self.betas, self.eps, self.weight_decay = lr, momentum, betas, eps, weight_decay
        self.tp_group, self.pp_group = tp_group, pp_group
        self.step_count = 0
        self._reduced = False  # gradients of this step already reduced over dp
        self._in_flight = None  # stage 2: the shard whose reduce-scatter is queued
        rank, size = (0, 1) if stage == 0 else (dp_group.rank, dp_group.size)  # stage 0: no partition
        self.shards = [self._make_shard(FlatUnit(name, params, rank, size))
                       for name, params in units_by_module(model.named_parameters())]
        if stage == 2:
            for s in self.shards:
                for _, p in s.unit.params:
                    p.register_grad_ready_hook(lambda p, s=s: self._grad_ready(s))
        if stage == 3:
            zero3.fully_shard(model, self.shards, dp_group)
        self.zero_grad()

    def _make_shard(self, unit: FlatUnit) -> Shard:
        flat = unit.flatten([p.data for _, p in unit.params])  # (numel,) full values
        if self.stage == 3:
            param, flat = Tensor(flat[unit.lo:unit.hi].copy(), requires_grad=True), None  # keep the shard only
        else:
            unit.bind(flat)  # parameters become views of the flat vector
            param = Tensor(flat[unit.lo:unit.hi])  # a view: updating it updates the parameters
        state = {slot: unit.xp.zeros(unit.hi - unit.lo, dtype=unit.dtype) for slot in SLOTS[self.optimizer]}
        grad_flat = unit.xp.zeros(unit.numel, dtype=unit.dtype) if self.stage < 2 else None  # (numel,)
        tied_copy = unit.shard_mask(lambda name, p: getattr(p, "tied_copy", False)).astype(bool)
        return Shard(unit, param, flat, state, unit.decay_mask(), unit.tensor_parallel_mask().astype(bool),
                     ~tied_copy, grad_flat)

    # ---- gradients --------------------------------------------------------------------------------

    def zero_grad(self) -> None:
        """Forget the gradients: the next backward starts from nothing. Stages 0 and 1 zero the flat
        gradient buffers and point every ``p.grad`` at its view (backward accumulates in place);
        stages 2 and 3 drop the full gradients and the shards."""
        for s in self.shards:
            s.param.grad, s.ready, s.work = None, 0, None
            if s.grad_flat is not None:
                s.grad_flat[...] = 0
            for (_, p), view in zip(s.unit.params, s.unit.views(s.grad_flat) if s.grad_flat is not None
                                    else [None] * len(s.unit.params)):
                p.grad = view
        self._reduced = False

    def _grad_ready(self, s: Shard) -> None:
        """Stage 2 hook: once every parameter of the unit has its final gradient of this backward,
        queue the unit's reduce-scatter (op "avg", async: it overlaps the rest of backward) and drop
        the full gradients. The previous unit's reduce-scatter is collected first, so at most one
        unit's full gradient is alive beside the shards."""
        s.ready += 1
        if s.ready == len(s.unit.params):
            s.ready = 0
            self._collect()
            s.work = zero3.reduce_scatter_grads(s, self.group, async_op=True)
            self._in_flight = s

    def _collect(self) -> None:
        """Stage 2: wait for the reduce-scatter in flight and add it into its unit's gradient shard."""
        s, self._in_flight = self._in_flight, None
        if s is not None:
            grad = s.work.wait()  # (hi - lo,)
            s.param.grad = grad if s.param.grad is None else s.param.grad + grad
            s.work = None

    def reduce_gradients(self) -> None:
        """Make ``shard.param.grad`` the dp-averaged gradient of every shard (once per step; clip and
        step call it). Stage 0 all-reduces each unit's flat gradient; stage 1 reduce-scatters it;
        stages 2 and 3 did their reduce-scatters during backward."""
        if self._reduced:
            return
        if self.stage == 0:
            for s in self.shards:
                s.param.grad = self.group.all_reduce(s.grad_flat, op="avg")  # in place: (numel,)
        if self.stage == 1:
            for s in self.shards:  # my part of the average, written over my part of the buffer
                s.param.grad = self.group.reduce_scatter(s.grad_flat, op="avg", out=s.grad_flat[s.unit.lo:s.unit.hi])
        self._collect()
        missing = [s.unit.name for s in self.shards if s.ready or s.param.grad is None]
        if missing:
            raise RuntimeError(f"no complete gradient for units {missing}: did backward reach every parameter?")
        self._reduced = True

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale the gradient shards so that the global L2 norm of the full gradient is at most
        ``max_norm``; returns the norm before clipping. Each rank sums the squares of its shards
        (tensor-parallel and replicated elements apart), all-reduces the two sums over dp (stages
        >= 1, where each element lives on one dp rank), the tensor-parallel sum over tp (replicated
        parameters are the same on every tp rank: counted once), and the total over pp (a last
        stage's tied copy of the embedding, ``p.tied_copy``, is not counted: stage 0 counts it).
        The squares are summed (in float64) and sent where the shards live; one float crosses to the host."""
        self.reduce_gradients()
        xp = self.shards[0].unit.xp
        sums = xp.zeros(2)  # [tensor-parallel elements, replicated elements]
        for s in self.shards:
            g = s.param.grad
            sums[0] += (g[s.tensor_parallel & s.counted] ** 2).sum()
            sums[1] += (g[~s.tensor_parallel & s.counted] ** 2).sum()
        if self.stage > 0:
            self.group.all_reduce(sums)
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
        element-wise SGD / AdamW of minidist.optim), then, in stages 1 and 2, all-gather each unit's
        shards so every rank holds the new full parameters (sends its shard to every dp rank)."""
        self.reduce_gradients()
        if lr is not None:
            self.lr = lr
        self.step_count += 1
        gathers = []
        for s in self.shards:
            decay = self.weight_decay * s.decay if self.weight_decay else 0.0
            if self.optimizer == "sgd":
                sgd_update(s.param.data, s.param.grad, s.state["momentum_buf"], lr=self.lr,
                           momentum=self.momentum, weight_decay=decay)
            else:
                adamw_update(s.param.data, s.param.grad, s.state["exp_avg"], s.state["exp_avg_sq"],
                             step=self.step_count, lr=self.lr, beta1=self.betas[0], beta2=self.betas[1],
                             eps=self.eps, weight_decay=decay)
            if self.stage in (1, 2):  # in place; overlaps the next unit's update
                gathers.append(self.group.all_gather(s.param.data, count=s.unit.numel, out=s.flat, async_op=True))
        for work in gathers:
            work.wait()
        self._reduced = False

    # ---- inspection -----------------------------------------------------------------------------------

    @contextmanager
    def full_parameters(self):
        """Inside the block every parameter of the model holds its full value (stage 3 all-gathers
        them, collectively, and frees them after): for export, evaluation by hand, checkpoints."""
        if self.stage == 3:
            zero3.gather(self.shards, self.group)
        try:
            yield self.model
        finally:
            if self.stage == 3:
                zero3.free(self.shards)

    def model_state_bytes(self) -> dict:
        """Bytes this rank holds now in parameters, gradients and optimizer state, measured from the
        live arrays (a buffer counted once however many views share it). Call it after backward and
        :meth:`reduce_gradients`, when the model states are at their largest."""
        params = [p for s in self.shards for _, p in s.unit.params]
        return {
            "parameters": accounting.unique_nbytes([p.data for p in params] + [s.param.data for s in self.shards]),
            "gradients": accounting.unique_nbytes([p.grad for p in params] + [s.param.grad for s in self.shards]),
            "optimizer": accounting.unique_nbytes([a for s in self.shards for a in s.state.values()]),
        }

    def activation_bytes(self, loss) -> int:
        """Bytes the still-unused graph behind ``loss`` keeps for backward (weights not counted)."""
        return accounting.activation_bytes(loss, exclude=[p.data for s in self.shards for _, p in s.unit.params])

    def formula(self) -> dict:
        """The ZeRO paper's bytes per rank for this stage with our dtypes (one dtype for everything:
        P = G = numel x itemsize, O = slots x P): stage 1 P + G + O/N, 2 P + (G + O)/N, 3 (P + G + O)/N."""
        numel = sum(s.unit.numel for s in self.shards)
        itemsize = self.shards[0].unit.dtype.itemsize if self.shards else 0
        return accounting.zero_formula(self.stage, numel * itemsize, len(SLOTS[self.optimizer]), self.group.size)


def check_zero_layout(stage: int, pp: int, model=None) -> None:
    """Refuse, with a reason, the combinations this ZeRO does not support (before anything is sent)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if stage >= 2 and pp > 1:
        raise ValueError(f"ZeRO stage {stage} with pipeline parallelism (pp={pp}) is not supported: every "
                         "micro-batch's backward would reduce-scatter (stage 2) or re-gather (stage 3) the "
                         "stage's parameters. Use --zero 1 with --pp, or --pp 1.")
    if stage == 3 and model is not None:
        if not all(hasattr(model, a) for a in ("embed", "head", "transformer")):
            raise ValueError("ZeRO stage 3 wraps a GPT's embed / transformer.h / head: "
                             f"{type(model).__name__} does not have them")
        if any("forward" in vars(block) for block in model.transformer.h):
            raise ValueError("ZeRO stage 3 already recomputes every unit in backward: do not combine it "
                             "with --recompute (the blocks' forward is already wrapped)")
