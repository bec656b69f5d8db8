"""Action: one thing a pipeline rank does during a step. A schedule is a list of them per rank.

Six kinds, as in torch.distributed.pipelining:

    F       forward of micro-batch ``microbatch`` through stage ``stage``
    B       backward of it (needs that F first)
    SEND_F  send F's output activation to the next stage       (mb, T, C)
    RECV_F  receive the previous stage's activation, before F  (mb, T, C)
    SEND_B  send the gradient of B's input to the previous stage
    RECV_B  receive the next stage's gradient, before B

``stage`` is the global (virtual) stage: with p ranks and v chunks per rank (interleaved 1F1B) there
are p * v stages, and stage s lives on rank ``s % p`` as its chunk ``s // p`` (Megatron's layout).
With v = 1, stage and rank coincide.
"""
from __future__ import annotations

from dataclasses import dataclass

COMPUTE = ("F", "B")
SENDS = ("SEND_F", "SEND_B")
RECVS = ("RECV_F", "RECV_B")
_WORDS = {"F": "forward", "B": "backward", "SEND_F": "send activation", "RECV_F": "receive activation",
          "SEND_B": "send gradient", "RECV_B": "receive gradient"}


@dataclass(frozen=True)
class Action:
    """``op`` (one of F, B, SEND_F, RECV_F, SEND_B, RECV_B) of micro-batch ``microbatch`` on ``stage``."""
    op: str
    stage: int
    microbatch: int

    def __post_init__(self):
        if self.op not in _WORDS:
            raise ValueError(f"unknown action op {self.op!r}; expected one of {', '.join(_WORDS)}")

    def __str__(self) -> str:
        """Short form, torch.distributed.pipelining's: ``1F3`` is stage 1's forward of micro-batch 3."""
        return f"{self.stage}{self.op}{self.microbatch}"

    def describe(self) -> str:
        """Long form: ``1B2 (backward of micro-batch 2 on stage 1)``."""
        return f"{self} ({_WORDS[self.op]} of micro-batch {self.microbatch} on stage {self.stage})"

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE

    def peer_stage(self) -> int | None:
        """The stage a SEND goes to or a RECV comes from (activations flow up, gradients down)."""
        return {"SEND_F": self.stage + 1, "RECV_F": self.stage - 1,
                "SEND_B": self.stage - 1, "RECV_B": self.stage + 1}.get(self.op)

    def channel_tag(self) -> int | None:
        """The message tag of a SEND or RECV: one per (sending stage, direction), the same on both
        sides, so messages of one edge arrive in the order they were sent (MPI's rule)."""
        if self.op in ("SEND_F", "SEND_B"):
            return 2 * self.stage + (self.op == "SEND_B")
        if self.op in ("RECV_F", "RECV_B"):
            return 2 * self.peer_stage() + (self.op == "RECV_B")
        return None

    def matching(self) -> "Action | None":
        """The RECV that pairs with this SEND on the peer stage, or the SEND that pairs with this RECV."""
        pairs = {"SEND_F": "RECV_F", "RECV_F": "SEND_F", "SEND_B": "RECV_B", "RECV_B": "SEND_B"}
        if self.op not in pairs:
            return None
        return Action(pairs[self.op], self.peer_stage(), self.microbatch)


def stage_rank(stage: int, pp_size: int) -> int:
    """The pipeline rank that holds ``stage`` (stage s is chunk s // p of rank s % p)."""
    return stage % pp_size
