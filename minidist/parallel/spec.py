"""What is wrong with a layout: :func:`problems`, the one place each layout rule lives.

The trainer (``minidist.train.config.check_config``), the planner (``minidist.plan.layout.layout_problems``)
and the support matrix (``minidist.train.support_matrix.meaningless``) all ask :func:`problems`, so
they cannot disagree: what one refuses the others refuse, in the same words. A layout is one
:class:`~minidist.parallel.layout.Layout` (the mesh, how each axis cuts, ZeRO and offload, recompute,
the precision, the device and backend); :class:`Needs` is what the rules need of the model (blocks,
heads, width, experts) and the batch (tokens per sequence, sequences per step).

Every problem is one line a user reads, naming the flags (the trainer's and the planner's share
them) and what to do instead, and all of them come at once: names and numbers first, then, when the
numbers are in range (the rules divide by them), the arithmetic of the layout. Some problems say the
layout names something it does not have (sequence parallelism with tp 1, a schedule with pp 1, a cp
algorithm with cp 1, expert parallelism with dp 1, offloaded parameters below ZeRO-3): :func:`lacks`
gives their general reason, which the support matrix counts as a meaningless cell.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace

from minidist.device import DEVICES
from minidist.optim.state_bytes import ITEMSIZE
from minidist.parallel.context.context_parallel import ALGORITHMS, tokens_multiple
from minidist.parallel.layout import RECOMPUTE, Layout, layout_fields
from minidist.parallel.pipeline.schedules import SCHEDULES
from minidist.parallel.zero.offload import CHOICES as OFFLOADS

BACKENDS = ("ring", "mpi", "nccl")
NAMES = {"cp_algorithm": ALGORITHMS, "schedule": SCHEDULES, "offload": OFFLOADS, "dtype": tuple(ITEMSIZE),
         "device": DEVICES, "backend": BACKENDS, "recompute": RECOMPUTE}  # the values each named choice may take
DEFAULT_SCHEDULE, DEFAULT_CP_ALGORITHM = "1f1b", "ring"  # what a layout without pp (cp) runs: the same run
RANGES = {  # the interval each number may take ("[" and "]" include the bound; nan is in none)
    "dp": "[1, inf)", "tp": "[1, inf)", "pp": "[1, inf)", "cp": "[1, inf)", "ep": "[1, inf)",
    "micro_batches": "[1, inf)", "virtual_stages": "[1, inf)", "zero": "[0, 3]",
    "n_layer": "[1, inf)", "n_head": "[1, inf)", "n_embd": "[1, inf)", "n_experts": "[0, inf)", "top_k": "[1, inf)",
    "moe_every": "[1, inf)",
}


@dataclass(frozen=True)
class Needs:
    """What the layout rules need of the model and the batch. ``seq``: tokens per sequence (the
    trainer's --block-size, the planner's --seq); ``batch_size``: sequences per step over all dp ranks.
    ``kv_heads`` / ``mlp_width`` None: GPT-2's (n_head; 4 n_embd), which tp cuts wherever it cuts the
    heads."""
    n_layer: int
    n_head: int
    n_embd: int
    seq: int
    batch_size: int
    kv_heads: int | None = None
    mlp_width: int | None = None
    n_experts: int = 0
    top_k: int = 2
    moe_every: int = 1


def _spec(layout: Layout, needs: Needs, world_size: int | None) -> SimpleNamespace:
    """One namespace the rules below read: the layout's fields and ``world``, what they need of the
    model and batch, and the world they are given (None: as many ranks as the layout needs)."""
    return SimpleNamespace(**layout_fields(layout), world=layout.world, **vars(needs), world_size=world_size)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a layout: ``text`` for the user; ``lacks``, when the layout names something
    it does not have, the general reason (the support matrix's kinds of meaningless cell)."""
    text: str
    lacks: str | None = None


def problems(layout: Layout, needs: Needs, world_size: int | None = None) -> list[str]:
    """Everything wrong with ``layout`` (a :class:`~minidist.parallel.layout.Layout`, or anything that
    is one: a trainer's config, a planner's run) for a model and batch of ``needs`` on ``world_size``
    ranks (None: the layout's own), one line each, all at once (empty: it can run). Reads only its
    arguments, so every rank reaches the same verdict before anything is sent; sends nothing."""
    return [p.text for p in findings(layout, needs, world_size)]


