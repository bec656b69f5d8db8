"""``python -m minidist.train --mode ps``: the same model, data and outputs as the collective
trainer, trained by parameter servers (minidist/parallel/ps/param_server.py) instead of all-reduce.
"""
import math

import numpy as np

from minidist.parallel.whole_model.consolidate import consolidated_state_dict
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.ps.param_server import train_parameter_server
from minidist.train.build import build_model, world_of_one
from minidist.train.life import started
from minidist.train.divergence import Diverged
from minidist.train.outputs import estimate_val_loss, export, metrics_line, open_metrics


def train_ps(cfg, world, memory_bytes=None):
    """``--mode ps``: train with parameter servers (minidist/parallel/ps/param_server.py) on ``world``.
    Returns (model, history); on rank 0 the model holds the final weights and history one row per
    step (synchronous) or per applied update (asynchronous: with worker and staleness), the last
    row with val_loss; rank 0 writes ``cfg.out`` and ``cfg.export``. A run that diverged (the servers
    stop at its first NaN or inf loss or gradient norm) raises :class:`Diverged` on rank 0 once its
    metrics are written, and exports nothing."""
    cfg, corpus = started(cfg, world.size, memory_bytes)  # a run's start: every check once (train/life.py)
    model = build_model(cfg)
    history = train_parameter_server(world, model, cfg, corpus.train, servers=cfg.servers,
                                     staleness=None if cfg.staleness < 0 else cfg.staleness, straggler=cfg.straggler)
    if world.rank == 0:
        history[-1]["val_loss"] = estimate_val_loss(model, corpus.val, cfg)
        with open_metrics(cfg.out) as metrics_file:
            for record in history if metrics_file is not None else []:
                metrics_file.write(metrics_line(record))
        check_finite(history, model)
        if cfg.export is not None:  # the whole model is on rank 0: a mesh of one consolidates it
            export(consolidated_state_dict(model, DeviceMesh(world_of_one(), dp=1, pp=1, tp=1)), cfg.export, model.config)
    return model, history


def check_finite(history: list[dict], model) -> None:
    """:class:`Diverged` naming the first row of ``history`` whose loss or gradient norm is NaN or inf,
    or if the final weights of ``model`` hold one. Sends nothing."""
    for row in history:
        if not all(math.isfinite(row[k]) for k in ("loss", "grad_norm") if k in row):
            norm = f", grad norm {row['grad_norm']}" if "grad_norm" in row else ""
            raise Diverged(f"the run diverged at step {row['step']} (loss {row['loss']}{norm}): the parameter "
                           "servers stopped there, and nothing is exported (lower --lr, or add --warmup or --grad-clip)")
    if not all(np.isfinite(p.data).all() for p in model.parameters()):
        raise Diverged("the run diverged: its final weights hold NaN or inf, and nothing is exported (lower --lr, "
                       "or add --warmup or --grad-clip)")
