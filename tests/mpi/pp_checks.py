"""Rank script: pipeline parallelism under real MPI, many layouts in ONE launch.

Run by tests/test_mpi_pipeline.py as ``mpiexec -n 4 python tests/mpi/pp_checks.py``. The world is cut
into sub-worlds of each layout's size (4 ranks: one pp=4 run; two independent pp=2 runs at once).
Every rank compares its own losses and its stage's (tp-consolidated) weights with the single-process
run, float64 to 1e-10 relative; any difference raises and aborts the job. Rank 0 of each sub-world
prints one line per check:

    PARITY dp=2 pp=2 tp=1 schedule=1f1b m=2 v=1 optimizer=adamw
    INFLIGHT schedule=1f1b pp=4 m=8 peaks=[4, 3, 2, 1]
    BUBBLE schedule=gpipe pp=4 m=4 v=1 measured=0.4331 formula=0.4286

(``formula``: the simulator's ideal bubble, (p-1)/(v m + p-1) for gpipe, 1f1b and interleaved.)
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for `tests.`

import minidist  # noqa: E402
from minidist.data import get_batch  # noqa: E402
from minidist.parallel.mesh import DeviceMesh  # noqa: E402
from minidist.parallel.pipeline import (PipelineEngine, PipelineStage, compute_spans, executed_timeline,  # noqa: E402
                                        gather_spans, placement_of, split_micro_batches)
from tests.test_pipeline_3d import train_layout  # noqa: E402
from tests.test_pipeline_engine import B, TOKENS, as_scheduled, one_process, sleepy_gpt  # noqa: E402

world = minidist.init(timeout=60.0)
LAYOUTS = [  # (dp, pp, tp, schedule, m, v, n_layer)
    (1, 2, 1, "gpipe", 4, 1, 4), (1, 2, 1, "1f1b", 4, 1, 4), (1, 2, 1, "interleaved", 2, 2, 4),
    (1, 4, 1, "gpipe", 4, 1, 4), (1, 4, 1, "1f1b", 8, 1, 4), (1, 4, 1, "interleaved", 4, 2, 8),
    (2, 2, 1, "1f1b", 2, 1, 4), (1, 2, 2, "interleaved", 2, 2, 4), (1, 2, 2, "1f1b", 4, 1, 4),
    (1, 2, 1, "zb-h1", 4, 1, 4), (1, 4, 1, "zb-h1", 8, 1, 4), (1, 2, 1, "zbv", 4, 2, 4), (1, 4, 1, "zbv", 8, 2, 8),
    (2, 2, 1, "zb-h1", 2, 1, 4), (1, 2, 2, "zbv", 2, 2, 4),
]
references = {}
# each layout trains with one optimizer, alternating (both over the layouts); --both-optimizers: both
OPTIMIZERS = [("sgd", "adamw")] * len(LAYOUTS) if "--both-optimizers" in sys.argv else [
    ("sgd",) if i % 2 == 0 else ("adamw",) for i in range(len(LAYOUTS))]


def sub_world(size):
    """This rank's group of ``size`` consecutive ranks (the world holds world.size // size of them)."""
    return world.split(world.rank // size, name=f"world/{world.rank // size}")


for (dp, pp, tp, schedule, m, v, n_layer), optimizers in zip(LAYOUTS, OPTIMIZERS):
    group = sub_world(dp * pp * tp)
    for optimizer in optimizers:
        if (n_layer, optimizer) not in references:
            references[n_layer, optimizer] = one_process(n_layer, optimizer)
        ref_losses, ref_weights = references[n_layer, optimizer]
        losses, weights, peak = train_layout(group, dp, pp, tp, schedule, m, v, n_layer, optimizer)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0)
        for name, value in weights.items():
            np.testing.assert_allclose(value, ref_weights[name], rtol=1e-10, atol=1e-13, err_msg=name)
        if group.rank == 0:
            print(f"PARITY dp={dp} pp={pp} tp={tp} schedule={schedule} m={m} v={v} optimizer={optimizer}", flush=True)
    if dp == tp == 1 and schedule in ("gpipe", "1f1b", "zb-h1"):
        peaks = np.zeros(pp, dtype=np.int64)
        peaks[group.rank] = peak
        group.all_reduce(peaks)
        if group.rank == 0:
            print(f"INFLIGHT schedule={schedule} pp={pp} m={m} peaks={peaks.tolist()}", flush=True)

for schedule, pp, m, v in [("gpipe", 4, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("zb-h1", 4, 8, 1),
                           ("zbv", 2, 4, 2)]:
    group = sub_world(pp)
    mesh = DeviceMesh(group, pp=pp)
    # a balanced model whose blocks sleep (40 ms forward, 40 ms each for B and W): ranks sharing 2
    # cores still run their schedule at full speed, so the measurement shows the schedule's bubble
    stage = PipelineStage(sleepy_gpt(pp * v, 0.04 / v), mesh.pp_rank, pp, v, layers_per_stage=[1] * (pp * v),
                          placement=placement_of(schedule))
    engine = PipelineEngine(stage, mesh, schedule, m, v)
    bubbles, problems = [], []
    for step in range(2):  # the better of 2 steps: other jobs on the machine only ever add idle time
        group.barrier()
        group.trace.clear()
        engine.forward_backward(split_micro_batches(get_batch(TOKENS, step, B, 8), m))
        spans = gather_spans(group, compute_spans(group.trace))
        if group.rank == 0:
            bubbles.append(executed_timeline(spans).bubble())
            problems += as_scheduled(executed_timeline(spans), engine.ideal)
    if group.rank == 0:  # the order is exact and checked; the bubble is measured, printed for information
        print(f"SCHEDULED schedule={schedule} pp={pp} m={m} v={v} problems={len(problems)} {problems[:3]}", flush=True)
        print(f"BUBBLE schedule={schedule} pp={pp} m={m} v={v} measured={min(bubbles):.4f} "
              f"formula={engine.ideal.bubble():.4f}", flush=True)