def lacks(layout: Layout, needs: Needs) -> list[str]:
    """Of :func:`problems`, why ``layout`` names something it does not have, in general words (empty:
    it names nothing it lacks)."""
    return [p.lacks for p in findings(layout, needs) if p.lacks is not None]


def numbers_out_of_range(layout: Layout, needs: Needs) -> list[str]:
    """Of :func:`problems`, the numbers outside their intervals in :data:`RANGES` (arithmetic only)."""
    return [p.text for p in range_problems(_spec(layout, needs, None))]


def findings(layout: Layout, needs: Needs, world_size: int | None = None) -> list[Problem]:
    """The :class:`Problem` objects behind :func:`problems`: names, numbers, then (numbers in range)
    the arithmetic of each axis."""
    spec = _spec(layout, needs, world_size)
    numbers = range_problems(spec)
    found = name_problems(spec) + numbers + backend_problems(spec)
    if numbers:
        return found
    return (found + mesh_problems(spec) + sequence_parallel_problems(spec) + context_parallel_problems(spec)
            + expert_problems(spec) + pipeline_problems(spec) + offload_problems(spec))


def flag(name: str) -> str:
    """The command-line flag of field ``name``: ``micro_batches`` -> ``--micro-batches``."""
    return "--" + name.replace("_", "-")


def in_interval(value, interval: str) -> bool:
    """Whether ``value`` lies in ``interval``, e.g. ``"[0, 1)"``; nan lies in none."""
    low, high = bounds(interval)
    above = low <= value if interval[0] == "[" else low < value
    return above and (value <= high if interval[-1] == "]" else value < high)


@lru_cache(maxsize=None)
def bounds(interval: str) -> tuple[float, float]:
    """``"[0, 1)"`` -> (0.0, 1.0)."""
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    return low, high


def in_words(interval: str) -> str:
    """``"(0, inf)"`` -> "positive", ``"[1, inf)"`` -> ">= 1", ``"[0, 1)"`` -> "in [0, 1)"."""
    low, high = interval[1:-1].split(", ")
    if high != "inf":
        return f"in {interval}"
    if interval[0] == "(":
        return "positive" if low == "0" else f"> {low}"
    return f">= {low}"


def out_of_range(name: str, value, interval: str) -> list[str]:
    """``["--name must be <interval in words>, got value"]`` when ``value`` is outside ``interval``."""
    if in_interval(value, interval):
        return []
    finite = " and finite" if value == float("inf") else ""
    return [f"{flag(name)} must be {in_words(interval)}{finite}, got {value}"]


def range_problems(spec) -> list[Problem]:
    """Every number of ``spec`` (a layout with its needs, :func:`_spec`) outside its interval in :data:`RANGES`."""
    return [Problem(text) for name, interval in RANGES.items() if not in_interval(getattr(spec, name), interval)
            for text in out_of_range(name, getattr(spec, name), interval)]


def name_problems(spec) -> list[Problem]:
    """A cp algorithm, schedule, offload, dtype, device or backend minidist does not have."""
    return [Problem(f"{flag(name)} must be one of {', '.join(choices)}, got {getattr(spec, name)!r}")
            for name, choices in NAMES.items() if getattr(spec, name) not in choices]


def backend_problems(spec) -> list[Problem]:
    """What --device and --backend cannot run."""
    found = []
    if spec.backend == "nccl" and spec.device != "cuda":
        found.append(Problem("--backend nccl moves GPU buffers only: it needs --device cuda"))
    if spec.device == "cuda" and spec.backend == "mpi":
        found.append(Problem("--device cuda with --backend mpi is not supported: MPI's own collectives would be "
                             "handed GPU buffers, which only a CUDA-aware MPI reads (use --backend ring, which stages "
                             "them through host memory, or --backend nccl)"))
    return found


