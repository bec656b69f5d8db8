"""A search's memory check works once per schedule shape, not once per ZeRO stage (issue 36: lesson 14's
search took 93 s where it said "about 30 s").

The activations a pipeline rank holds depend on the model, the sequence, the layout, the schedule and
recompute, never on the ZeRO stage, the optimizer or where offload puts the states: the planner
computes them once for all of those (``memory._activation_bytes``), and the answers do not change.
"""
import dataclasses

from minidist.parallel.pipeline.validate import Timeline
from minidist.plan import PROFILES, RunSpec, preset, search
from minidist.plan.layout import layout_problems
from minidist.plan.memory import _activation_bytes, activation_bytes, pipeline_schedule, stage_weights
from minidist.plan.search import candidates

STATELESS = dict(zero=0, optimizer="adamw", offload="none", offload_to="host")  # what activations never read


def uncached(model, run) -> list[float]:
    """Per pipeline rank, the peak activation bytes, computed afresh (the planner's formula)."""
    weights = stage_weights(model, run)
    if run.pp == 1:
        return [weights[0]]
    _, timeline = pipeline_schedule(run.schedule, run.pp, run.micro_batches, run.virtual_stages)
    return timeline.peak_held(weights.__getitem__)


def test_activations_are_the_same_for_every_zero_stage_optimizer_and_offload():
    model = preset("gpt2")
    for run in (RunSpec(seq=1024, pp=4, micro_batches=8, tp=2, sequence_parallel=True),
                RunSpec(seq=1024, pp=2, micro_batches=4, virtual_stages=2, schedule="interleaved",
                        recompute="selective"),
                RunSpec(seq=1024, dp=8)):
        expected = uncached(model, run)
        for zero, optimizer, offload in ((0, "adamw", "none"), (1, "sgd", "none"), (3, "adamw", "optimizer,params")):
            assert activation_bytes(model, dataclasses.replace(run, zero=zero, optimizer=optimizer,
                                                               offload=offload)) == expected


def test_a_search_walks_each_schedules_memory_once(monkeypatch):
    model, hw, base = preset("gpt2"), PROFILES["h100"], RunSpec(seq=1024)
    walked = []
    real = Timeline.peak_held
    monkeypatch.setattr(Timeline, "peak_held", lambda self, weight: walked.append(1) or real(self, weight))
    _activation_bytes.cache_clear()
    search(model, 8, hw, base, 32)
    runs = [r for r in candidates(model, 8, base, 32, hw) if r.pp > 1 and not layout_problems(model, r)]
    shapes = {dataclasses.replace(r, **STATELESS) for r in runs}
    assert len(runs) == 4 * len(shapes) and len(walked) == len(shapes)  # once, where it was four times
