"""Action: one thing a pipeline rank does during a step. A schedule is a list of them per rank.

    F       forward of micro-batch ``microbatch`` through stage ``stage``
    B       backward of it (in a zero-bubble schedule only the input's gradient, and W the weights')
    SEND_F  send F's output (mb, T, C) to the next stage, where RECV_F receives it
    SEND_B  send the gradient of B's input (mb, T, C) to the previous stage, where RECV_B receives it

With p ranks and v chunks per rank there are p * v stages: stage s is chunk ``s // p`` of rank
``s % p`` (Megatron's "loop" placement), or in ZB-V's "v" placement, of rank p-1 - s % p in odd chunks.
"""
from __future__ import annotations

from dataclasses import dataclass

PASSES = {"F": "forward", "B": "backward", "W": "weight"}  # compute op -> its trace event
SENDS, RECVS = ("SEND_F", "SEND_B"), ("RECV_F", "RECV_B")


@dataclass(frozen=True)
class Action:
    """``op`` (F, B, W, SEND_F, RECV_F, SEND_B or RECV_B) of micro-batch ``microbatch`` on ``stage``."""
    op: str
    stage: int
    microbatch: int

    def __post_init__(self):
        if self.op not in (*PASSES, *SENDS, *RECVS):
            raise ValueError(f"unknown action op {self.op!r}; expected one of {', '.join((*PASSES, *SENDS, *RECVS))}")

    def __str__(self) -> str:
        """Short form, torch.distributed.pipelining's: ``1F3`` is stage 1's forward of micro-batch 3."""
        return f"{self.stage}{self.op}{self.microbatch}"

    @property
    def is_compute(self) -> bool:
        return self.op in PASSES

    def peer_stage(self) -> int:
        """The stage a SEND goes to or a RECV comes from (activations flow up, gradients down)."""
        return self.stage + (1 if self.op in ("SEND_F", "RECV_B") else -1)

    def channel_tag(self) -> int:
        """A SEND's or RECV's message tag, the same on both sides: one per (sending stage, direction)."""
        return 2 * (self.stage if self.op in SENDS else self.peer_stage()) + self.op.endswith("_B")


def stage_rank(stage: int, pp_size: int, placement: str = "loop") -> int:
    """The pipeline rank that holds ``stage`` (chunk ``stage // p``; backwards in the V's odd chunks)."""
    chunk, position = divmod(stage, pp_size)
    return pp_size - 1 - position if placement == "v" and chunk % 2 else position


def rank_stages(rank: int, pp_size: int, virtual_stages: int, placement: str = "loop") -> list[int]:
    """The global stages ``rank`` holds, chunk by chunk (one per chunk, so in increasing order)."""
    return [s for s in range(pp_size * virtual_stages) if stage_rank(s, pp_size, placement) == rank]
