"""Pipeline parallelism with data and tensor parallelism, in-process: a (dp, pp, tp) mesh of threads
trains exactly like one process on the whole batch (float64, 1e-10 relative), with SGD+momentum and
AdamW, the pipeline's micro-batches feeding data parallelism's single all-reduce per step."""
import numpy as np
import pytest

import minidist
from minidist.data import get_batch
from minidist.model import GPT
from minidist.parallel.whole_model.consolidate import consolidated_state_dict
from minidist.parallel.data.data_parallel import DataParallel
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.pipeline import PipelineEngine, PipelineStage, placement_of, split_micro_batches
from minidist.parallel.tensor.apply import tensor_parallel
from minidist.parallel.compose.complete import sync_sequence_parallel_grads
from tests.test_pipeline_engine import B, STEPS, TOKENS, config, make_optimizer, one_process


def train_layout(world, dp, pp, tp, schedule, m, v, n_layer, optimizer, sequence_parallel=False, steps=STEPS):
    """Train on a (dp, pp, tp) mesh over ``world`` (threads or MPI processes) as the CLI does; returns
    this rank's (losses averaged over dp, consolidated full-shape weights of its stage, peak in-flight)."""
    mesh = DeviceMesh(world, dp, pp, tp)
    cfg = config(n_layer)
    model = GPT(cfg, seed=1, dtype="float64")
    if tp > 1:
        tensor_parallel(model, mesh.tp_group, sequence_parallel)
    stage = PipelineStage(model, mesh.pp_rank, pp, v, placement=placement_of(schedule))
    data_parallel = DataParallel(stage, mesh.dp_group)
    engine = PipelineEngine(stage, mesh, schedule, m, v, no_sync=data_parallel.no_sync)
    opt = make_optimizer(optimizer, stage.named_parameters())
    losses = []
    for step in range(steps):
        batch = get_batch(TOKENS, step, B, 8, seed=3)
        rows = batch[np.array_split(np.arange(B), dp)[mesh.dp_rank]]  # this dp rank's rows
        data_parallel.zero_grad()
        loss = np.array([engine.forward_backward(split_micro_batches(rows, m))])
        data_parallel.finish()  # DP's one all-reduce per bucket, after the last micro-batch
        sync_sequence_parallel_grads(stage, mesh.tp_group)  # after it: the buckets are in flight until then
        engine.all_reduce_tied_grads()  # then Megatron's embedding group
        opt.step()
        losses.append(float(mesh.dp_group.all_reduce(loss, op="avg")[0]))
    return losses, consolidated_state_dict(stage, mesh), engine.peak_in_flight


LAYOUTS_3D = [  # (dp, pp, tp, schedule, m, v, sp, n_layer)
    (2, 2, 1, "1f1b", 2, 1, False, 4),
    (1, 2, 2, "gpipe", 4, 1, False, 4),
    (2, 2, 2, "1f1b", 2, 1, False, 4),
    (2, 2, 2, "interleaved", 2, 2, False, 4),
    (1, 2, 2, "1f1b", 4, 1, True, 4),
    (2, 2, 2, "zb-h1", 4, 1, True, 4),
    (2, 2, 2, "zbv", 2, 2, True, 4),
    (2, 4, 1, "zb-h1", 4, 1, False, 4),
    (1, 4, 2, "zbv", 8, 2, False, 8),
]


@pytest.mark.parametrize("dp,pp,tp,schedule,m,v,sp,n_layer,optimizer", [
    # by default each layout with one optimizer, SGD and AdamW alternating; --slow: both
    pytest.param(*layout, optimizer, marks=[pytest.mark.slow] * ((i % 2 == 0) != (optimizer == "sgd")))
    for i, layout in enumerate(LAYOUTS_3D) for optimizer in ("sgd", "adamw")])
def test_pipeline_with_data_and_tensor_parallelism_trains_like_one_process(dp, pp, tp, schedule, m, v, sp, n_layer,
                                                                          optimizer):
    ref_losses, ref_weights = one_process(n_layer, optimizer)
    results = minidist.run_local(lambda world: train_layout(world, dp, pp, tp, schedule, m, v, n_layer, optimizer, sp),
                                 dp * pp * tp)
    seen = set()
    for losses, weights, _ in results:  # every rank: each dp replica's stage must match, not just one
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0)
        for name, value in weights.items():
            np.testing.assert_allclose(value, ref_weights[name], rtol=1e-10, atol=1e-13, err_msg=name)
        seen.update(weights)
    assert seen == ref_weights.keys()  # the last stage's lm_head.weight is the tied copy
