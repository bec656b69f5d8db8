"""PipelineEngine: run any validated schedule for one training step.

One loop serves every schedule (GPipe, 1F1B, interleaved, ZB-H1, ZB-V): it walks this rank's
action list and does what each action says. In a zero-bubble schedule a B runs the backward inside
``weight_grads_later`` (autograd/engine.py): only the gradient of the stage's input is computed, what
the previous stage waits for, and the weight gradients wait in the micro-batch's record until its W.
Two neighbouring stages on one rank (the bottom of ZB-V's V) hand the tensor over without a message. The schedule is built and checked (``validate``) when the engine is made, on
every rank, so a broken schedule fails there with a message instead of hanging mid-step.

What a step sends, per micro-batch and stage boundary: one (mb, T, C) activation forward, one
(mb, T, C) gradient backward (``p2p.py``). At the end the last stage broadcasts the mean loss over
the pp group, so every rank can report it.

The loss convention matches one process on the whole batch, and the plain step's: the last stage
starts each micro-batch's backward with ``loss_scale / m`` (minidist/parallel/compose/loss_scaling.py), so
the gradients accumulated over the m micro-batches are those of the mean over all the rank's rows,
times mixed precision's loss scale.
"""
from __future__ import annotations

import contextlib

from minidist.autograd import Tensor, get_array_module, no_grad, weight_grads_later
from minidist.data import inputs_and_targets
from minidist.parallel.compose.loss_scaling import backward_micro_batch
from minidist.inspect.spans import ModuleSpans
from minidist.parallel.pipeline.actions import RECVS, stage_rank
from minidist.parallel.pipeline.p2p import StageLink
from minidist.parallel.pipeline.schedules import build_schedule, placement_of, splits_backward
from minidist.parallel.pipeline.validate import validate


def split_micro_batches(batch, micro_batches: int) -> list:
    """Cut a (B, T+1) batch into ``micro_batches`` arrays of (B/m, T+1) rows, in order (views, in
    the batch's memory)."""
    if batch.shape[0] % micro_batches:
        raise ValueError(f"batch of {batch.shape[0]} rows does not split into {micro_batches} micro-batches")
    return get_array_module(batch).split(batch, micro_batches)


