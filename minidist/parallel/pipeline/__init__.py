"""Pipeline parallelism: the model's blocks split over pp stages, micro-batches flowing through them.

A schedule is data. To read 1F1B, in this order:

    actions.py       Action: forward / backward of one micro-batch on one stage, the messages between
                     stages, and which rank holds a stage
    one_f_one_b.py   GPipe's and 1F1B's compute orders
    lowering.py      the messages added to a compute order, each receive in the round its message is sent in
    executor.py      PipelineExecutor: the loop that runs one rank's list for a training step
    p2p.py           each round of messages posted as one batch
    stages.py        PipelineStage: the blocks one rank holds

Then: schedules.py (every schedule by name), validate.py (static checks and the dry runs that
prove a schedule cannot deadlock), engine.py (PipelineEngine: a schedule by name with the
extensions it needs), timeline.py (a schedule drawn), partition.py (blocks split by cost),
tied_embeddings.py, interleaved.py and zero_bubble.py (more schedules), and the executor's
extensions: split_backward.py, handover.py, peak_memory.py, module_spans.py.
"""
from minidist.parallel.pipeline.actions import Action, rank_stages, stage_rank
from minidist.parallel.pipeline.engine import PipelineEngine, split_micro_batches
from minidist.parallel.pipeline.executor import PipelineExecutor
from minidist.parallel.pipeline.partition import estimate_layer_costs, measure_layer_costs, partition_layers
from minidist.parallel.pipeline.schedules import SCHEDULES, build_schedule, placement_of, splits_backward
from minidist.parallel.pipeline.stages import PipelineStage
from minidist.parallel.pipeline.timeline import (compute_spans, draw_timeline, draw_timelines, executed_timeline,
                                                 format_timeline, gather_spans)
from minidist.parallel.pipeline.validate import ScheduleError, Timeline, simulate, validate

__all__ = ["Action", "rank_stages", "stage_rank", "placement_of", "splits_backward", "PipelineEngine",
           "PipelineExecutor", "split_micro_batches", "SCHEDULES", "build_schedule", "PipelineStage",
           "estimate_layer_costs", "measure_layer_costs", "partition_layers", "compute_spans", "draw_timeline",
           "draw_timelines", "executed_timeline", "format_timeline", "gather_spans", "ScheduleError", "Timeline",
           "simulate", "validate"]