def mesh_problems(spec) -> list[Problem]:
    """The world against the mesh, the heads and widths tp cuts, the rows of every micro-batch."""
    found = []
    if spec.world_size is not None and spec.world_size != spec.world:
        axes = [a for a in ("dp", "pp", "cp", "tp") if a in ("dp", "tp") or getattr(spec, a) > 1]
        found.append(Problem(f"world size {spec.world_size} != {' * '.join(axes)} = "
                             f"{' * '.join(str(getattr(spec, a)) for a in axes)} = {spec.world} "
                             f"(start {spec.world} ranks: mpiexec -n {spec.world} ...)"))
    if spec.n_embd % spec.n_head:
        found.append(Problem(f"n_embd {spec.n_embd} is not divisible by n_head {spec.n_head}"))
    if spec.n_head % spec.tp:
        found.append(Problem(f"n_head {spec.n_head} is not divisible by tp {spec.tp} (each tp rank holds whole heads)"))
    if spec.kv_heads is not None and spec.kv_heads % spec.tp and spec.tp % spec.kv_heads:
        found.append(Problem(f"the {spec.kv_heads} kv heads are not divisible by tp {spec.tp}, nor tp by them (each tp "
                             f"rank holds whole kv heads, or a copy of one)"))
    if spec.mlp_width is not None and spec.mlp_width % spec.tp:
        found.append(Problem(f"the MLP width {spec.mlp_width} is not divisible by tp {spec.tp} (each tp rank holds "
                             f"1/tp of the MLP's columns)"))
    if spec.batch_size % (spec.dp * spec.micro_batches):
        found.append(Problem(f"batch_size {spec.batch_size} is not divisible by dp * micro_batches = {spec.dp} * "
                             f"{spec.micro_batches} (every micro-batch of every dp rank has equal rows)"))
    return found


def sequence_parallel_problems(spec) -> list[Problem]:
    """Sequence parallelism splits the sequence over the tp ranks: it needs tp > 1 and a sequence
    that splits."""
    if not spec.sequence_parallel:
        return []
    if spec.tp == 1:
        why = "sequence parallelism splits the sequence over the tp ranks: with tp 1 there is nothing to split"
        return [Problem(f"--sequence-parallel needs --tp > 1 ({why}): add --tp, or drop --sequence-parallel",
                        lacks=why)]
    if spec.seq % spec.tp:
        return [Problem(f"the sequence of {spec.seq} tokens is not divisible by tp {spec.tp} (sequence parallelism "
                        f"splits the sequence over the tp ranks)")]
    return []


