"""Rank script for tests/test_fault_tolerance.py: dp replicas under ZeRO, one dies, the others go on.

    mpiexec --with-ft ulfm --mca mpi_ft_detector true -n DP*TP python tests/mpi/drop_replica.py STAGE OPTIMIZER DP TP

Replica 1 (its TP ranks) SIGKILLs itself at step DROP after its backward (stage 2: its reduce-scatters are under
way). The survivors' next collective raises ProcessFailedError; they shrink the world, re-form the
mesh with dp - 1 (the model built again over the new tp group), rebuild the ZeRO state of the step's start from their copies, redo the step and
finish, leaving without MPI_Finalize (``leave``). Every survivor prints its losses (LOSSES rank=r [...]) and the recovery's time (RECOVERED ...).
"""
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import minidist
from minidist.comm.fault_tolerance import leave, shrink, ulfm_problem
from minidist.comm.transport import CommTimeoutError
from minidist.model import GPT
from minidist.parallel.compose.gradients import apply_gradients
from minidist.parallel.data.sampler import dp_rows
from minidist.parallel.drop_replicas import drop_replicas
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.tensor.apply import tensor_parallel
from minidist.parallel.zero.optimizer import ZeroOptimizer
from minidist.parallel.zero.shard_copies import ShardCopies
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for `tests.`
from tests.mpi.zero_reference import CLIP, CONFIG, HYPER, SEED, lr  # noqa: E402
from tests.test_drop_replicas import BATCH, DIES, DROP, STEPS, batch  # noqa: E402

stage, optimizer, dp, tp = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
world = minidist.init(timeout=60.0)
assert ulfm_problem() is None, ulfm_problem()
built = {}


def make_zero(mesh):
    """A new model over the mesh's tp group (the old one's communicator is revoked), and its ZeRO."""
    model = GPT(CONFIG, seed=SEED, dtype="float64")
    built["model"] = tensor_parallel(model, mesh.tp_group) if tp > 1 else model
    return ZeroOptimizer(built["model"], mesh.dp_group, stage, optimizer, **HYPER[optimizer])


mesh = DeviceMesh(world, dp=dp, tp=tp)
zero = make_zero(mesh)
copies = ShardCopies(zero)
losses, step = [], 0
while step < STEPS:
    try:
        copies.save()
        idx, targets = batch(step)
        rows = dp_rows(BATCH, mesh.dp_rank, mesh.shape.dp)
        zero.zero_grad()
        _, loss = built["model"](idx[rows], targets[rows])
        loss.backward()
        if step == DROP and mesh.shape.dp == dp and mesh.dp_rank == DIES:
            os.kill(os.getpid(), signal.SIGKILL)
        apply_gradients(zero, lr(step, optimizer), CLIP, mesh=mesh)
        mean = mesh.dp_group.all_reduce(np.array([loss.item()]), op="avg", label="metric: mean loss")[0]
    except CommTimeoutError as e:  # a dead peer (ProcessFailedError), or a hung one past the deadline
        start = time.monotonic()
        shrunk = shrink(mesh.world, [mesh.tp_group, mesh.dp_group])
        mesh, zero = drop_replicas(shrunk, mesh, copies, make_zero, batch_size=BATCH)
        copies = ShardCopies(zero)
        print(f"RECOVERED rank={mesh.rank} at step {step} from '{e}' gone={list(shrunk.gone)} dp={mesh.shape.dp} tp={tp} "
              f"in {time.monotonic() - start:.4f}s", flush=True)
        continue  # redo the step
    losses.append(float(mean))
    step += 1
print(f"LOSSES rank={mesh.rank} {json.dumps(losses)}", flush=True)
leave(mesh.world)
