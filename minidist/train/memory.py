"""Whether a run fits in memory: a lower bound on what one rank holds, from its configuration alone.

Nothing is built and nothing is sent: every rank reaches the same verdict from the config and the
memory its entry point read (:func:`memory_available`), before the first allocation that grows with
the model, so a run that cannot fit ends with exit status 2 and the estimate instead of a
MemoryError or the kernel's OOM killer. The bound is the planner's accounting (minidist/plan/: a
block's elements ``block_numel``, one layer's activations ``activation_bytes_per_layer``, the head's
``head_activation_bytes``) with the ZeRO paper's split of the model states
(minidist/inspect/accounting.py ``zero_formula``, ``offload_formula``) and the bytes-per-parameter
table (minidist/optim/state_bytes.py), taken by kind of block, so it costs the same for 2 blocks or
10**9. Of two moments, the larger:

    building   every rank builds the whole GPT on the host before cutting its part (train/build.py):
               every parameter, in the model's dtype
    training   this rank's share of parameters, gradients and optimizer state (at least 1/(tp pp) of
               the model; ZeRO's stage divides by the dp x cp ranks; offloaded to the disk: not
               counted; on a GPU only what stays on the host), one micro-batch's activations (at
               least 1/pp of the blocks' and the head's), and the step's batch (every rank draws all
               B window starts and reads its B/dp windows of T+1 tokens as int64)

A lower bound: a run refused cannot fit; one accepted may still not (``python -m minidist.plan``
gives the exact figure per rank). Without a memory size the limit is int64's: no NumPy size or byte
count may reach 2**63.
"""
from __future__ import annotations

import os
import resource

from minidist.inspect.accounting import offload_formula, zero_formula
from minidist.optim.state_bytes import ITEMSIZE, optimizer_bytes_per_parameter
from minidist.parallel.tensor.layout import padded_vocab_size
from minidist.plan.memory import activation_bytes_per_layer, head_activation_bytes
from minidist.plan.layout import run_spec_of
from minidist.plan.models import block_numel, from_gpt_config
from minidist.plan.report import human

INT64 = 2 ** 63  # NumPy's sizes, indices and shape products are int64


def memory_available() -> int:
    """Bytes this process may use: the machine's physical memory, or less where the address-space
    limit (``ulimit -v``) leaves less beyond what the process maps already. Read by the entry point
    (``python -m minidist.train``) and passed in; library code never asks the machine."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return physical
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    return max(0, min(physical, limit - mapped))


def block_kinds(model) -> tuple:
    """((how many, the index of one), ...) of ``model``'s dense blocks and expert blocks: what is
    counted per block is counted once per kind."""
    moe = model.n_layer // model.moe_every if model.n_experts else 0
    return tuple((n, layer) for n, layer in ((model.n_layer - moe, 0), (moe, model.moe_every - 1)) if n)


def model_elements(model, t: int = 1, ep: int = 1) -> int:
    """Parameters of ``model`` (the planner's ModelSpec of minidist's GPT: tied head, learned
    positions, LayerNorms with biases unless ``--no-bias``) on one tp rank of ``t`` holding 1/ep of the
    experts, counted by kind of block (dense, experts); with t = ep = 1, ``minidist.plan.models.parameter_count``."""
    blocks = sum(n * sum(block_numel(model, t, layer, ep).values()) for n, layer in block_kinds(model))
    C = model.n_embd
    ln_f = C * (2 if model.bias else 1)
    return padded_vocab_size(model.vocab_size, t) // t * C + model.block_size * C + ln_f + blocks


def rank_bytes(cfg) -> dict:
    """A lower bound on the bytes the busiest rank of ``cfg``'s run holds (module docstring): the
    whole model while building (``build``) and, while training, ``parameters``, ``gradients``,
    ``optimizer`` (masters and moments), ``host`` (offloaded), ``activations`` and ``batch``. Reads
    ``cfg`` only, whose layout must be valid (``minidist.parallel.spec.problems`` empty)."""
    model, run = from_gpt_config(cfg), run_spec_of(cfg)
    itemsize, replicas = ITEMSIZE[cfg.dtype], cfg.dp * cfg.cp
    share = model_elements(model, cfg.tp, cfg.ep) / cfg.pp  # the busiest pp rank holds at least the average
    k = optimizer_bytes_per_parameter(cfg.optimizer, cfg.dtype, run.mixed)
    states = zero_formula(cfg.zero, share * itemsize, share * k, replicas)
    if cfg.offload != "none":
        states = offload_formula(states, share * itemsize / (replicas if cfg.zero else 1), run.offload_to,
                                 params=cfg.offload == "optimizer,params", master_copy=not run.mixed)
        states.pop("disk")
    if cfg.device != "cpu":  # the model states and activations live on the GPU: only the host's part counts here
        states = {"host": states.get("host", 0)}
    activations = (sum(n * activation_bytes_per_layer(model, run, layer) for n, layer in block_kinds(model))
                   + head_activation_bytes(model, run)) / cfg.pp
    batch = 8 * cfg.batch_size + 8 * cfg.batch_size // cfg.dp * (cfg.block_size + 1)  # starts (B,), rows (B/dp, T+1)
    return {"build": model_elements(model) * itemsize, **states,
            "activations": activations if cfg.device == "cpu" else 0, "batch": batch}


def _size(nbytes: float) -> str:
    """``human`` with TiB, and past 2**60 bytes in powers of ten."""
    if nbytes >= 2 ** 60:
        return f"{nbytes:.3g} bytes"
    return f"{nbytes / 2 ** 40:.1f} TiB" if nbytes >= 2 ** 40 else human(nbytes)


def memory_problems(cfg, memory_bytes: int | None = None) -> list[str]:
    """Why ``cfg``'s run cannot fit in ``memory_bytes`` (None: in int64's sizes), one line naming the
    estimate, its parts and the memory (empty: it may fit). ``cfg``'s numbers and layout must be
    valid."""
    held = rank_bytes(cfg)
    training = sum(v for k, v in held.items() if k != "build")
    need = max(held["build"], training)
    limit = INT64 if memory_bytes is None else memory_bytes
    if need <= limit:
        return []
    parts = ", ".join(f"{k} {_size(v)}" for k, v in held.items() if k != "build" and v)
    where = ("more than 2**63 bytes: no NumPy array or shape product can count that far" if memory_bytes is None
             else f"more than the {_size(memory_bytes)} of memory available here")
    return [f"the run needs at least {_size(need)} on one rank (building: the whole GPT, {_size(held['build'])}; "
            f"training: {parts}), {where}: use a smaller model (--n-layer, --n-embd, --n-experts) or batch "
            f"(--batch-size, --block-size), or cut it over more ranks (--tp, --pp, --zero)"]