def context_parallel_problems(spec) -> list[Problem]:
    """What --cp and --cp-algorithm cannot run: the sequence must cut into equal parts (2 cp chunks
    for zig-zag; under sequence parallelism each cp rank's part again into tp), and Ulysses gives
    each cp rank whole heads of its tp rank's n_head / tp."""
    if spec.cp_algorithm not in ALGORITHMS:
        return []
    if spec.cp == 1:
        if spec.cp_algorithm == DEFAULT_CP_ALGORITHM:
            return []
        why = "a cp algorithm says how attention reaches the other cp ranks' tokens: with cp 1 every one is the same run"
        return [Problem(f"--cp-algorithm {spec.cp_algorithm} needs --cp > 1 ({why}): add --cp, or leave "
                        f"--cp-algorithm at {DEFAULT_CP_ALGORITHM}", lacks=why)]
    found = []
    parts = tokens_multiple(spec.cp, spec.cp_algorithm)
    if spec.seq % parts:
        found.append(Problem(f"the sequence of {spec.seq} tokens is not divisible by {parts} (--cp {spec.cp} "
                             f"--cp-algorithm {spec.cp_algorithm} cuts every sequence into {parts} equal parts)"))
    elif spec.sequence_parallel and (spec.seq // spec.cp) % spec.tp:
        found.append(Problem(f"the sequence of {spec.seq} tokens / cp {spec.cp} = {spec.seq // spec.cp} tokens per cp "
                             f"rank are not divisible by tp {spec.tp} (sequence parallelism splits them again over "
                             f"the tp ranks)"))
    heads = spec.n_head // spec.tp if spec.n_head % spec.tp == 0 else None
    if spec.cp_algorithm == "ulysses" and heads is not None and heads % spec.cp:
        found.append(Problem(f"--cp-algorithm ulysses gives each of the {spec.cp} cp ranks whole heads, and the "
                             f"{heads} heads of each tp rank (n_head {spec.n_head} / tp {spec.tp}) do not divide by "
                             f"cp {spec.cp}: use --cp-algorithm ring or zigzag (they cut the sequence, not the heads), "
                             f"or an n_head divisible by tp * cp = {spec.tp * spec.cp}"))
    return found


def expert_problems(spec) -> list[Problem]:
    """What the mixture of experts (--n-experts, --top-k, --moe-every) and expert parallelism (--ep)
    cannot run: ep cuts the dp axis and the experts, tp cuts the router's experts (every tp rank
    computes E/tp of the router's logits)."""
    if spec.n_experts == 0:
        return [Problem("--ep needs experts to split: add --n-experts")] if spec.ep > 1 else []
    found = []
    if spec.top_k > spec.n_experts:
        found.append(Problem(f"--top-k {spec.top_k} is more than the {spec.n_experts} experts"))
    if spec.moe_every > spec.n_layer:
        found.append(Problem(f"--moe-every {spec.moe_every} leaves none of the {spec.n_layer} blocks with experts "
                             f"(blocks moe_every-1, 2 moe_every-1, ... have them)"))
    if spec.dp % spec.ep:
        why = "expert parallelism splits the experts over dp ranks: with dp 1 there is no one to split them with"
        found.append(Problem(f"--ep {spec.ep} must divide --dp {spec.dp} (" + (why if spec.dp == 1 else
                             "expert parallelism splits the experts over groups of ep data-parallel ranks") + ")",
                             lacks=why if spec.dp == 1 else None))
    for axis in ("ep", "tp"):
        if spec.n_experts % getattr(spec, axis):
            what = "the experts" if axis == "ep" else "the router's logits (every tp rank computes E/tp of them)"
            found.append(Problem(f"--n-experts {spec.n_experts} is not divisible by {axis} {getattr(spec, axis)} "
                                 f"({axis} splits {what})"))
    return found


def pipeline_problems(spec) -> list[Problem]:
    """What --pp, --schedule, --virtual-stages and --micro-batches cannot run."""
    if spec.schedule not in SCHEDULES:
        return []
    found = []
    if spec.pp == 1 and spec.schedule != DEFAULT_SCHEDULE:
        why = "a schedule orders the micro-batches of pipeline stages: with pp 1 every schedule is the same run"
        found.append(Problem(f"--schedule {spec.schedule} needs --pp > 1 ({why}): add --pp, or leave --schedule at "
                             f"{DEFAULT_SCHEDULE}", lacks=why))
    if spec.pp * spec.virtual_stages > spec.n_layer:
        found.append(Problem(f"pp * virtual_stages = {spec.pp} * {spec.virtual_stages} pipeline stages need at least "
                             f"as many blocks, n_layer is {spec.n_layer}"))
    if spec.schedule == "zbv" and spec.virtual_stages != 2:
        found.append(Problem(f"--schedule zbv places two chunks per rank in a V: it needs --virtual-stages 2, "
                             f"got {spec.virtual_stages}"))
    elif spec.virtual_stages > 1 and spec.schedule not in ("interleaved", "zbv"):
        found.append(Problem(f"--virtual-stages {spec.virtual_stages} needs --schedule interleaved (or zbv, with 2)"))
    if spec.schedule == "interleaved" and spec.micro_batches % spec.pp:
        found.append(Problem(f"the interleaved schedule needs micro_batches ({spec.micro_batches}) to be a multiple "
                             f"of pp ({spec.pp})"))
    return found


def offload_problems(spec) -> list[Problem]:
    """Offloading parameters moves ZeRO-3's parameter shards: stages 0-2 have none between uses."""
    if spec.offload != "optimizer,params" or spec.zero == 3:
        return []
    why = ("offloading parameters moves ZeRO-3's parameter shards: stages 0-2 keep every parameter whole, so it is "
           "the run that offloads the optimizer alone")
    return [Problem(f"--offload optimizer,params needs --zero 3, got --zero {spec.zero} ({why}): use --offload "
                    f"optimizer, or --zero 3 to offload the parameter shards too", lacks=why)]
