"""Parameter-server training: k server ranks keep the parameters, W worker ranks compute gradients.

    mpiexec -n 4 python -m minidist.train --mode ps --servers 1                  # synchronous
    mpiexec -n 4 python -m minidist.train --mode ps --servers 1 --staleness 2    # asynchronous

The older alternative to all-reduce (DistBelief, Li et al.'s parameter server). World ranks 0..k-1
are servers, k..N-1 workers. The flat parameter vector is cut over the servers
(``numpy.array_split``); server j keeps its piece and that piece's optimizer state. Every step each
worker pushes gradient piece j to server j and pulls parameter piece j back, by point-to-point
messages (``ps_protocol``). Per step and per worker that is the whole model out and in; a server
moves W/k models in and W/k out, against the ring all-reduce's 2(N-1)/N models per rank. With one
server, its link carries W times what a ring rank's does: the bottleneck that made the field move
to all-reduce (``benchmarks/param_server.py`` measures it).

Synchronous mode (``staleness=None``) waits for all W gradients, averages, updates once: the same
numbers as one process on the full batch and as all-reduce data parallelism (tests/
test_param_server.py). Asynchronous mode (``staleness=s``) applies each gradient on arrival and
never waits for the slowest worker beyond s steps: faster per step when one worker straggles, at
the price of gradients computed on stale parameters (``ps_server`` explains both loops).
"""
from __future__ import annotations

import time

from minidist.parallel.ps.protocol import FlatLayout
from minidist.parallel.ps.server import ParameterServer
from minidist.parallel.ps.worker import Worker


def train_parameter_server(group, model, cfg, tokens, *, servers: int = 1, staleness: int | None = None,
                           straggler: float = 0.0):
    """Train ``model`` with ``servers`` parameter servers and ``group.size - servers`` workers.

    Every rank of ``group`` calls this with a model built from the same seed (the servers read their
    initial shard from it), the same ``cfg`` (a TrainConfig: steps, batch_size, block_size, seed,
    optimizer, lr, min_lr, warmup, momentum, weight_decay, grad_clip) and the training ``tokens``.
    ``staleness=None`` trains synchronously, an int s >= 0 asynchronously with staleness bound s.
    ``straggler`` seconds of sleep slow down worker 0 every step.

    Returns, on rank 0, the history: one dict per step in synchronous mode (step, loss, lr,
    grad_norm, time) or per applied update in asynchronous mode (step, loss, lr, worker, update,
    staleness, time), ``time`` in seconds since the start; None on other ranks. On return rank 0's
    model holds the final weights (gathered from the servers) and each worker's the last it pulled.
    """
    check_parameter_server(group.size, servers, staleness, straggler, cfg.batch_size)
    workers = group.size - servers
    layout = FlatLayout(model, servers)
    servers_group = group.split(0 if group.rank < servers else -1, name="servers")
    group.barrier(label="setup: a common start for the wall-clock times")
    t0 = time.perf_counter()
    if group.rank >= servers:
        delay = straggler if group.rank == servers else 0.0
        Worker(group, model, layout, cfg, servers, workers, delay).run(tokens, asynchronous=staleness is not None)
        return None
    history = [] if group.rank == 0 else None
    server = ParameterServer(group, servers_group, layout, cfg, workers, history, t0)
    if staleness is None:
        server.run_sync()
    else:
        server.run_async(staleness)
    flat = server.gather_to_first(layout)
    if flat is not None:
        layout.load(flat)
    return history


def check_parameter_server(world_size: int, servers: int, staleness, straggler: float, batch_size: int) -> None:
    """Raise ValueError (the same on every rank, before any message) for a layout that cannot run."""
    if not isinstance(servers, int) or not 1 <= servers < world_size:
        raise ValueError(f"--servers must be an int in 1..{world_size - 1} (world size {world_size}: at least one "
                         f"rank must be left as a worker), got {servers!r}")
    if staleness is not None and (not isinstance(staleness, int) or staleness < 0):
        raise ValueError(f"--staleness must be an int >= 0 (or absent for synchronous), got {staleness!r}")
    if not straggler >= 0:
        raise ValueError(f"--straggler must be >= 0 seconds, got {straggler!r}")
    workers = world_size - servers
    if batch_size % workers:
        raise ValueError(f"batch size {batch_size} must be divisible by the {workers} workers "
                         f"(world size {world_size} - {servers} servers)")


def staleness_bound(workers: int, staleness: int) -> int:
    """The largest possible staleness of an update in asynchronous mode with bound ``staleness`` = s.

    Worker w gets its parameters for step c only once every worker has pushed >= c - s steps, and no
    worker u can start a step beyond (slowest + s) <= c + s while w has not pushed step c, so u
    pushes at most steps c - s .. c + s between w's pull and w's push: 2s + 1 updates, from each of
    the other W - 1 workers. Hence (W - 1)(2s + 1); with s = 0, W - 1."""
    return (workers - 1) * (2 * staleness + 1)
