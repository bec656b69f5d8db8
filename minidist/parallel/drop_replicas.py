"""Data parallelism that loses whole replicas and goes on, live: the survivors' mesh, rows and ZeRO state.

When every rank of some data-parallel replicas has died, the survivors shrink their world
(``comm/fault_tolerance.py``). Then :func:`drop_replicas` re-forms the mesh with dp - k replicas
(the same pp, cp, tp and ep; every survivor keeps its place but for the dp coordinate, closed up
over the dead replicas) and, under ZeRO-1 or 2, re-cuts the optimizer state from the start-of-step
copies the survivors hold (``zero/shard_copies.py``). The global batch stays the same: dp rank d
of the new mesh reads rows ``dp_rows(B, d, dp - k)`` (``data/sampler.py``), so the step redone,
and every step after it, is the step of a run that had dp - k replicas from there on.

    try:
        copies.save()                                  # the step's start, kept twice
        loss, norm = train_step(model, zero, batch, lr, clip, mesh=mesh)
    except CommTimeoutError:                           # ProcessFailedError too: a dead peer, or a hung one
        shrunk = shrink(mesh.world, [mesh.tp_group, mesh.pp_group, mesh.dp_group])
        mesh, zero = drop_replicas(shrunk, mesh, copies, make_zero, batch_size=B)
        copies = ShardCopies(zero)                     # then redo the step, on the new mesh's rows
"""
from __future__ import annotations

from minidist.comm.machines import Machines
from minidist.parallel.layout import Layout
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.zero.shard_copies import recut


def survivors_shape(shape: Layout, gone, batch_size: int | None = None) -> tuple[Layout, set[int]]:
    """The mesh shape left when the world ranks ``gone`` have died, and the dp ranks that died with
    them. A ValueError unless ``gone`` are whole dp replicas and ``batch_size`` (when given) still
    divides over the replicas left."""
    dead = {shape.coords(r).dp for r in gone}
    alive = sorted(r for r in range(shape.world) if shape.coords(r).dp in dead and r not in gone)
    if alive:
        raise ValueError(f"ranks {sorted(gone)} died, but ranks {alive} of their replicas did not: only whole "
                         f"data-parallel replicas can be dropped")
    dp = shape.dp - len(dead)
    if dp < 1:
        raise ValueError("every data-parallel replica died")
    if dp % shape.ep:
        raise ValueError(f"expert parallelism cuts the dp axis: ep {shape.ep} does not divide the {dp} replicas left")
    if batch_size is not None and batch_size % dp:
        raise ValueError(f"the global batch of {batch_size} rows does not divide over the {dp} replicas left")
    return Layout(dp=dp, pp=shape.pp, tp=shape.tp, cp=shape.cp, ep=shape.ep), dead


def drop_replicas(shrunk, mesh: DeviceMesh, copies=None, make_zero=None, batch_size: int | None = None):
    """Collective over the survivors (``shrunk``: :func:`~minidist.comm.fault_tolerance.shrink`'s
    answer on ``mesh``'s world): their DeviceMesh, and with ``copies`` (a ShardCopies of the old
    ZeroOptimizer) the new ZeroOptimizer ``make_zero(new_mesh)`` holding the start-of-step state,
    re-cut. Returns (new mesh, new ZeroOptimizer or None).

    What it sends: the new mesh's splits (``DeviceMesh``), then :func:`~minidist.parallel.zero.shard_copies.recut`'s
    all-reduces over the new dp group."""
    shape, dead = survivors_shape(mesh.shape, shrunk.gone, batch_size)
    per_replica = mesh.shape.world // mesh.shape.dp
    for old, new in shrunk.rank_map.items():
        closed_up = old - per_replica * sum(d < mesh.shape.coords(old).dp for d in dead)
        if new != closed_up:
            raise RuntimeError(f"the shrunk world renumbered rank {old} as {new}, not {closed_up}: the ranks' order changed")
    new_mesh = DeviceMesh(shrunk.world, shape.dp, shape.pp, shape.tp, shape.cp, shape.ep,
                          machines=survivors_machines(mesh.machines, shrunk.rank_map))
    if copies is None:
        return new_mesh, None
    copies.zero.close()  # its hooks off the model: the new optimizer's take over
    zero = make_zero(new_mesh)
    recut(copies, dead, new_mesh.dp_group, zero)
    return new_mesh, zero


def survivors_machines(machines: Machines, rank_map: dict[int, int]) -> Machines:
    """Which machine each survivor runs on, by its new rank (machines renumbered in order of their lowest rank)."""
    old = [machines.of_rank[r] for r in sorted(rank_map, key=rank_map.get)]
    order = list(dict.fromkeys(old))
    return Machines(tuple(order.index(m) for m in old), tuple(machines.hosts[m] for m in order) if machines.hosts else ())
