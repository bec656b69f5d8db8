"""Pipeline parallelism: the model's blocks split over pp stages, micro-batches flowing through them.

A schedule is data. To read 1F1B, in this order:

    actions.py       Action: the forward / backward of one micro-batch on one stage, the messages
                     between stages, and which rank holds a stage
    one_f_one_b.py   1F1B's compute order, then the messages added (add_communication)
    executor.py      PipelineExecutor: the loop that runs one rank's list for a training step
    p2p.py           each round of messages (those between two compute actions) posted as one batch
    stages.py        PipelineStage: the blocks one rank holds

Then: rounds.py (each receive placed in the round its message is sent in: no deadlock over NCCL),
validate.py (static checks and the dry runs that show a schedule cannot deadlock), schedules.py
(every schedule by name, GPipe's too), engine.py (PipelineEngine: a schedule by name run with the
extensions it needs), timeline.py (a schedule drawn), partition.py (blocks split by cost),
tied_embeddings.py, interleaved.py and zero_bubble.py (more schedules), and the executor's
extensions, each wrapping every compute action: split_backward.py (zero-bubble's B and W),
handover.py (ZB-V's two stages on one rank), peak_memory.py, module_spans.py; known_costs.py
(stages that sleep a known time, for the lessons' executed timelines).
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
