"""A parameter-server worker: gradients on its rows of each batch, pushed to the servers; fresh
parameters pulled back.

Worker w of W takes rows ``numpy.array_split(range(B), W)[w]`` of each step's global batch (the
loss convention shared by every parallel layout: the mean over the rank's tokens; the servers
average over workers). Each step it

    1. computes loss and gradients with its full copy of the model,
    2. posts receives for every server's next parameter shard (receive before send),
    3. pushes gradient piece j (and its loss) to server j,
    4. waits for every shard (the "wait parameters" spans of the trace: in synchronous mode this
       is where a fast worker waits for the slowest one) and loads them into the model.

It stops when a server's answer says so (see ``ps_server``). In asynchronous mode there is no
averaged gradient to clip, so each worker clips its own.
"""
from __future__ import annotations

import time

import numpy as np

from minidist.data import inputs_and_targets
from minidist.data.dataset import read_windows, window_starts
from minidist.optim import clip_coef
from minidist.parallel.ps.protocol import (DONE, DONE_LABEL, PULL, PULL_HEADER, PULL_LABELS, PUSH, PUSH_HEADER,
                                           PUSH_LABELS)


class Worker:
    """Worker ``worker`` of ``workers``: world rank ``servers + worker``. ``delay`` seconds of sleep
    are added to each step (the straggler)."""

    def __init__(self, group, model, layout, cfg, servers: int, workers: int, delay: float = 0.0):
        self.group, self.model, self.layout, self.cfg = group, model, layout, cfg
        self.servers, self.delay = servers, delay
        self.worker = group.rank - servers
        self.rows = np.array_split(np.arange(cfg.batch_size), workers)[self.worker]  # my rows of each batch
        self.flat = layout.flat_params()  # (total,) the pulled parameters land here, shard by shard
        self.versions = np.zeros(servers, dtype=np.int64)  # each server's version of my parameters

    def run(self, tokens, asynchronous: bool) -> None:
        """Pull the initial parameters, then steps of compute, push, pull until a server says stop."""
        cfg, trace = self.cfg, self.group.trace
        self.exchange(None)
        step = 0
        while True:
            starts = window_starts(len(tokens), step, cfg.batch_size, cfg.block_size, cfg.seed)[self.rows]  # its rows'
            batch = read_windows(tokens, starts, [(0, cfg.block_size + 1)])  # (b, T+1): only their windows read
            idx, targets = inputs_and_targets(batch)  # (b, T), (b, T)
            self.model.zero_grad()
            with trace.record("forward", kind="compute"):
                _, loss = self.model(idx, targets)
            with trace.record("backward", kind="compute"):
                loss.backward()
            if self.delay:
                with trace.record("straggler delay", kind="compute"):
                    time.sleep(self.delay)
            grad = self.layout.flat_grads()  # (total,)
            if asynchronous and cfg.grad_clip > 0:
                grad *= clip_coef(float((grad * grad).sum()) ** 0.5, cfg.grad_clip)
            stop = self.exchange((step, grad, loss.item()))
            step += 1
            if stop.any():
                for j in np.flatnonzero(~stop):  # servers that expect another push
                    self.group.send(np.array([DONE, 0], dtype=np.int64), int(j), PUSH_HEADER, label=DONE_LABEL)
                return

    def exchange(self, push) -> np.ndarray:
        """Post the pulls of every shard, send ``push`` = (step, grad, loss) if given, wait for the
        shards and load them into the model. Returns each server's stop flag, (k,) bool."""
        g = self.group
        headers = np.empty((self.servers, 2), dtype=np.int64)  # (k, [version, stop])
        pulls = []
        for j, (lo, hi) in enumerate(self.layout.bounds):  # server j is world rank j
            pulls.append((g.irecv(headers[j], j, PULL_HEADER, label=PULL_LABELS[0]),
                          g.irecv(self.flat[lo:hi], j, PULL, label=PULL_LABELS[1])))
        pushes = []
        if push is not None:
            step, grad, loss = push
            for j, (lo, hi) in enumerate(self.layout.bounds):
                header = np.array([step, self.versions[j]], dtype=np.int64)
                payload = np.append(grad[lo:hi], grad.dtype.type(loss))  # (n_j + 1,) gradient piece, loss
                pushes.append((header, payload, g.isend(header, j, PUSH_HEADER, label=PUSH_LABELS[0]),
                               g.isend(payload, j, PUSH, label=PUSH_LABELS[1])))
        for j, (header_request, shard_request) in enumerate(pulls):
            with g.trace.record("wait parameters", kind="wait", peer=j):
                header_request.wait()
                shard_request.wait()
        for _, _, header_request, payload_request in pushes:
            header_request.wait()
            payload_request.wait()
        self.versions[:] = headers[:, 0]
        self.layout.load(self.flat)
        return headers[:, 1].astype(bool)
