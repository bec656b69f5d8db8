"""A parameter server: one shard of the flat parameters, its optimizer state, and the update loop.

Synchronous (``run_sync``): for each step t the server receives every worker's gradient piece,
averages them (worker order, so the sum is deterministic), clips by the global norm (the servers
all-reduce their shards' squared norms among themselves), applies one optimizer update and sends
the new parameters back to every worker. Averaging W gradients of W equal row-slices of the batch
gives the full-batch gradient, so this equals one process and all-reduce data parallelism.

Asynchronous (``run_async``): the server applies each worker's gradient the moment it arrives
(scaled by 1/W: with SGD, W updates make about one synchronous step; Adam's normalised update
undoes the scale, so with AdamW each is a full step), then answers that worker with the
latest parameters. Nobody waits for the slowest worker, so updates may be computed on stale
parameters: staleness = server version now - version the gradient was computed on, recorded per
update. Staleness bound s (stale synchronous parallel): the answer to a worker that has finished
c steps is held back until every worker has finished at least c - s, so no worker runs more than
s steps ahead of the slowest. The run is a budget of W * steps updates, the synchronous run's
gradient work, however the workers share it: with a loose bound the fast workers do most of it.

Stopping: the answer to a push says whether to go on. Servers see pushes in different orders, so
one may say stop while another says go on; the worker then sends that one a DONE header. Every
push reaches every server, so all shards apply the same set of gradients.

A run that diverges stops at once rather than train on NaN: a push whose loss is NaN or inf (or, in
synchronous mode, a step whose global gradient norm is) ends the run as the end of the budget does.
Every server sees that push (with the same loss), so they all stop, synchronously at the same step;
the trainer then reports it (train/ps.py).
"""
from __future__ import annotations

import math
import time

import numpy as np

from minidist.optim import OPTIMIZERS, adamw_update, clip_coef, lr_at, sgd_update
from minidist.parallel.ps.protocol import (DONE, GATHER, GATHER_LABEL, PULL, PULL_HEADER, PULL_LABELS, PUSH,
                                           PUSH_HEADER, PUSH_LABELS, wait_any)

ADAMW_EPS = 1e-8  # as minidist.optim.AdamW's