class PipelineEngine:
    """Runs ``schedule`` (one of :data:`~minidist.parallel.pipeline.schedules.SCHEDULES`) over
    ``mesh``'s pp group for one :class:`~minidist.parallel.pipeline.stages.PipelineStage` per rank
    (built with the schedule's placement).

    Building it is collective over the pp group (the tied-embedding group is split off). ``no_sync``
    (e.g. ``DataParallel.no_sync``) wraps every backward (every W in a zero-bubble schedule: the
    weight gradients are final there) but the last of each stage, so data parallelism all-reduces
    once, after the last micro-batch. ``costs``: the (F, B, W) of one stage the zero-bubble schedules
    are placed for (unit costs by default). ``ideal`` is the simulator's timeline of the schedule;
    ``peak_in_flight`` after a step is the most micro-batches this rank held
    activations for at once.
    """

    def __init__(self, stage, mesh, schedule: str = "1f1b", micro_batches: int = 4, virtual_stages: int = 1,
                 no_sync=None, costs=(1.0, 1.0, 1.0)):
        p = mesh.shape.pp
        self.placement, self.split = placement_of(schedule), splits_backward(schedule)
        if stage.pp_size != p or len(stage.stages) != virtual_stages or stage.placement != self.placement:
            raise ValueError(f"the stage was built for pp={stage.pp_size} with {len(stage.stages)} chunks placed "
                             f"{stage.placement!r}, the engine for pp={p} with virtual_stages={virtual_stages} "
                             f"placed {self.placement!r}")
        self.stage, self.group, self.micro_batches = stage, mesh.pp_group, micro_batches
        self.trace = mesh.pp_group.trace
        self.schedule = build_schedule(schedule, p, micro_batches, virtual_stages, costs=costs)
        f, b, w = costs  # the ideal timeline in these units per chunk (the bubble is a share of the step)
        self.ideal = validate(self.schedule, p, micro_batches, virtual_stages, placement=self.placement,
                              forward_cost=f, backward_cost=b + w, weight_cost=w)
        self.eval_schedule = build_schedule(schedule, p, micro_batches, virtual_stages, forward_only=True)
        validate(self.eval_schedule, p, micro_batches, virtual_stages, forward_only=True, placement=self.placement)
        self.no_sync = no_sync if no_sync is not None else contextlib.nullcontext
        self.embedding_group = stage.embedding_group(mesh.pp_group)
        first = next(iter(stage.parameters()))
        self.dtype, self.xp = first.dtype, get_array_module(first.data)  # received activations go there
        self.peak_in_flight = 0

    def forward_backward(self, micro_batches, loss_scale: float = 1.0) -> float:
        """One step's forwards and backwards over ``micro_batches`` (m arrays (mb, T+1), the same
        list on every pp rank: stage 0 reads the inputs, the last stage the targets), each backward
        seeded with ``loss_scale / m``. Gradients accumulate into the stage's parameters; the
        tied-embedding copies still need :meth:`all_reduce_tied_grads` (after any data-parallel
        sync; ZeRO does it on its shards). Returns the mean loss over the micro-batches, on every rank."""
        return self._run(self.schedule[self.group.rank], micro_batches, training=True, loss_scale=loss_scale)

    def evaluate(self, micro_batches) -> float:
        """The mean loss over ``micro_batches`` with forwards only (no graph kept), on every rank."""
        with no_grad():
            return self._run(self.eval_schedule[self.group.rank], micro_batches, training=False)

    def all_reduce_tied_grads(self) -> None:
        """Megatron's embedding all-reduce: sum the first stage's wte gradient and the last stage's
        lm_head gradient (tied copies) so both hold the single-process gradient. A no-op elsewhere."""
        self.stage.all_reduce_tied_grads(self.embedding_group)

    def _run(self, actions, micro_batches, training: bool, loss_scale: float = 1.0) -> float:
        m, stage = self.micro_batches, self.stage
        if len(micro_batches) != m:
            raise ValueError(f"the engine was built for {m} micro-batches, got {len(micro_batches)}")
        rows, T = micro_batches[0].shape[0], micro_batches[0].shape[1] - 1
        shape = stage.activation_shape(rows, T)  # (mb, T, C)
        grads_final = "W" if self.split else "B"  # the weight gradients are complete there
        last_backward = {a.stage: a for a in actions if a.op == grads_final}  # data parallelism syncs there
        link = StageLink(self.group, self.xp, self.placement)
        inputs, outputs, grads = {}, {}, {}  # (stage, micro-batch) -> received input / output / its gradient
        weights_later = {}  # (stage, micro-batch) -> its weight-gradient work, from B to W
        spans, tapes = ModuleSpans(self.trace), {}  # per-module spans (module_spans.py): one tape per forward
        loss_sum, held, peak = 0.0, 0, 0
        for a in actions:
            key, chunk = (a.stage, a.microbatch), a.stage // self.group.size
            if a.op in RECVS:
                buf = link.recv(a, shape, self.dtype)  # (mb, T, C)
                if a.op == "RECV_F":
                    inputs[key] = Tensor(buf, requires_grad=training)
                else:
                    grads[key] = buf
            elif a.op == "F":
                idx, targets = inputs_and_targets(micro_batches[a.microbatch])  # (mb, T), (mb, T)
                if a.stage > 0 and key not in inputs:  # the previous stage is on this rank: handed over
                    before = (a.stage - 1, a.microbatch)
                    inputs[key] = Tensor((outputs[before] if training else outputs.pop(before)).data,
                                         requires_grad=training)
                x = idx if a.stage == 0 else inputs[key] if training else inputs.pop(key)
                with self.trace.record("forward", group=f"stage {a.stage}", seq=a.microbatch, kind="compute"), \
                        spans.forward(stage, a.microbatch, a.stage == 0, a.stage == stage.n_stages - 1) as tapes[key]:
                    out = stage(chunk, x, targets)  # (mb, T, C), or the loss on the last stage
                    tapes[key].output(out)
                    if a.stage == stage.n_stages - 1:
                        loss_sum += out.item() / m
                outputs[key] = out
                held += training
                peak = max(peak, held)
            elif a.op == "SEND_F":
                link.send(a, (outputs[key] if training else outputs.pop(key)).data)
            elif a.op == "B":
                final = not self.split and a == last_backward[a.stage]
                split = weight_grads_later() if self.split else contextlib.nullcontext()
                with contextlib.nullcontext() if final else self.no_sync(), split as later, self.trace.record(
                        "backward", group=f"stage {a.stage}", seq=a.microbatch, kind="compute"), \
                        spans.backward(tapes.pop(key)):
                    if a.stage == stage.n_stages - 1:
                        backward_micro_batch(outputs.pop(key), m, loss_scale)
                    else:
                        after = (a.stage + 1, a.microbatch)  # the next stage's input: its gradient is ours
                        outputs.pop(key).backward(grads.pop(key) if key in grads else inputs.pop(after).grad)
                if self.split:
                    weights_later[key] = later  # the activations stay held until W has read them
                else:
                    held -= 1
            elif a.op == "W":
                final = a == last_backward[a.stage]
                with contextlib.nullcontext() if final else self.no_sync(), self.trace.record(
                        "weight", group=f"stage {a.stage}", seq=a.microbatch, kind="compute"):
                    weights_later.pop(key).run()
                held -= 1
            else:  # SEND_B: the gradient of this stage's input goes back to the previous stage
                link.send(a, inputs.pop(key).grad)
        link.wait_sends()
        loss = self.xp.array([loss_sum])  # (1,) float64: known on the last stage
        self.group.broadcast(loss, src=stage_rank(stage.n_stages - 1, self.group.size, self.placement))
        if training:
            self.peak_in_flight = peak
        return float(loss[0])
