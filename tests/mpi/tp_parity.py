"""Rank script: the GPT made tensor parallel under real MPI equals one process.

Run by tests/test_mpi_tensor_parallel.py as ``mpiexec -n 4 python tests/mpi/tp_parity.py``. For both
backends (hand-written ring collectives, MPI's own) and the layouts tp=4 and dp=2 x tp=2 (two
independent tp groups side by side), with and without sequence parallelism, every rank runs one
forward and backward and checks, against the single-process GPT it computes itself: the loss
(1e-10 relative, and bitwise the same on every rank of its tp group) and each of its gradient shards
(``shard_for`` of the full gradient, 1e-10 relative). A mismatch raises, which aborts the job. Rank 0
prints one ``OK`` line per case.
"""
import numpy as np

import minidist
from minidist.model import GPT, GPTConfig
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.tensor.apply import tensor_parallel
from minidist.parallel.compose.complete import sync_sequence_parallel_grads
from minidist.parallel.tensor.tensor_parallel import shard_for

CONFIG = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=4, n_embd=16)  # vocab padded to 12

rng = np.random.default_rng(0)
idx, targets = rng.integers(0, 11, (2, 8)), rng.integers(0, 11, (2, 8))
ref = GPT(CONFIG, seed=0, dtype="float64")
_, ref_loss = ref(idx, targets)
ref_loss.backward()

for backend in ("ring", "mpi"):
    world = minidist.init(backend=backend, timeout=30.0)
    for dp, tp in ((1, 4), (2, 2)):
        mesh = DeviceMesh(world, dp=dp, tp=tp)
        for sequence_parallel in (False, True):
            model = tensor_parallel(GPT(CONFIG, 0, "float64"), mesh.tp_group, sequence_parallel=sequence_parallel)
            _, loss = model(idx, targets)
            loss.backward()
            sync_sequence_parallel_grads(model, mesh.tp_group)
            losses = mesh.tp_group.all_gather(np.array([loss.item()]))
            assert len(set(losses)) == 1, f"{mesh.name}: losses differ across the tp group: {losses}"
            assert abs(loss.item() - ref_loss.item()) <= 1e-10 * ref_loss.item(), (mesh.name, loss.item())
            for (name, p), (ref_name, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
                expected = shard_for(name, q.grad, mesh.tp_rank, tp)
                err = np.abs(p.grad - expected).max() / np.abs(q.grad).max()
                assert name == ref_name and err <= 1e-10, f"{mesh.name} {name}: relative error {err:.2e}"
            world.barrier()
            if world.rank == 0:
                print(f"OK backend={backend} dp={dp} tp={tp} sequence_parallel={sequence_parallel}", flush=True)
