"""PipelineExecutor: run this rank's list of actions (a schedule) for one training step.

The loop posts the messages between two compute actions (a round) as one batch (p2p.py), then runs
the compute action: F, a micro-batch's forward through a stage, or B, its backward, which the last
stage seeds with loss_scale / m (one process's gradients on the whole batch). Per micro-batch and
stage boundary a step sends one (mb, T, C) activation forward and one (mb, T, C) gradient back; at
the end the last stage broadcasts the mean loss. Anything more is an extension, not a branch here:
an object whose ``around(action, step)`` wraps each compute action (engine.py, split_backward.py).
"""
from __future__ import annotations

import contextlib

from minidist.autograd import Tensor, get_array_module
from minidist.data import inputs_and_targets
from minidist.parallel.compose.loss_scaling import backward_micro_batch
from minidist.parallel.pipeline.actions import PASSES, Action, stage_rank
from minidist.parallel.pipeline.p2p import StageLink


class Step:
    """One step's state: per (stage, micro-batch) the input a stage got (a leaf Tensor: its gradient
    goes back) and the output it made (kept for B); the mean loss so far (on the last stage); each
    micro-batch's DropoutKey (None: no dropout)."""

    def __init__(self, micro_batches, loss_scale: float, link: StageLink, dropouts=None):
        self.micro_batches, self.loss_scale, self.link = micro_batches, loss_scale, link
        self.dropouts = dropouts or [None] * len(micro_batches)
        self.inputs, self.outputs, self.loss = {}, {}, 0.0


class PipelineExecutor:
    """Runs ``schedule`` (every pp rank's list of actions, validated: validate.py) for ``stage``, this
    rank's PipelineStage, over ``pp_group``. ``no_sync`` (e.g. ``DataParallel.no_sync``) wraps each
    stage's backward passes but its last, so data parallelism communicates once per step."""

    def __init__(self, stage, pp_group, schedule, micro_batches: int, no_sync=None):
        self.stage, self.group, self.trace, self.schedule = stage, pp_group, pp_group.trace, schedule
        self.micro_batches, self.no_sync = micro_batches, no_sync or contextlib.nullcontext
        self.last_pass = {a.stage: a for a in schedule[pp_group.rank] if a.op in ("B", "W")}  # grads final after it
        self.run = {"F": self.forward, "B": self.backward}  # compute op -> what it does
        self.extensions = []
        first = next(iter(stage.parameters()))
        self.dtype, self.xp = first.dtype, get_array_module(first.data)  # received arrays go there

    def forward_backward(self, micro_batches, loss_scale: float = 1.0, dropouts=None) -> float:
        """One step over ``micro_batches`` (m arrays (mb, T+1), the same on every pp rank); the
        gradients accumulate into the stage's parameters. ``dropouts``: each micro-batch's
        DropoutKey, or None. Returns the mean loss, on every rank."""
        return self.run_step(self.schedule[self.group.rank], micro_batches, loss_scale, dropouts)

    def run_step(self, actions, micro_batches, loss_scale: float = 1.0, dropouts=None) -> float:
        """Run ``actions`` over ``micro_batches`` (with ``dropouts``, their DropoutKeys, or None); the
        mean loss, broadcast from the last stage."""
        if len(micro_batches) != self.micro_batches:
            raise ValueError(f"the engine was built for {self.micro_batches} micro-batches, got {len(micro_batches)}")
        rows, T = micro_batches[0].shape[0], micro_batches[0].shape[1] - 1
        shape = self.stage.activation_shape(rows, T)  # (mb, T, C)
        step = Step(micro_batches, loss_scale, StageLink(self.group, self.xp, self.stage.placement, shape, self.dtype),
                    dropouts)
        messages = []
        for a in actions:
            if not a.is_compute:
                messages.append(a)
                continue
            step.link.post([self.message(m, step) for m in messages])  # the round before a: one batch
            messages = []
            with self.trace.record(PASSES[a.op], group=f"stage {a.stage}", seq=a.microbatch, kind="compute"), \
                    contextlib.ExitStack() as around:
                for extension in self.extensions:
                    around.enter_context(extension.around(a, step))
                self.run[a.op](a, step)
        step.link.post([self.message(m, step) for m in messages])  # the sends after the last compute action
        step.link.wait_sends()
        loss = self.xp.array([step.loss])  # (1,) float64: known on the last stage
        last = stage_rank(self.stage.n_stages - 1, self.group.size, self.stage.placement)
        return float(self.group.broadcast(loss, src=last, label="metric: the mean loss, from the last stage")[0])

    def message(self, a: Action, step: Step):
        """(``a``, what it sends): F's output activation, the gradient of B's input; None for a RECV."""
        key = (a.stage, a.microbatch)
        if a.op == "SEND_F":
            return a, step.outputs[key].data  # (mb, T, C)
        return a, step.inputs.pop(key).grad if a.op == "SEND_B" else None  # (mb, T, C)

    def forward(self, a: Action, step: Step) -> None:
        """F: the stage's blocks on micro-batch ``a.microbatch``, from its token ids on stage 0, else
        from the activation received; on the last stage the output is the micro-batch's mean loss."""
        key = (a.stage, a.microbatch)
        idx, targets = inputs_and_targets(step.micro_batches[a.microbatch])  # (mb, T), (mb, T)
        if a.stage > 0:
            step.inputs[key] = Tensor(step.link.take(Action("RECV_F", *key)), requires_grad=True)  # (mb, T, C)
        out = self.stage(a.stage // self.group.size, step.inputs.get(key, idx), targets,  # (mb, T, C) or the loss
                         step.dropouts[a.microbatch])
        step.outputs[key] = out
        if a.stage == self.stage.n_stages - 1:
            step.loss += out.item() / self.micro_batches

    def backward(self, a: Action, step: Step) -> None:
        """B: back through F's graph, from ``loss_scale / m`` on the last stage, else from the gradient
        received for F's output; the gradient of the stage's input lands in its ``.grad``."""
        key = (a.stage, a.microbatch)
        with self.syncing(a):
            if a.stage == self.stage.n_stages - 1:
                backward_micro_batch(step.outputs.pop(key), self.micro_batches, step.loss_scale)
            else:
                step.outputs.pop(key).backward(step.link.take(Action("RECV_B", *key)))

    def syncing(self, a: Action):
        """``no_sync()``, unless ``a`` is its stage's last backward pass: its gradients are then final."""
        return contextlib.nullcontext() if a == self.last_pass[a.stage] else self.no_sync()
