"""One prediction: everything the planner says about a model, a run and a machine, as one dict.

    from minidist.plan import predict, preset, RunSpec
    p = predict(preset("llama3-70b"), RunSpec(seq=8192, dp=16, tp=8, pp=8, zero=1, micro_batches=16,
                                              sequence_parallel=True, recompute="selective"), "h100")
    p["per_rank_bytes"]["total"] / 2**30, p["step_time_s"], p["mfu"]

The keys (``python -m minidist.plan --json`` prints them): ``parameters``; ``per_rank_bytes`` of the
pipeline rank with the most (parameters, gradients, master_weights, optimizer_states, activations,
buffers, total, and under offload host and disk); ``per_pp_rank`` (the same for every pipeline
rank); ``activation_bytes_per_layer`` (one micro-batch, one rank) and its ``activation_terms``;
``bubble`` (idle share of the pipeline); ``comm_bytes_per_step`` per axis (pipeline rank 0);
``step_time_s`` and its ``time_breakdown``; ``tokens_per_s``; ``mfu``; ``fits`` the device's memory
and ``problems`` (why the layout cannot run, if it cannot).
"""
from __future__ import annotations

import dataclasses

from minidist.plan import comm, memory, timing
from minidist.plan.calibrate import calibrate
from minidist.plan.hardware import PROFILES, Hardware
from minidist.plan.layout import RunSpec, layout_problems
from minidist.plan.models import ModelSpec, parameter_count


def hardware_profile(name: str, model: ModelSpec | None = None, run: RunSpec | None = None) -> Hardware:
    """The profile called ``name``: "h100", "a100", or "local" (measured now, at ``model``'s and
    ``run``'s matmul shape when given)."""
    if name == "local":
        return calibrate(model, run)
    if name not in PROFILES:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join(PROFILES)}, local")
    return PROFILES[name]


def predict(model: ModelSpec, run: RunSpec, hardware: str | Hardware = "h100") -> dict:
    """The planner's prediction for ``model`` trained as ``run`` on ``hardware`` (module docstring).
    A layout that cannot run returns its ``problems`` and nothing else."""
    problems = layout_problems(model, run)
    base = {"model": dataclasses.asdict(model), "run": dataclasses.asdict(run), "parameters": parameter_count(model),
            "problems": problems}
    if problems:
        return base
    hw = hardware_profile(hardware, model, run) if isinstance(hardware, str) else hardware
    per_pp_rank = memory.per_rank_bytes(model, run)
    worst = max(per_pp_rank, key=lambda row: row["total"])
    time = timing.step_time(model, run, hw)
    tokens = run.global_batch * run.seq
    model_flops = timing.model_flops_per_token(model, run.seq) * tokens / run.world
    return {**base, "hardware": hw.name, "hardware_note": hw.note,
            "per_rank_bytes": worst, "per_pp_rank": per_pp_rank,
            "activation_bytes_per_layer": memory.activation_bytes_per_layer(model, run),
            "activation_terms": dict(memory.layer_activation_terms(model, run)),
            "bubble": time["bubble_share"], "comm_bytes_per_step": comm.comm_bytes_per_step(model, run),
            "step_time_s": time["total"], "time_breakdown": time, "tokens_per_s": tokens / time["total"],
            "mfu": model_flops / time["total"] / hw.flops,
            "fits": worst["total"] <= hw.memory_bytes, "memory_bytes": hw.memory_bytes}
