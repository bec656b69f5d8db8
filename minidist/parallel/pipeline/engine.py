"""PipelineEngine: a schedule by name, built, validated and run, with the extensions it needs.

What a training script makes: ``PipelineEngine(stage, mesh, "1f1b", micro_batches)``. It builds the
schedule (schedules.py) and checks it on every rank (validate.py), so a broken one fails here with a
message instead of hanging mid-step; ``ideal`` is its simulated timeline. It runs on the executor
(executor.py) with the extensions the schedule needs: split_backward.py for a zero-bubble schedule,
handover.py where a rank holds two neighbouring stages (ZB-V), and always peak_memory.py
(``peak_in_flight``) and module_spans.py (recorded only when the trace is watched). It also knows the
tied embedding's 2-rank group (tied_embeddings.py) and evaluates with forwards only.
"""
from __future__ import annotations

from minidist.autograd import no_grad
from minidist.parallel.compose.complete import complete_whole
from minidist.parallel.data.sampler import micro_batches as split_micro_batches  # noqa: F401 (the API)
from minidist.parallel.pipeline.executor import PipelineExecutor
from minidist.parallel.pipeline.handover import HandOver
from minidist.parallel.pipeline.module_spans import PipelineSpans
from minidist.parallel.pipeline.peak_memory import PeakInFlight
from minidist.parallel.pipeline.schedules import build_schedule, placement_of, splits_backward
from minidist.parallel.pipeline.split_backward import SplitBackward
from minidist.parallel.pipeline.tied_embeddings import embedding_group
from minidist.parallel.pipeline.validate import validate


class PipelineEngine(PipelineExecutor):
    """Runs ``schedule`` (schedules.SCHEDULES) over ``mesh``'s pp group for ``stage``, this rank's
    PipelineStage (built with the schedule's placement), ``micro_batches`` per step. Building it is
    collective over the pp group (the tied-embedding group is split off). ``no_sync``: see
    :class:`PipelineExecutor`. ``costs``: the (F, B, W) of one stage the zero-bubble schedules are
    placed for and ``ideal`` is timed in (unit costs by default)."""

    def __init__(self, stage, mesh, schedule: str = "1f1b", micro_batches: int = 4, virtual_stages: int = 1,
                 no_sync=None, costs=(1.0, 1.0, 1.0)):
        p, placement = mesh.shape.pp, placement_of(schedule)
        if stage.pp_size != p or len(stage.stages) != virtual_stages or stage.placement != placement:
            raise ValueError(f"the stage was built for pp={stage.pp_size} with {len(stage.stages)} chunks placed "
                             f"{stage.placement!r}, the engine for pp={p} with virtual_stages={virtual_stages} "
                             f"placed {placement!r}")
        actions = build_schedule(schedule, p, micro_batches, virtual_stages, costs=costs)
        f, b, w = costs  # the ideal timeline in these units (the bubble is a share of the step)
        self.ideal = validate(actions, p, micro_batches, virtual_stages, placement=placement, forward_cost=f,
                              backward_cost=b + w, weight_cost=w)
        self.eval_schedule = build_schedule(schedule, p, micro_batches, virtual_stages, forward_only=True)
        validate(self.eval_schedule, p, micro_batches, virtual_stages, forward_only=True, placement=placement)
        super().__init__(stage, mesh.pp_group, actions, micro_batches, no_sync)
        if splits_backward(schedule):
            self.extensions.append(SplitBackward(self))
        if any(s + 1 in stage.stages for s in stage.stages):
            self.extensions.append(HandOver(self))
        self.peak = PeakInFlight(self)
        self.extensions += [self.peak, PipelineSpans(self)]
        self.embedding_group = embedding_group(stage, mesh.pp_group)

    @property
    def peak_in_flight(self) -> int:
        """The most micro-batches this rank held activations for at once during the last step."""
        return self.peak.peak

    def evaluate(self, micro_batches) -> float:
        """The mean loss over ``micro_batches`` with forwards only (no graph kept), on every rank."""
        with no_grad():
            return self.run_step(self.eval_schedule[self.group.rank], micro_batches)

    def all_reduce_tied_grads(self) -> None:
        """Megatron's embedding all-reduce: the first stage's wte gradient plus the last stage's
        lm_head gradient (tied copies) on both, as one process has it; one all-reduce of (V, C) over
        the embedding group (compose/complete.py), nothing elsewhere. After any data-parallel sync."""
        complete_whole(self.stage, None, self.embedding_group)
