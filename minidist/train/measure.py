"""The other side of the planner: a minidist run's bytes and traffic, measured, for the same questions.

It lives with the trainer (it runs the trainer's model and state) so that the planner imports
nothing of the trainer: the trainer asks the planner (train/memory.py), never the other way.

:func:`measure` trains a layout of minidist's own GPT for a few steps on threads (one rank each) and
returns per rank what the planner predicts: the model states held after backward (from the live
arrays), the activations one micro-batch's graph keeps (without a pipeline: with one, the schedule's
in-flight count is the simulator's, which tests/test_pipeline_engine.py checks against the engine),
and the bytes sent per mesh axis in the last step (from the trace, ``accounting.sent_bytes``). The
planner reads the same run through ``plan.layout.run_spec_of``; tests/test_plan_validation.py holds the two
side by side.
"""
from __future__ import annotations

import time

import numpy as np

from minidist.comm.launch import run_local
from minidist.inspect.accounting import activation_bytes, sent_bytes
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.step import train_step
from minidist.train.build import build_parallel
from minidist.train.config import check_config


def _held(state) -> dict:
    """Model-state bytes in the planner's keys (parallel/state.py's held_bytes): the optimizer's bytes
    split into float32 masters and moments."""
    held = state.held_bytes()
    masters = state.master_bytes()
    held["master_weights"], held["optimizer_states"] = masters, held.pop("optimizer") - masters
    return held


def measure(cfg, steps: int = 2, seed: int = 0) -> list[dict]:
    """Train ``cfg`` (a TrainConfig) ``steps`` steps on random tokens, one thread per rank; per rank
    (in rank order) a dict: ``coords`` (dp, pp, cp, tp), ``model_states`` after the last backward,
    ``activations`` of one micro-batch's forward (None under pipeline parallelism),
    ``comm_bytes_per_step`` of the last step per axis, ``step_time_s`` of the last step (threads
    share one interpreter: a time to read with care)."""
    check_config(cfg, cfg.world)
    batch_all = np.random.default_rng(seed).integers(0, 256, (cfg.batch_size, cfg.block_size + 1))

    def rank(world):
        mesh = DeviceMesh.of(world, cfg)
        model, state, engine = build_parallel(cfg, mesh)
        rows = cfg.batch_size // cfg.dp
        batch = batch_all[mesh.dp_rank * rows:(mesh.dp_rank + 1) * rows]  # (B/dp, T+1)
        groups = [world, mesh.dp_group, mesh.tp_group, mesh.pp_group, mesh.cp_group, mesh.dp_cp_group,
                  mesh.ep_group, mesh.expert_dp_group, getattr(engine, "embedding_group", None)]
        sizes = {g.name: g.size for g in groups if g is not None}
        for _ in range(steps):
            world.barrier(label="setup: a common start for the step's timing")
            start = time.perf_counter()
            with world.trace.capture() as events:
                train_step(model, state, batch, 1e-3, 1.0, engine=engine, mesh=mesh, n_micro=cfg.micro_batches,
                           trace=world.trace)
            seconds = time.perf_counter() - start
        held = _held(state)
        acts = None
        if cfg.pp == 1:
            one = batch[:rows // cfg.micro_batches]  # one micro-batch (b, T+1)
            _, loss = model(np.ascontiguousarray(one[:, :-1]), np.ascontiguousarray(one[:, 1:]))  # own buffers
            acts = activation_bytes(loss, exclude=[p.data for p in model.parameters()])
        state.close()
        return {"coords": (mesh.dp_rank, mesh.pp_rank, mesh.cp_rank, mesh.tp_rank), "model_states": held,
                "activations": acts, "comm_bytes_per_step": sent_bytes(events, sizes), "step_time_s": seconds}

    return run_local(rank, cfg.world)
