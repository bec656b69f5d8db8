"""Point-to-point between pipeline stages: activations forward, gradients backward, a round at a time.

Both directions move one (mb, T, C) array per micro-batch, whose shape every rank knows, so only
the data is sent. The link posts each ROUND (the messages between two compute actions) as ONE batch
(``ProcessGroup.batch_isend_irecv``: Megatron's batched isend/irecv, one NCCL group over NCCL) and
waits for its receives; the sends, at the end of the step. Each (sending stage, direction) has its
own tag; NCCL, which has none, matches the messages between two ranks in posting order.
"""
from __future__ import annotations

import numpy as np

from minidist.comm.point_to_point import P2POp
from minidist.parallel.pipeline.actions import SENDS, Action, stage_rank


def label(a: Action) -> str:
    """What message ``a`` carries, for the trace: "activation: gradient to stage 2", ..."""
    what = "forward activations" if a.op.endswith("F") else "gradient"
    return f"activation: {what} {'to' if a.op in SENDS else 'from'} stage {a.peer_stage()}"


class StageLink:
    """This rank's messages over ``pp_group`` for one step (which rank holds which stage:
    ``placement``, actions.py); it receives (mb, T, C) arrays ``shape`` of ``dtype`` made by ``xp``
    (NumPy, or CuPy: in the memory the stage computes in)."""

    def __init__(self, pp_group, xp=np, placement: str = "loop", shape=(), dtype=np.float32):
        self.group, self.xp, self.placement, self.shape, self.dtype = pp_group, xp, placement, shape, dtype
        self.arrived = {}  # RECV action -> the array it brought, until a compute action takes it
        self.sending = []  # (request, array) of this step's sends, until they are known delivered

    def post(self, messages) -> None:
        """One round: ``messages`` are (SEND action, the array it sends) and (RECV action, None)
        pairs, posted as one batch; returns once the receives have arrived. Sends each SEND's array
        to the rank of its peer stage."""
        ops = []
        for a, x in messages:
            buffer = self.xp.ascontiguousarray(x) if a.op in SENDS else self.xp.empty(self.shape, self.dtype)
            peer = stage_rank(a.peer_stage(), self.group.size, self.placement)
            ops.append(P2POp("isend" if a.op in SENDS else "irecv", buffer, peer, a.channel_tag(), label(a)))
        for (a, _), op, request in zip(messages, ops, self.group.batch_isend_irecv(ops)):
            if a.op in SENDS:
                self.sending.append((request, op.buffer))
            else:
                request.wait()
                self.arrived[a] = op.buffer

    def take(self, recv: Action):
        """The (mb, T, C) array that RECV ``recv`` brought (or that a stage on this rank handed over)."""
        return self.arrived.pop(recv)

    def wait_sends(self) -> None:
        """Wait until every send of this step has been delivered; the arrays may then be freed."""
        for request, _ in self.sending:
            request.wait()
        self.sending.clear()
