"""Pipeline parallelism: the model's blocks split over pp stages, micro-batches flowing through them.

A schedule is data. Read in this order:

    actions.py    Action: forward / backward (/ weight gradients) of one micro-batch on one stage,
                  the sends and receives between neighbouring stages, and which rank holds a stage
    schedules.py  GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZB-V as per-rank lists of actions
    zero_bubble.py  the list scheduler that places W in the bubbles (ZB-H1, ZB-V)
    validate.py   static checks and a dry-run simulator over all ranks: the ideal timeline, or a
                  ScheduleError naming the action that breaks the schedule
    timeline.py   a schedule printed as a per-rank timeline; executed vs ideal drawn as a PNG
    stages.py     which blocks each stage holds (balanced by cost), the stage module, tied embeddings
    p2p.py        activations forward and gradients backward between neighbouring stages
    executor.py   PipelineEngine: runs any validated schedule for one training step
"""
from minidist.parallel.pipeline.actions import Action, rank_stages, stage_rank
from minidist.parallel.pipeline.executor import PipelineEngine, split_micro_batches
from minidist.parallel.pipeline.schedules import SCHEDULES, build_schedule, placement_of, splits_backward
from minidist.parallel.pipeline.stages import (PipelineStage, estimate_layer_costs, measure_layer_costs,
                                               partition_layers)
from minidist.parallel.pipeline.timeline import (compute_spans, draw_timeline, draw_timelines, executed_timeline,
                                                 format_timeline, gather_spans)
from minidist.parallel.pipeline.validate import ScheduleError, Timeline, simulate, validate

__all__ = ["Action", "rank_stages", "stage_rank", "placement_of", "splits_backward", "PipelineEngine", "split_micro_batches", "SCHEDULES", "build_schedule", "PipelineStage",
           "estimate_layer_costs", "measure_layer_costs", "partition_layers", "compute_spans", "draw_timeline", "draw_timelines",
           "executed_timeline", "format_timeline", "gather_spans", "ScheduleError", "Timeline", "simulate",
           "validate"]
