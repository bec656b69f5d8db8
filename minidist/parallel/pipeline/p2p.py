"""Point-to-point between neighbouring pipeline stages: activations forward, gradients backward.

Both directions move one (mb, T, C) array per micro-batch, whose shape every rank knows from the
micro-batch and the config, so nothing but the data is sent. Sends are non-blocking (``isend``): the
sender goes on computing while its message waits for the receiver, and keeps the buffer alive until
:meth:`StageLink.wait_sends` at the end of the step. Receives block until the data is there. Since
sends never block, a schedule deadlocks only if some receive waits for a send that comes after it,
which the dry run in ``validate.py`` rules out before anything is sent.

Each (sending stage, direction) has its own tag (:meth:`Action.channel_tag`), so the messages of one
edge arrive in the order they were sent, as the validator checked.
"""
from __future__ import annotations

import numpy as np

from minidist.parallel.pipeline.actions import Action, stage_rank


class StageLink:
    """This rank's sends and receives over ``pp_group`` (which rank holds which stage: ``placement``,
    actions.py); received arrays are made by ``xp`` (NumPy, or CuPy: in the memory the stage
    computes in)."""

    def __init__(self, pp_group, xp=np, placement: str = "loop"):
        self.group, self.xp, self.placement = pp_group, xp, placement
        self.pending = []  # (request, buffer): isends not yet known to be complete

    def send(self, action: Action, x) -> None:
        """SEND_F / SEND_B: start sending array ``x`` to the rank of ``action``'s peer stage."""
        x = self.xp.ascontiguousarray(x)
        dst = stage_rank(action.peer_stage(), self.group.size, self.placement)
        self.pending.append((self.group.isend(x, dst, tag=action.channel_tag()), x))

    def recv(self, action: Action, shape, dtype) -> np.ndarray:
        """RECV_F / RECV_B: the (mb, T, C) array sent by the rank of ``action``'s peer stage."""
        buf = self.xp.empty(shape, dtype)
        src = stage_rank(action.peer_stage(), self.group.size, self.placement)
        self.group.irecv(buf, src, tag=action.channel_tag()).wait()
        return buf

    def wait_sends(self) -> None:
        """Wait until every send of this step has been delivered; the buffers may then be freed."""
        for request, _ in self.pending:
            request.wait()
        self.pending.clear()
