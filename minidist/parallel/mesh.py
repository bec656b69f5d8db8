"""The device mesh: the world's ranks as a (dp, pp, cp, tp) grid, and one process group per axis.

Ranks are numbered with tp varying fastest, then cp, then pp, then dp:

    rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank

so the ranks of one tensor-parallel group are adjacent (on a real cluster: the GPUs of one node,
joined by the fastest links), the context-parallel ring comes next (it moves a K/V block per
attention step, so it wants the next-fastest links), and data-parallel replicas are furthest apart.
With dp=2, pp=2, cp=1, tp=2:

    rank:  0  1  2  3  4  5  6  7
    dp:    0  0  0  0  1  1  1  1
    pp:    0  0  1  1  0  0  1  1
    tp:    0  1  0  1  0  1  0  1

and with dp=1, pp=1, cp=2, tp=2: ranks 0, 1 hold the first half of every sequence (tp 0, 1), ranks
2, 3 the second.

A rank's tp group holds the ranks that share its (dp, pp, cp); its cp group those that share
(dp, pp, tp); its pp group those that share (dp, cp, tp); its dp group those that share (pp, cp, tp).
Context-parallel ranks hold the same parameters and see different tokens of the same rows, so for
the gradients they are data-parallel replicas: ``dp_cp_group`` (the ranks that share (pp, tp); the
dp group itself when cp = 1) is the group gradients are averaged and ZeRO shards over, as in
Megatron-LM.

Expert parallelism is no fifth axis: it cuts the dp axis (DeepSpeed-MoE's and torchtitan's choice,
so it costs no extra ranks). With ``ep`` dividing dp, consecutive blocks of ep dp ranks (sharing
pp, cp, tp) form an ``ep_group``, which splits each MoE layer's experts and all-to-alls tokens
among its ranks; ep rank = dp_rank % ep. The ranks holding the SAME experts (sharing pp, tp and
the ep rank: dp / ep replicas, times cp) form the ``expert_dp_group``, over which expert gradients
are reduced and ZeRO shards them (it is dp_cp_group when ep = 1). With dp = 4, ep = 2 (pp = cp =
tp = 1): ep groups {0, 1}, {2, 3}; expert-dp groups {0, 2}, {1, 3}.

No global state: build a mesh and pass it around.
"""
from __future__ import annotations

from minidist.comm.machines import Machines, one_machine
from minidist.parallel.layout import Layout


class DeviceMesh:
    """This rank's place in the (dp, pp, cp, tp) grid and its axis groups.

    Building it is collective over ``world`` (one ``split`` per axis, one more for ``dp_cp_group``
    when cp > 1 and two for the ep groups when ep > 1: every rank must build the same shape).
    ``machines``: which machine each world rank runs on (``comm.machines.machines_of(world)``;
    None: all on one), for :meth:`machines_spanned`.
    ``world.size`` must equal dp * pp * cp * tp, and ep divide dp. ``ep_group`` is None when ep = 1.
    """

    def __init__(self, world, dp: int = 1, pp: int = 1, tp: int = 1, cp: int = 1, ep: int = 1,
                 machines: Machines | None = None):
        self.shape = s = Layout(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep)  # the mesh's axes of a layout
        if world.size != s.world:
            raise ValueError(f"world size {world.size} != dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp} = {s.world}")
        if dp % ep:
            raise ValueError(f"expert parallelism cuts the dp axis: ep {ep} must divide dp {dp}")
        self.world = world
        self.machines = machines if machines is not None else one_machine(world.size)
        self.rank = world.rank
        self.dp_rank, self.pp_rank, self.cp_rank, self.tp_rank = d, p, c, t = s.coords(world.rank)
        self.tp_group = self._split("tp", f"tp[dp{d},pp{p}{_cp(c, cp)}]")
        self.cp_group = self._split("cp", f"cp[dp{d},pp{p},tp{t}]")
        self.pp_group = self._split("pp", f"pp[dp{d}{_cp(c, cp)},tp{t}]")
        self.dp_group = self._split("dp", f"dp[pp{p}{_cp(c, cp)},tp{t}]")
        self.dp_cp_group = self.dp_group if cp == 1 else self._split("dp_cp", f"dp_cp[pp{p},tp{t}]")
        self.ep_rank, block = d % ep, d // ep
        self.ep_group = None if ep == 1 else self._split(
            "ep", f"ep[dp{block * ep}-{block * ep + ep - 1},pp{p}{_cp(c, cp)},tp{t}]")
        self.expert_dp_group = self.dp_cp_group if ep == 1 else self._split("edp", f"edp[pp{p},tp{t},ep{d % ep}]")

    @classmethod
    def of(cls, world, layout: Layout, machines: Machines | None = None) -> "DeviceMesh":
        """The mesh of ``layout`` (a :class:`~minidist.parallel.layout.Layout`, or anything holding one:
        a trainer's config) over ``world``."""
        return cls(world, dp=layout.dp, pp=layout.pp, tp=layout.tp, cp=layout.cp, ep=layout.ep, machines=machines)

    def _split(self, axis: str, name: str):
        """This rank's group of ``axis``: one ``split`` of the world (collective), its members those
        of ``Layout.groups`` (the one place they are computed), in their order."""
        index, members = next((i, g) for i, g in enumerate(self.shape.groups(axis)) if self.rank in g)
        return self.world.split(index, key=members.index(self.rank), name=name)

    @property
    def name(self) -> str:
        """A readable name such as ``DP(1)-PP(0)-TP(1)-Rank(5)`` (with ``-CP(c)`` when cp > 1)."""
        cp = f"-CP({self.cp_rank})" if self.shape.cp > 1 else ""
        return f"DP({self.dp_rank})-PP({self.pp_rank}){cp}-TP({self.tp_rank})-Rank({self.rank})"

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

    def machines_spanned(self) -> dict[str, int]:
        """{axis: the most machines one of its groups spans} for every axis of more than one rank:
        1 where each group stays inside a machine (``comm/machines.py`` says which rank is where)."""
        return {axis: max(len(self.machines.spanned(g)) for g in self.shape.groups(axis))
                for axis in self.shape.sized_axes()}

    def machine_lines(self) -> list[str]:
        """Where the groups run, when the world spans several machines (nothing on one): which ranks
        each machine holds, whether each axis's groups stay inside a machine or cross machines, and
        a warning when tensor parallelism crosses them (the planner's search keeps it inside)."""
        if self.machines.count == 1:
            return []
        spans = self.machines_spanned()
        lines = [f"{self.machines}; " + ", ".join(
            f"{axis} groups {'inside a machine' if n == 1 else f'across {n} machines'}" for axis, n in spans.items())]
        if spans.get("tp", 1) > 1:
            lines.append(f"warning: tensor-parallel groups cross machines: tp sums activations in every layer, forward "
                         f"and backward, so each step waits on the link between machines; give every machine a "
                         f"multiple of {self.shape.tp} consecutive ranks (--tp), or lower --tp")
        return lines

    def __repr__(self) -> str:
        s = self.shape
        cp = f", cp={s.cp}" if s.cp > 1 else ""
        ep = f", ep={s.ep}" if s.ep > 1 else ""
        return f"DeviceMesh(dp={s.dp}, pp={s.pp}{cp}, tp={s.tp}{ep}, {self.name})"


def _cp(cp_rank: int, cp: int) -> str:
    """The cp coordinate in a group's name, only when there is a cp axis (names stay as they were)."""
    return f",cp{cp_rank}" if cp > 1 else ""
