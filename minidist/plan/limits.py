"""The planner's bounds: the range of every number it takes, and how much work one plan may be.

The layout's numbers (the mesh, micro-batches, virtual stages, ZeRO, the model's blocks, heads, width
and experts) have their ranges in :data:`minidist.parallel.spec.RANGES`, which the trainer checks
too. The planner's own numbers have theirs in :data:`RANGES` (an interval each, as the trainer's:
nan lies in none, and an open end at inf refuses inf), and every count it takes is at most
:data:`LARGEST`, so that the products it forms (bytes, FLOPs, seconds) stay finite floats.

The work of one plan is bounded before any of it is done, each bound named in the refusal:
- the blocks: memory and time walk the model block by block, O(n_layer): at most :data:`MAX_BLOCKS`;
- the stages: blocks are balanced over pp x virtual stages by dynamic programming
  (``minidist.parallel.pipeline.partition``, O(stages x n_layer^2)): at most :data:`MAX_PARTITION_STEPS`;
- the schedule: a pipeline's schedule is built and simulated action by action, O(pp x virtual
  stages x micro-batches) (more for the zero-bubble ones): at most :data:`MAX_SCHEDULE_ACTIONS`.
Each bound costs a few seconds at most on one core; the search adds its own (``search.py``).
"""
from __future__ import annotations

from minidist.parallel.spec import RANGES as LAYOUT_RANGES, flag, in_interval, out_of_range

LARGEST = 10**12  # the largest count the planner takes
MAX_BLOCKS = 100_000
MAX_PARTITION_STEPS = 2**21  # every stage count for models of up to 128 blocks
MAX_SCHEDULE_ACTIONS = 4096  # e.g. pp 16 x 2 virtual stages x 128 micro-batches
TOO_LONG = "larger than the planner simulates"  # the words of that refusal (a search counts them as one reason)
RANGES = {  # the planner's own numbers (those of the layout: minidist.parallel.spec.RANGES)
    "vocab": "[1, 1e12]", "n_kv_head": "[1, 1e12]", "ffn": "[1, 1e12]", "block_size": "[1, 1e12]",
    "seq": "[1, 1e12]", "micro_batch_size": "[1, 1e12]",
    "gpus": "[1, 1e6]", "memory_gib": "(0, inf)", "global_batch_size": "[1, 1e12]", "top": "[0, inf)",
}


def own_numbers(model, run) -> dict:
    """The numbers of ``model`` and ``run`` that only the planner takes, by the name of their flag
    (None: not given, the model's default)."""
    return {"vocab": model.vocab_size, "n_kv_head": model.n_kv_head, "ffn": model.ffn,
            "block_size": model.block_size, "seq": run.seq, "micro_batch_size": run.micro_batch_size}


def flag_problems(values: dict) -> list[str]:
    """Every number of ``values`` ({flag name: value}; None: not given) outside its interval in :data:`RANGES`."""
    return [text for name, value in values.items() if value is not None
            for text in out_of_range(name, value, RANGES[name])]


def own_number_problems(model, run) -> list[str]:
    """The planner's own numbers of ``model`` and ``run`` outside their ranges, and the layout's
    numbers in their own ranges (``spec.RANGES``: checked there) but above :data:`LARGEST`."""
    found = flag_problems(own_numbers(model, run))
    layout = {**{name: getattr(model, name) for name in ("n_layer", "n_head", "n_embd", "n_experts", "top_k", "moe_every")},
              **{name: getattr(run, name) for name in ("dp", "tp", "pp", "cp", "ep", "micro_batches", "virtual_stages")}}
    found += [f"{flag(name)} {value} is more than the planner takes (at most {LARGEST:.0e})"
              for name, value in layout.items() if in_interval(value, LAYOUT_RANGES[name]) and value > LARGEST]
    return found


def count(n: int) -> str:
    """``n`` in words a user reads: 8,192 or 1e+15."""
    return f"{n:,}" if n < 10**9 else f"{n:.3g}"


def partition_steps(n_layer: int, n_stages: int) -> int:
    """Steps of balancing ``n_layer`` blocks over ``n_stages`` stages (none for one stage)."""
    return n_stages * n_layer**2 if n_stages > 1 else 0


def schedule_actions(pp: int, virtual_stages: int, micro_batches: int) -> int:
    """(stage, micro-batch) pairs a pipeline schedule simulates (none without a pipeline)."""
    return pp * virtual_stages * micro_batches if pp > 1 else 0


def work_problems(model, run) -> list[str]:
    """What of ``model`` trained as ``run`` is more work than the planner does (module docstring);
    for numbers already in their ranges."""
    found = []
    if model.n_layer > MAX_BLOCKS:
        found.append(f"--n-layer {model.n_layer}: the planner walks the blocks one by one, at most {MAX_BLOCKS:,}")
    steps = partition_steps(model.n_layer, run.n_stages)
    if steps > MAX_PARTITION_STEPS:
        found.append(f"balancing {model.n_layer} blocks over pp x virtual stages = {run.n_stages} stages takes "
                     f"stages x blocks^2 = {count(steps)} steps, over the planner's {MAX_PARTITION_STEPS:,}: plan fewer "
                     f"blocks or stages")
    actions = schedule_actions(run.pp, run.virtual_stages, run.micro_batches)
    if actions > MAX_SCHEDULE_ACTIONS:
        found.append(f"the {run.schedule} schedule of pp {run.pp} x {run.virtual_stages} virtual stages x "
                     f"{run.micro_batches} micro-batches = {count(actions)} (stage, micro-batch) pairs is {TOO_LONG} "
                     f"({MAX_SCHEDULE_ACTIONS:,}): use fewer micro-batches (a larger "
                     f"--micro-batch-size) or a shorter pipeline")
    return found