class ParameterServer:
    """Server ``server`` of ``servers_group``: owns ``layout.bounds[server]`` of the flat parameters.

    ``group`` is the world (servers are ranks 0..k-1, workers k..k+W-1), ``cfg`` a TrainConfig-like
    object (optimizer, lr, min_lr, warmup, steps, momentum, beta1, beta2, weight_decay, grad_clip). The shard's
    initial value is read from ``layout``'s model, which every rank built from the same seed.
    ``history`` (server 0 only, else None) receives one dict per step (sync) or update (async).
    """

    def __init__(self, group, servers_group, layout, cfg, workers: int, history: list | None, t0: float):
        self.group, self.servers_group, self.cfg = group, servers_group, cfg
        self.server = servers_group.rank
        lo, hi = layout.bounds[self.server]
        self.shard = layout.flat_params()[lo:hi].copy()  # (n,) this server's parameters
        self.rates = layout.weight_decay_rates(cfg.weight_decay)[lo:hi]  # (n,) per-element decay
        self.state = {slot: np.zeros_like(self.shard) for slot in OPTIMIZERS[cfg.optimizer].slots}
        self.version = 0  # updates applied so far
        self.workers = list(range(servers_group.size, servers_group.size + workers))  # their world ranks
        self.staleness: list[int] = []  # per applied update (async)
        self.history, self.t0 = history, t0

    # ---- the update ------------------------------------------------------------------------------

    def apply(self, grad, step: int) -> float:
        """One optimizer update of the shard with ``grad`` (n,), at the learning rate of ``step``.
        Returns the learning rate."""
        cfg = self.cfg
        lr = lr_at(step, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr)
        self.version += 1
        with self.group.trace.record("optimizer", kind="compute"):
            if cfg.optimizer == "adamw":
                adamw_update(self.shard, grad, self.state["exp_avg"], self.state["exp_avg_sq"], step=self.version,
                             lr=lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=ADAMW_EPS,
                             weight_decay=self.rates)
            else:
                sgd_update(self.shard, grad, self.state["momentum_buf"], lr=lr, momentum=cfg.momentum,
                           weight_decay=self.rates)
        return lr

    def send_params(self, ranks, stop: bool = False) -> None:
        """Pull, server side: send [version, stop] and the shard to each worker in ``ranks``."""
        header = np.array([self.version, stop], dtype=np.int64)
        requests = []
        for rank in ranks:
            requests += [self.group.isend(header, rank, PULL_HEADER, label=PULL_LABELS[0]),
                         self.group.isend(self.shard, rank, PULL, label=PULL_LABELS[1])]
        for r in requests:
            r.wait()  # each worker posted its pull before pushing, so this is quick

    def recv_push(self, rank: int) -> np.ndarray:
        """The payload of a push whose header has arrived: [grad piece..., loss], shape (n+1,)."""
        payload = np.empty(self.shard.size + 1, self.shard.dtype)
        return self.group.recv(payload, rank, PUSH, label=PUSH_LABELS[1])

    # ---- synchronous -----------------------------------------------------------------------------

    def run_sync(self) -> None:
        """``cfg.steps`` synchronous steps: all gradients in, average, clip, update, parameters out."""
        n, W, trace = self.shard.size, len(self.workers), self.group.trace
        headers = np.empty((W, 2), dtype=np.int64)  # (W, [step, version])
        pushes = np.empty((W, n + 1), dtype=self.shard.dtype)  # (W, n + 1) gradient pieces and losses
        self.send_params(self.workers)
        for t in range(self.cfg.steps):
            for w, rank in enumerate(self.workers):
                with trace.record("wait gradient", kind="wait", peer=rank):
                    self.group.recv(headers[w], rank, PUSH_HEADER, label=PUSH_LABELS[0])
                    self.group.recv(pushes[w], rank, PUSH, label=PUSH_LABELS[1])
                if tuple(headers[w]) != (t, self.version):
                    raise RuntimeError(f"server {self.server}: worker rank {rank} pushed step {headers[w][0]} "
                                       f"on version {headers[w][1]}, expected step {t} on version {self.version}")
            grad = pushes[:, :n].sum(axis=0) / W  # (n,) the full-batch gradient's piece
            grad_norm = self.global_norm(grad)
            if self.cfg.grad_clip > 0:
                grad *= clip_coef(grad_norm, self.cfg.grad_clip)
            lr = self.apply(grad, t)
            loss = float(pushes[:, n].mean())  # the same on every server: each worker pushes its loss to all
            if self.history is not None:
                self.history.append({"step": t, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                                     "time": time.perf_counter() - self.t0})
            diverged = not (math.isfinite(loss) and math.isfinite(grad_norm))
            self.send_params(self.workers, stop=t == self.cfg.steps - 1 or diverged)
            if diverged:
                return

    def global_norm(self, grad) -> float:
        """L2 norm of the whole gradient: every server's squared norm of its piece, all-reduced over
        the servers (a few bytes; the servers are the only ranks that hold the averaged gradient)."""
        norm_sq = np.array([float((grad * grad).sum())])
        label = "metric: squared gradient norm over the servers"
        return float(self.servers_group.all_reduce(norm_sq, label=label)[0]) ** 0.5

    # ---- asynchronous ----------------------------------------------------------------------------

    def run_async(self, staleness: int) -> None:
        """Apply each worker's gradient as it arrives, until W * steps updates (the synchronous run's
        amount of gradient work). A fast worker may do more steps than a slow one. Each push is
        answered with fresh parameters, held back while its worker would run more than
        ``staleness`` steps ahead of the slowest; the answer to a push past the budget says stop."""
        n, W, trace = self.shard.size, len(self.workers), self.group.trace
        budget = W * self.cfg.steps
        clock = {rank: 0 for rank in self.workers}  # steps each worker has pushed
        active = set(self.workers)  # workers that have not stopped
        headers = {rank: np.empty(2, dtype=np.int64) for rank in self.workers}
        posted = {rank: self.group.irecv(headers[rank], rank, PUSH_HEADER, label=PUSH_LABELS[0])
                  for rank in self.workers}
        held: list[int] = []  # workers whose next parameters are held back
        diverged = False  # a push's loss was NaN or inf: the run ends as if the budget were spent
        self.send_params(self.workers)
        while active:
            with trace.record("wait any gradient", kind="wait"):
                rank = wait_any(self.group, posted, "wait for a push")
            posted.pop(rank).wait()
            step, version = (int(v) for v in headers[rank])
            if step == DONE:  # another server told this worker to stop
                active.discard(rank)
            else:
                payload = self.recv_push(rank)
                self.staleness.append(self.version - version)
                lr = self.apply(payload[:n] / W, self.version // W)  # schedule: updates / W = steps so far
                clock[rank] += 1
                diverged = diverged or not math.isfinite(payload[n])
                if self.history is not None:
                    self.history.append({"step": step, "loss": float(payload[n]), "lr": lr, "worker": rank,
                                         "update": self.version, "staleness": self.staleness[-1],
                                         "time": time.perf_counter() - self.t0})
                if self.version >= budget or diverged:
                    active.discard(rank)
                    self.send_params([rank], stop=True)
                else:
                    posted[rank] = self.group.irecv(headers[rank], rank, PUSH_HEADER, label=PUSH_LABELS[0])
                    held.append(rank)
            slowest = min((clock[r] for r in active), default=0)
            free = [r for r in held if clock[r] - slowest <= staleness]
            held = [r for r in held if r not in free]
            self.send_params(free)

    # ---- the end ---------------------------------------------------------------------------------

    def gather_to_first(self, layout):
        """Every server sends its shard to server 0 (world rank 0), which returns the whole flat
        vector (total,); other servers return None."""
        if self.server != 0:
            self.group.send(self.shard, 0, GATHER, label=GATHER_LABEL)
            return None
        flat = np.empty(layout.total, self.shard.dtype)
        for j, (lo, hi) in enumerate(layout.bounds):
            if j == 0:
                flat[lo:hi] = self.shard
            else:
                self.group.recv(flat[lo:hi], j, GATHER, label=GATHER_LABEL)
        return flat
