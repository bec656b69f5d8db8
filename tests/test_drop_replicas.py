"""A data-parallel run that loses a whole replica goes on with dp - 1 (``parallel/drop_replicas.py``).

In-process (ranks as threads): three dp replicas (or two of 2 tp ranks each) under ZeRO-1 or 2 train, each step's start kept
twice (``ShardCopies``). At step DROP the step runs to its end, then replica 1 dies: the survivors
(a ``split`` stands in for MPI's shrink, which needs Open MPI: tests/test_fault_tolerance.py) rebuild
the start-of-step state from their copies, re-form the mesh with dp - 1, redo the step on the new rows
of the same global batch and go on. Every loss, and the final weights, equal one process on the full
batch (float64, 1e-10 relative), so the steps after the drop are those of a run with dp - 1.
"""
import numpy as np
import pytest

import minidist
from minidist.comm import CommTimeoutError
from minidist.comm.fault_tolerance import Shrunk
from minidist.data import get_batch, inputs_and_targets
from minidist.model import GPT
from minidist.optim import SGD, AdamW, clip_grad_norm
from minidist.parallel.compose.gradients import apply_gradients
from minidist.parallel.data.sampler import dp_rows
from minidist.parallel.drop_replicas import drop_replicas, survivors_shape
from minidist.parallel.layout import Layout
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.tensor.apply import tensor_parallel
from minidist.parallel.whole_model.consolidate import consolidated_state_dict
from minidist.parallel.zero.full_state import full_parameters
from minidist.parallel.zero.optimizer import ZeroOptimizer
from minidist.parallel.zero.shard_copies import ShardCopies
from tests.mpi.zero_reference import CLIP, CONFIG, HYPER, SEED, TOKENS, lr, max_relative_error

BATCH, STEPS, DROP, DIES = 6, 6, 3, 1  # 6 rows: 2 per replica on 3, 3 on 2


def batch(step):
    return inputs_and_targets(get_batch(TOKENS, step, BATCH, CONFIG.block_size, SEED))  # (B, T), (B, T)


def reference(optimizer):
    """One process on the full batch: (losses, final state_dict)."""
    model = GPT(CONFIG, seed=SEED, dtype="float64")
    opt = (SGD if optimizer == "sgd" else AdamW)(model.named_parameters(), **HYPER[optimizer])
    losses = []
    for step in range(STEPS):
        idx, targets = batch(step)
        opt.zero_grad()
        _, loss = model(idx, targets)
        loss.backward()
        clip_grad_norm(model.parameters(), CLIP)
        opt.lr = lr(step, optimizer)
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def replica(world, stage, optimizer, dp, tp):
    """This rank's run: dp replicas of tp ranks, replica DIES lost after step DROP ran; (losses, final
    state) or None. The survivors build their model again over their new tp group (its old group's
    communicator is revoked under MPI) and the state comes from the copies."""
    built = {}

    def make_zero(mesh):
        model = GPT(CONFIG, seed=SEED, dtype="float64")
        built["model"] = tensor_parallel(model, mesh.tp_group) if tp > 1 else model
        return ZeroOptimizer(built["model"], mesh.dp_group, stage, optimizer, **HYPER[optimizer])
    mesh = DeviceMesh(world, dp=dp, tp=tp)
    zero = make_zero(mesh)
    copies = ShardCopies(zero)
    losses, step, dropped = [], 0, False
    while step < STEPS:
        copies.save()
        idx, targets = batch(step)
        rows = dp_rows(BATCH, mesh.dp_rank, mesh.shape.dp)
        zero.zero_grad()
        _, loss = built["model"](idx[rows], targets[rows])
        loss.backward()
        apply_gradients(zero, lr(step, optimizer), CLIP, mesh=mesh)
        mean = mesh.dp_group.all_reduce(np.array([loss.item()]), op="avg", label="metric: mean loss")[0]
        if step == DROP and not dropped:  # the step has run everywhere, updates and all; now a replica dies
            dropped = True
            survivors = world.split(-1 if mesh.dp_rank == DIES else 0, name="survivors")  # MPI: shrink()
            if survivors is None:
                return None
            gone = tuple(range(DIES * tp, DIES * tp + tp))
            old = [r for r in range(world.size) if r not in gone]
            shrunk = Shrunk(survivors, gone, {r: old.index(r) for r in old})
            mesh, zero = drop_replicas(shrunk, mesh, copies, make_zero, batch_size=BATCH)
            copies = ShardCopies(zero)
            continue  # redo the step, on dp 2
        losses.append(float(mean))
        step += 1
    with full_parameters(zero):
        return losses, consolidated_state_dict(built["model"], mesh) if tp > 1 else built["model"].state_dict()


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dp, tp", [(3, 1), (2, 2)])
def test_losing_a_replica_mid_run_trains_like_one_process_on_the_same_global_batch(dp, tp, stage, optimizer):
    ref_losses, ref_state = reference(optimizer)
    runs = minidist.run_local(lambda world: replica(world, stage, optimizer, dp, tp), dp * tp)
    assert all(run is None for run in runs[DIES * tp:DIES * tp + tp])
    for losses, state in [run for run in runs if run is not None]:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0)
        assert max_relative_error(state, ref_state) <= 1e-10


def test_a_replica_that_dies_while_the_copies_are_sent_stops_every_survivor_with_one_clear_error():
    """Its part of this step reached no one whole: the survivors agree to stop, none goes on alone."""
    def run(world):
        model = GPT(CONFIG, seed=SEED, dtype="float64")
        mesh = DeviceMesh(world, dp=3)
        survivors = world.split(-1 if world.rank == DIES else 0)  # made early: shrink() under MPI
        copies = ShardCopies(ZeroOptimizer(model, mesh.dp_group, 1, "sgd", **HYPER["sgd"]))
        copies.save()  # step 0's copies, whole everywhere; then the step
        copies.zero.step_count += 1  # (what an update does to the count)
        if world.rank == DIES:
            return None  # gone before step 1's copies
        with pytest.raises(CommTimeoutError):
            copies.save()
        shrunk = Shrunk(survivors, (DIES,), {0: 0, 2: 1})
        make = lambda mesh: ZeroOptimizer(model, mesh.dp_group, 1, "sgd", **HYPER["sgd"])  # noqa: E731
        with pytest.raises(RuntimeError, match="ZeRO part of step 1 was not copied whole before it died"):
            drop_replicas(shrunk, mesh, copies, make, batch_size=BATCH)
        return "refused"
    assert minidist.run_local(run, 3, timeout=10.0) == ["refused", None, "refused"]


def test_only_whole_replicas_can_be_dropped_and_the_batch_must_still_divide():
    shape = Layout(dp=3, tp=2)  # replicas: ranks {0, 1}, {2, 3}, {4, 5}
    assert survivors_shape(shape, [2, 3]) == (Layout(dp=2, tp=2), {1})
    with pytest.raises(ValueError, match=r"ranks \[2\] died, but ranks \[3\] of their replicas did not"):
        survivors_shape(shape, [2])
    with pytest.raises(ValueError, match="the global batch of 9 rows does not divide over the 2 replicas left"):
        survivors_shape(shape, [0, 1], batch_size=9)
    with pytest.raises(ValueError, match="every data-parallel replica died"):
        survivors_shape(Layout(dp=1), [0])
