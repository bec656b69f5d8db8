"""``--search``: every layout of N devices that fits, ranked by predicted step time, and why the rest fail.

The candidates: tp a power of two up to a node's devices (Megatron keeps tp inside NVLink), with
sequence parallelism; pp any divisor the layers allow, 1F1B, and interleaved with 2 chunks where the
micro-batches allow; cp 1, 2, 4 or 8 where the sequence splits; dp what is left; every ZeRO stage;
recompute none, selective or full; ep the divisors of dp that divide the experts, for an MoE. The
global batch (sequences) and the micro-batch size stay fixed, so dp decides the micro-batches:
m = global batch / (dp x micro-batch size), which must be a whole number.

A search is sized before it starts (:func:`estimate`: its candidates, the schedules it simulates,
the stage counts it balances) and refused when it would take more than :data:`SEARCH_SECONDS`; a
candidate over a plan's own bounds (``limits.py``: a schedule too long to simulate) is rejected
with that reason, like any other.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

from tqdm import tqdm

from minidist.plan.hardware import GIB, Hardware
from minidist.parallel.layout import RECOMPUTE
from minidist.plan.layout import RunSpec, layout_problems
from minidist.plan.limits import MAX_PARTITION_STEPS, MAX_SCHEDULE_ACTIONS, partition_steps, schedule_actions
from minidist.plan.models import ModelSpec
from minidist.plan.memory import per_rank_bytes
from minidist.plan.predict import predict

SEARCH_SECONDS = 60  # a search estimated to take longer is refused before it starts
COSTS = {  # seconds of the search's work, measured on a shared 2-core machine (an idle one takes less)
    "candidate": 1e-3, "block": 4e-5, "action": 4e-4, "partition step": 2e-6,
}


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1, ascending (found up to its square root)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def shapes(model: ModelSpec, gpus: int, base: RunSpec, global_batch: int, hw: Hardware):
    """(tp, cp, pp, dp, m, [(schedule, virtual stages)], [ep]) of every mesh the search tries (the
    module docstring): each times every ZeRO stage and recompute is a candidate."""
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
            yield tp, cp, pp, dp, m, schedules, eps


def candidates(model: ModelSpec, gpus: int, base: RunSpec, global_batch: int, hw: Hardware):
    """Every RunSpec of the module docstring, with ``base``'s dtype, optimizer, sequence and micro-batch size."""
    for tp, cp, pp, dp, m, schedules, eps in shapes(model, gpus, base, global_batch, hw):
        for (schedule, v), zero, recompute, ep in itertools.product(schedules, range(4), RECOMPUTE, eps):
            yield dataclasses.replace(base, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, micro_batches=m, zero=zero,
                                      recompute=recompute, schedule=schedule, virtual_stages=v,
                                      sequence_parallel=tp > 1)


def estimate(model: ModelSpec, gpus: int, hw: Hardware, base: RunSpec, global_batch: int) -> tuple[int, float]:
    """(the candidates :func:`search` would try, the seconds it would take on one core), counted before
    it starts (:data:`COSTS`): per candidate its checks and its walk over the blocks, once per
    schedule shape its simulation, once per stage count the blocks' balance; work over a plan's
    bounds (``limits.py``) is refused, not done."""
    count, seconds, simulated, balanced = 0, 0.0, set(), set()
    for tp, cp, pp, dp, m, schedules, eps in shapes(model, gpus, base, global_batch, hw):
        for schedule, v in schedules:
            n = 4 * len(RECOMPUTE) * len(eps)  # ZeRO stages x recompute x ep
            actions, steps = schedule_actions(pp, v, m), partition_steps(model.n_layer, pp * v)
            within = actions <= MAX_SCHEDULE_ACTIONS and steps <= MAX_PARTITION_STEPS
            count += n
            seconds += n * (COSTS["candidate"] + (COSTS["block"] * model.n_layer if within else 0.0))
            if within and (schedule, pp, v, m) not in simulated:
                simulated.add((schedule, pp, v, m))
                seconds += COSTS["action"] * actions
            if within and pp * v not in balanced:
                balanced.add(pp * v)
                seconds += COSTS["partition step"] * steps
    return count, seconds


def search_problems(model: ModelSpec, gpus: int, hw: Hardware, base: RunSpec, global_batch: int) -> list[str]:
    """Why the search cannot be done in :data:`SEARCH_SECONDS` (empty: it can), found before it starts."""
    count, seconds = estimate(model, gpus, hw, base, global_batch)
    if seconds <= SEARCH_SECONDS:
        return []
    return [f"the search of {count:,} layouts of {gpus} devices would take about {seconds:,.0f} s, over the "
            f"{SEARCH_SECONDS} s the planner allows: search fewer --gpus, a smaller --global-batch-size or a larger "
            f"--micro-batch-size (fewer micro-batches to simulate), or plan one layout without --search"]


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
