"""``--search``: every layout of N devices that fits, ranked by predicted step time, and why the rest fail.

The candidates: tp a power of two up to a node's devices (Megatron keeps tp inside NVLink), with
sequence parallelism; pp any divisor the layers allow, 1F1B, and interleaved with 2 chunks where the
micro-batches allow; cp 1, 2, 4 or 8 where the sequence splits; dp what is left; every ZeRO stage;
recompute none, selective or full; ep the divisors of dp that divide the experts, for an MoE. The
global batch (sequences) and the micro-batch size stay fixed, so dp decides the micro-batches:
m = global batch / (dp x micro-batch size), which must be a whole number.
"""
from __future__ import annotations

import dataclasses
import itertools

from tqdm import tqdm

from minidist.plan.hardware import GIB, Hardware
from minidist.plan.layout import RunSpec, layout_problems
from minidist.plan.models import ModelSpec
from minidist.plan.memory import per_rank_bytes
from minidist.plan.predict import predict


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(model: ModelSpec, gpus: int, base: RunSpec, global_batch: int, hw: Hardware):
    """Every RunSpec of the module docstring, with ``base``'s dtype, optimizer, sequence and micro-batch size."""
    tps = [t for t in (1, 2, 4, 8, 16, 32) if t <= min(gpus, hw.devices_per_node) and gpus % t == 0]
    for tp, cp in itertools.product(tps, (1, 2, 4, 8)):
        if gpus % (tp * cp):
            continue
        for pp in divisors(gpus // (tp * cp)):
            dp = gpus // (tp * cp * pp)
            if pp > model.n_layer or global_batch % (dp * base.micro_batch_size):
                continue
            m = global_batch // (dp * base.micro_batch_size)
            schedules = [("1f1b", 1)] + ([("interleaved", 2)] if pp > 1 and m % pp == 0 else [])
            eps = [e for e in divisors(dp) if model.n_experts and model.n_experts % e == 0] or [1]
            for (schedule, v), zero, recompute, ep in itertools.product(schedules, range(4), ("none", "selective", "full"), eps):
                yield dataclasses.replace(base, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, micro_batches=m, zero=zero,
                                          recompute=recompute, schedule=schedule, virtual_stages=v,
                                          sequence_parallel=tp > 1)


def why_not(held: dict, memory_bytes: float) -> str:
    """Why a rank's bytes ``held`` do not fit: its largest part and the total against the memory
    ("activations 92.0 GiB of 110.3 GiB > 80")."""
    parts = {k: v for k, v in held.items() if k not in ("total", "host", "disk")}
    largest = max(parts, key=parts.get)
    return f"{largest} {parts[largest] / GIB:.1f} GiB of {held['total'] / GIB:.1f} GiB > {memory_bytes / GIB:.0f}"


def search(model: ModelSpec, gpus: int, hw: Hardware, base: RunSpec, global_batch: int,
           memory_bytes: float | None = None, progress: bool = False) -> tuple[list[dict], list[tuple[RunSpec, str]]]:
    """(the predictions of every layout that fits ``memory_bytes`` (default: the device's), fastest
    first; every rejected layout with its reason). ``progress``: a bar on a terminal's stderr."""
    limit = memory_bytes if memory_bytes is not None else hw.memory_bytes
    fits, rejected = [], []
    runs = list(candidates(model, gpus, base, global_batch, hw))
    for run in tqdm(runs, desc="layouts", unit="", disable=None if progress else True, leave=False):
        problems = layout_problems(model, run)
        if problems:
            rejected.append((run, problems[0]))
            continue
        held = max(per_rank_bytes(model, run), key=lambda row: row["total"])  # memory first: it is cheap
        if held["total"] > limit:
            rejected.append((run, why_not(held, limit)))
        else:
            fits.append(predict(model, run, hw))
    fits.sort(key=lambda p: p["step_time_s"])
    return fits, rejected
