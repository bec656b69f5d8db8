"""Rank script for tests/test_fault_tolerance.py: three dp replicas under ZeRO, one dies, the others go on.

    mpiexec --with-ft ulfm --mca mpi_ft_detector true -n 3 python tests/mpi/drop_replica.py STAGE OPTIMIZER

Replica 1 SIGKILLs itself at step DROP after its backward (stage 2: its reduce-scatters are under
way). The survivors' next collective raises ProcessFailedError; they shrink the world, re-form the
mesh with dp 2, rebuild the ZeRO state of the step's start from their copies, redo the step and
finish, leaving without MPI_Finalize (``leave``). Every survivor prints its losses (LOSSES rank=r [...]) and the recovery's time (RECOVERED ...).
"""
import json
import os
import signal
import sys
import time

import numpy as np

import minidist
from minidist.comm.fault_tolerance import leave, shrink, ulfm_problem
from minidist.comm.transport import ProcessFailedError
from minidist.model import GPT
from minidist.parallel.compose.gradients import apply_gradients
from minidist.parallel.data.sampler import dp_rows
from minidist.parallel.drop_replicas import drop_replicas
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.zero.optimizer import ZeroOptimizer
from minidist.parallel.zero.shard_copies import ShardCopies
from tests.mpi.zero_reference import CLIP, CONFIG, HYPER, SEED, lr
from tests.test_drop_replicas import BATCH, DIES, DROP, STEPS, batch

stage, optimizer = int(sys.argv[1]), sys.argv[2]
world = minidist.init(timeout=60.0)
assert ulfm_problem() is None, ulfm_problem()
model = GPT(CONFIG, seed=SEED, dtype="float64")


def make_zero(mesh):
    return ZeroOptimizer(model, mesh.dp_group, stage, optimizer, **HYPER[optimizer])


mesh = DeviceMesh(world, dp=3)
zero = make_zero(mesh)
copies = ShardCopies(zero)
losses, step = [], 0
while step < STEPS:
    try:
        copies.save()
        idx, targets = batch(step)
        rows = dp_rows(BATCH, mesh.dp_rank, mesh.shape.dp)
        zero.zero_grad()
        _, loss = model(idx[rows], targets[rows])
        loss.backward()
        if step == DROP and mesh.shape.dp == 3 and mesh.dp_rank == DIES:
            os.kill(os.getpid(), signal.SIGKILL)
        apply_gradients(zero, lr(step, optimizer), CLIP, mesh=mesh)
        mean = mesh.dp_group.all_reduce(np.array([loss.item()]), op="avg", label="metric: mean loss")[0]
    except ProcessFailedError as e:
        start = time.monotonic()
        shrunk = shrink(mesh.world, [mesh.dp_group])
        mesh, zero = drop_replicas(shrunk, mesh, copies, make_zero, batch_size=BATCH)
        copies = ShardCopies(zero)
        print(f"RECOVERED rank={mesh.rank} at step {step} from '{e}' gone={list(shrunk.gone)} dp={mesh.shape.dp} "
              f"in {time.monotonic() - start:.4f}s", flush=True)
        continue  # redo the step
    losses.append(float(mean))
    step += 1
print(f"LOSSES rank={mesh.rank} {json.dumps(losses)}", flush=True)
leave(mesh.world)
