"""The layout, declared once: :class:`Layout`, how a run is cut over its ranks.

A layout is the mesh (dp x pp x cp x tp ranks, ep cutting dp), how each axis cuts (the cp
algorithm, sequence parallelism, the schedule, its virtual stages and the micro-batches), ZeRO and
offload, recompute, the precision, the device and the backend. Everything that holds a layout holds
this one type (as Megatron-Core's parallel config is the base of its model config): the trainer's
:class:`~minidist.train.config.TrainConfig`, the planner's :class:`~minidist.plan.layout.RunSpec`,
the support matrix's ``Cell``, and the device mesh's shape. Each answer below is computed here only:

    world                      the ranks the layout needs: dp x pp x cp x tp
    coords(rank), rank_of      a rank's place on each axis, and back (tp fastest, then cp, pp, dp)
    groups(axis)               the ranks of every group of an axis (the mesh splits its groups by it)
    zero_optimizer             whether the model's state is ZeRO's shards (a stage, or offload)

What is wrong with a layout is :func:`minidist.parallel.spec.problems`; how the mesh builds the
groups is :class:`minidist.parallel.mesh.DeviceMesh`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

RECOMPUTE = ("none", "selective", "full")  # full: each block's forward again in its backward (what minidist runs)


class Coords(NamedTuple):
    """A rank's place on each axis, in mesh order."""
    dp: int
    pp: int
    cp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    """How a run is cut (module docstring). ``recompute``: "full" recomputes each block in its
    backward; "selective" only the attention core (Korthikanti et al.: the planner estimates it, the
    trainer does not run it). ``offload``: "optimizer" moves ZeRO's optimizer shards off the device,
    "optimizer,params" ZeRO-3's parameter shards too."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    cp_algorithm: str = "ring"
    sequence_parallel: bool = False
    zero: int = 0
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batches: int = 1
    recompute: str = "none"
    dtype: str = "float32"
    offload: str = "none"
    device: str = "cpu"
    backend: str = "ring"

    @property
    def world(self) -> int:
        """The ranks the layout needs: dp x pp x cp x tp (ep cuts dp: no ranks of its own)."""
        return self.dp * self.pp * self.cp * self.tp

    @property
    def n_stages(self) -> int:
        """Pipeline stages: pp x virtual stages."""
        return self.pp * self.virtual_stages

    @property
    def zero_optimizer(self) -> bool:
        """Whether the model's state is ZeRO's flat shards (parallel/state.py): a ZeRO stage, or offload,
        which moves ZeRO's shards (with ``zero`` 0 every rank offloads its whole state)."""
        return self.zero > 0 or self.offload != "none"

    def coords(self, rank: int) -> Coords:
        """(dp_rank, pp_rank, cp_rank, tp_rank) of a global ``rank``."""
        return Coords(rank // (self.pp * self.cp * self.tp), (rank // (self.cp * self.tp)) % self.pp,
                      (rank // self.tp) % self.cp, rank % self.tp)

    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        """The global rank at these coordinates."""
        return ((dp_rank * self.pp + pp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of ``axis``, each as its ranks in group order (rank order), the groups in the
        order of their lowest rank: "tp", "cp", "pp", "dp" (the ranks that differ only in that
        coordinate), "dp_cp" (in dp and cp: the replicas of the gradients), "ep" (in the dp rank, inside
        one block of ep dp ranks) and "edp" (the ranks holding the same experts: in the block and cp)."""
        keys = {"tp": lambda d, p, c, t: (d, p, c), "cp": lambda d, p, c, t: (d, p, t),
                "pp": lambda d, p, c, t: (d, c, t), "dp": lambda d, p, c, t: (p, c, t),
                "dp_cp": lambda d, p, c, t: (p, t), "ep": lambda d, p, c, t: (d // self.ep, p, c, t),
                "edp": lambda d, p, c, t: (p, t, d % self.ep)}[axis]
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.world):
            groups.setdefault(keys(*self.coords(rank)), []).append(rank)
        return list(groups.values())

    def sized_axes(self) -> list[str]:
        """The axes of more than one rank, fastest first (tp, cp, pp, dp, then ep, which cuts dp)."""
        return [a for a in ("tp", "cp", "pp", "dp", "ep") if getattr(self, a) > 1]


LAYOUT_FIELDS = tuple(f.name for f in dataclasses.fields(Layout))


def layout_fields(holder) -> dict:
    """{field: value} of the layout a config, a planner's run or a matrix cell holds (each is one: a
    subclass of :class:`Layout`): what another holder of the same layout is built from."""
    return {name: getattr(holder, name) for name in LAYOUT_FIELDS}


def layout_of(holder) -> Layout:
    """The :class:`Layout` ``holder`` holds, as the plain value: for a key, or a comparison."""
    return Layout(**layout_fields(holder))
