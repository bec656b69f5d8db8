"""The device mesh: the world's ranks as a (dp, pp, tp) grid, and one process group per axis.

Ranks are numbered with tp varying fastest, then pp, then dp:

    rank = (dp_rank * pp + pp_rank) * tp + tp_rank

so the ranks of one tensor-parallel group are adjacent (on a real cluster: the GPUs of one node,
joined by the fastest links), and data-parallel replicas are furthest apart. With dp=2, pp=2, tp=2:

    rank:  0  1  2  3  4  5  6  7
    dp:    0  0  0  0  1  1  1  1
    pp:    0  0  1  1  0  0  1  1
    tp:    0  1  0  1  0  1  0  1

A rank's tp group holds the ranks that share its (dp, pp); its pp group those that share (dp, tp);
its dp group those that share (pp, tp). No global state: build a mesh and pass it around.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MeshShape:
    """The sizes of the three axes; ``world`` is their product."""
    dp: int = 1
    pp: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of a global ``rank``."""
        return rank // (self.pp * self.tp), (rank // self.tp) % self.pp, rank % self.tp

    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        """The global rank at these coordinates."""
        return (dp_rank * self.pp + pp_rank) * self.tp + tp_rank


class DeviceMesh:
    """This rank's place in the (dp, pp, tp) grid and its three axis groups.

    Building it is collective over ``world`` (three ``split`` calls: every rank must build the same
    shape). ``world.size`` must equal dp * pp * tp.
    """

    def __init__(self, world, dp: int = 1, pp: int = 1, tp: int = 1):
        self.shape = MeshShape(dp, pp, tp)
        if world.size != self.shape.world:
            raise ValueError(f"world size {world.size} != dp*pp*tp = {dp}*{pp}*{tp} = {self.shape.world}")
        self.world = world
        self.rank = world.rank
        self.dp_rank, self.pp_rank, self.tp_rank = self.shape.coords(world.rank)
        d, p, t = self.dp_rank, self.pp_rank, self.tp_rank
        self.tp_group = world.split(d * pp + p, key=t, name=f"tp[dp{d},pp{p}]")
        self.pp_group = world.split(d * tp + t, key=p, name=f"pp[dp{d},tp{t}]")
        self.dp_group = world.split(p * tp + t, key=d, name=f"dp[pp{p},tp{t}]")

    @property
    def name(self) -> str:
        """A readable name such as ``DP(1)-PP(0)-TP(1)-Rank(5)``."""
        return f"DP({self.dp_rank})-PP({self.pp_rank})-TP({self.tp_rank})-Rank({self.rank})"

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.shape.pp - 1

    @property
    def prev_stage(self) -> int | None:
        """The pp-group rank of the previous pipeline stage, or None on the first stage."""
        return None if self.is_first_stage else self.pp_rank - 1

    @property
    def next_stage(self) -> int | None:
        """The pp-group rank of the next pipeline stage, or None on the last stage."""
        return None if self.is_last_stage else self.pp_rank + 1

    def __repr__(self) -> str:
        s = self.shape
        return f"DeviceMesh(dp={s.dp}, pp={s.pp}, tp={s.tp}, {self.name})"
