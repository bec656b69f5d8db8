"""What parameter servers and workers agree on: the flat parameter vector, its cut, the messages.

The flat vector is every parameter of the model (``named_parameters()`` order, tied weights once)
raveled and concatenated. It is cut over the k servers by ``numpy.array_split``: server j owns
elements ``bounds[j] = (lo, hi)``, and the optimizer state of exactly those elements.

Messages (point to point, NumPy buffers, never pickled), between worker w and server j:

    push   worker -> server   header int64 [step, version]  then  payload [grad[lo:hi]..., loss]
    pull   server -> worker   header int64 [version, stop]  then  payload params[lo:hi]
    done   worker -> server   header int64 [DONE, 0]: "another server told me to stop" (async only)
    gather server j -> server 0 at the end: params[lo:hi]

``step`` is the worker's step number, ``version`` the server's count of applied updates when it sent
the parameters the gradient was computed on (so the server can measure staleness). The loss rides as
one extra element after the gradient piece, so a push is two messages. Messages with one tag between
a pair of ranks arrive in order, so a header is always followed by its own payload.
"""
from __future__ import annotations

import time

import numpy as np

from minidist.comm import CommTimeoutError
from minidist.comm.ops import offsets, split_counts
from minidist.optim import decays

PUSH_HEADER, PUSH, PULL_HEADER, PULL, GATHER = 1, 2, 3, 4, 5  # message tags
DONE = -1  # the step of a push header that carries no gradient: the worker has stopped
PUSH_LABELS = ("gradient: a push's header (its step, the parameter version it used)",  # the messages' labels
               "gradient: a push, a gradient piece and the loss")
PULL_LABELS = ("parameter: a pull's header (the shard's version, stop)",
               "parameter: a pull, a server's parameter shard")
DONE_LABEL = "setup: a push header saying this worker stops"
GATHER_LABEL = "parameter: a server's final shard, to server 0"

FIRST_SLEEP, MAX_SLEEP = 50e-6, 1e-3  # wait_any's polling pauses: doubling from the first to the max


class FlatLayout:
    """A model's parameters as one flat vector cut over ``servers`` shards.

    ``total`` elements of ``dtype``; ``bounds[j]`` = (lo, hi) of server j's shard."""

    def __init__(self, model, servers: int):
        self.params = [p for _, p in model.named_parameters()]
        self.shapes = [p.data.shape for p in self.params]
        sizes = [p.data.size for p in self.params]
        self.starts = offsets(sizes)
        self.total = sum(sizes)
        self.dtype = self.params[0].data.dtype
        cut = offsets(split_counts(self.total, servers)) + [self.total]
        self.bounds = [(cut[j], cut[j + 1]) for j in range(servers)]

    def flat_params(self) -> np.ndarray:
        """The model's current parameters as one new flat array, shape (total,)."""
        return np.concatenate([p.data.reshape(-1) for p in self.params])

    def flat_grads(self) -> np.ndarray:
        """The model's gradients as one new flat array (zeros where a parameter has none)."""
        return np.concatenate([p.grad.reshape(-1) if p.grad is not None else np.zeros(p.data.size, self.dtype)
                               for p in self.params])

    def load(self, flat: np.ndarray) -> None:
        """Copy the flat vector ``flat`` (total,) into the model's parameters, in place."""
        for p, start, shape in zip(self.params, self.starts, self.shapes):
            p.data[...] = flat[start:start + p.data.size].reshape(shape)

    def weight_decay_rates(self, weight_decay: float) -> np.ndarray:
        """Per-element weight-decay rates (total,): ``weight_decay`` on the elements of decayed
        parameters (``minidist.optim.decays``: >= 2-D), 0 elsewhere. The element-wise optimizer
        updates take it in place of a scalar rate, so one call updates a shard mixing both kinds."""
        return np.concatenate([np.full(p.data.size, weight_decay if decays(shape) else 0.0, self.dtype)
                               for p, shape in zip(self.params, self.shapes)])


def wait_any(group, requests: dict, what: str):
    """Wait until one of ``requests`` ({key: request}) completes; return its key.

    Polls each request's ``test()``, sleeping between rounds (50 us doubling to 1 ms) so a waiting
    rank leaves the core to the ranks it waits for. Past the transport's timeout raises
    :class:`CommTimeoutError` naming ``what``, this rank and the first peer waited for. The keys
    must be the peers' ranks."""
    start = time.monotonic()
    pause = FIRST_SLEEP
    while True:
        for key, request in requests.items():
            if request.test():
                return key
        waited = time.monotonic() - start
        if waited > group.transport.timeout:
            raise CommTimeoutError(what, group.p2p_seq, group.rank, next(iter(requests)), waited, group.name)
        time.sleep(pause)
        pause = min(2 * pause, MAX_SLEEP)
