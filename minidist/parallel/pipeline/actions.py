"""Action: one thing a pipeline rank does during a step. A schedule is a list of them per rank.

Seven kinds, as in torch.distributed.pipelining:

    F       forward of micro-batch ``microbatch`` through stage ``stage``
    B       backward of it (needs that F first); in a zero-bubble schedule only the gradient of the
            stage's input, what the previous stage waits for
    W       the weight gradients of that backward (zero-bubble schedules only; after its B)
    SEND_F  send F's output activation to the next stage       (mb, T, C)
    RECV_F  receive the previous stage's activation, before F  (mb, T, C)
    SEND_B  send the gradient of B's input to the previous stage
    RECV_B  receive the next stage's gradient, before B

``stage`` is the global (virtual) stage: with p ranks and v chunks per rank there are p * v stages,
and stage s is chunk ``s // p`` of a rank. Where the chunks go is the placement:

    loop    stage s on rank s % p (Megatron's interleaved layout): 0 1 2 3 | 0 1 2 3
    v       every second chunk runs backwards (ZB-V): 0 1 2 3 | 3 2 1 0, so with v = 2 rank r
            holds stages r and 2p-1-r, and rank 0 both the first and the last stage

With v = 1, stage and rank coincide.
"""
from __future__ import annotations

from dataclasses import dataclass

COMPUTE = ("F", "B", "W")
PLACEMENTS = ("loop", "v")
SENDS = ("SEND_F", "SEND_B")
RECVS = ("RECV_F", "RECV_B")
_WORDS = {"F": "forward", "B": "backward", "W": "weight gradients", "SEND_F": "send activation", "RECV_F": "receive activation",
          "SEND_B": "send gradient", "RECV_B": "receive gradient"}


@dataclass(frozen=True)
class Action:
    """``op`` (one of F, B, W, SEND_F, RECV_F, SEND_B, RECV_B) of micro-batch ``microbatch`` on ``stage``."""
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


def stage_rank(stage: int, pp_size: int, placement: str = "loop") -> int:
    """The pipeline rank that holds ``stage``: chunk ``stage // p``, position ``stage % p`` in it,
    counted backwards in the odd chunks of the "v" placement."""
    chunk, position = divmod(stage, pp_size)
    return pp_size - 1 - position if placement == "v" and chunk % 2 else position


def rank_stages(rank: int, pp_size: int, virtual_stages: int, placement: str = "loop") -> list[int]:
    """The global stages ``rank`` holds, chunk by chunk (one per chunk, so in increasing order)."""
    return [s for s in range(pp_size * virtual_stages) if stage_rank(s, pp_size, placement) == rank]
