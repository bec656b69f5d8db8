"""Rank script (4 ranks): ZeRO stages 0-3 under real MPI match one process on the full batch.

Run by tests/test_mpi_zero.py as ``mpiexec -n 4 python tests/mpi/zero_parity.py``. One launch covers
dp = 4 (the world), dp = 2 (the world split in two independent pairs) and dp = 2 x tp = 2 (a mesh),
each with stages 0-3 and SGD+momentum / AdamW for 10 float64 steps, then measures stage 3's traffic
against plain data parallelism's and the bytes each rank holds. Any mismatch raises (the job aborts,
mpiexec exits non-zero); rank 0 prints ``OK <checks>``.
"""
import numpy as np

import minidist
from minidist.model import GPT, GPTConfig
from minidist.inspect import accounting
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.zero.optimizer import ZeroOptimizer
from minidist.inspect import zero_memory
from zero_reference import CONFIG, batch, max_relative_error, reference, zero_rank

world = minidist.init(timeout=60.0)
assert world.size == 4, "run on 4 ranks"
pair = world.split(world.rank // 2, name="pair")
mesh = DeviceMesh(world, dp=2, tp=2)
checks = 0

for optimizer in ("sgd", "adamw"):
    ref_losses, _, ref_state = reference(optimizer)
    for stage in (0, 1, 2, 3):
        for layout, group, kwargs in (("dp4", world, {}), ("dp2", pair, {}), ("dp2xtp2", None, {"mesh": mesh})):
            losses, _, state, _ = zero_rank(group, stage, optimizer, **kwargs)
            dp_group = mesh.dp_group if group is None else group
            mean = dp_group.all_reduce(np.array(losses), op="avg")  # the step loss over dp
            loss_err = float(np.abs(mean - ref_losses).max() / np.abs(ref_losses).max())
            weight_err = max_relative_error(state, ref_state)
            if not (loss_err <= 1e-10 and weight_err <= 1e-10):
                raise AssertionError(f"{layout} stage {stage} {optimizer}: loss {loss_err:.2e}, weights {weight_err:.2e}")
            checks += 1

# Recomputation inside ZeRO-2 changes nothing either.
losses, _, state, _ = zero_rank(world, 2, "sgd", recompute=True)
assert max_relative_error(state, reference("sgd")[2]) <= 1e-10
checks += 1

# Traffic of one step (no clipping) on the dp group, and the bytes each rank holds after backward.
untied = GPTConfig(**{**vars(CONFIG), "tie_embeddings": False})
sent, held = {}, {}
for stage in (0, 1, 2, 3):
    model = GPT(untied, seed=0, dtype="float64")
    zero = ZeroOptimizer(model, world, stage, "adamw", lr=1e-3)
    idx, targets = batch(0)
    rows = np.array_split(np.arange(len(idx)), world.size)[world.rank]
    world.trace.clear()
    model(idx[rows], targets[rows])[1].backward()
    zero.reduce()
    zero.unscale(1.0)
    held[stage] = (zero_memory.model_state_bytes(zero), zero_memory.formula(zero))
    zero.update(1e-3)  # no clipping: ZeRO's own traffic
    sent[stage] = accounting.bus_bytes(world.trace.events, world.name, world.size)["total"]
assert sent[1] == sent[2] == sent[0], sent
assert sent[3] == 1.5 * sent[0], sent
for stage, (measured, formula) in held.items():
    assert measured == formula, (stage, measured, formula)
checks += 2

if world.rank == 0:
    print(f"OK {checks} checks on {world.size} ranks")
