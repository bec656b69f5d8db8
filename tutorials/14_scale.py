"""Lesson 14: the scale planner: your own 8-rank run predicted, then measured; then Llama 3 70B on 1,024 GPUs.

    python tutorials/14_scale.py                     (8 ranks as threads; or --local 4)
    python tutorials/14_scale.py --png scale.png     (also draw memory per rank for the 70B layouts)
    python -m minidist.plan --help                   (the same planner on the command line)

Lessons 2 to 13 each measured one axis on a few ranks: what ZeRO keeps per stage (5, 9), what tensor
and sequence parallelism send (3), how many micro-batches 1F1B keeps in flight (4), what ring
attention saves (10). The scale planner (minidist/plan/, ``python -m minidist.plan``) writes those
formulas down together, for any layout of any decoder-only transformer, so that it answers what
minidist cannot run on 2 cores:

    memory per rank   ZeRO's model states, unit by unit and shard by shard as minidist holds them;
                      the activations autograd saves per layer (norm x-hat and outputs, q, k, v,
                      the MLP's hidden, the attention probabilities) times the micro-batches the
                      schedule keeps in flight (its own simulator says how many)   memory.py
    bytes per axis    every collective of a step, counted as the trace counts them   comm.py
    time              FLOPs and bytes at a device's speed, the bubble from the simulator   timing.py

The lesson prints:

  1. the plan for a small GPT (4 blocks, 59,584 parameters) on dp 2 x pp 2 x tp 2, ZeRO-1, float16
     (so the mixed-precision bytes show: 2 + 2 + 4 + 8 per parameter), 1F1B over 2 micro-batches,
     made before anything runs: bytes per rank by component, and bytes sent per step and axis;
  2. the same run trained 2 steps on 8 threads (``minidist.train.measure.measure``): every rank's live
     arrays and trace next to the plan, equal to the byte (model states, bytes per axis);
  3. a run without a pipeline, dp 2 x cp 2 x tp 2 with sequence parallelism and ring attention, whose
     activations (one micro-batch's autograd graph) the plan predicts term by term, to the byte too;
  4. Llama 3 70B at 8,192 tokens on 1,024 H100s, global batch 1,024 sequences: six layouts by hand,
     each rank's bytes by component, whether it fits in 80 GiB, the predicted step time and MFU, and
     which component dominates and why. ``--search`` ranks every layout (see the end).

Step time is predicted in part 4 only. This machine has a profile too (``--hardware local``: the
planner measures NumPy's matmul, the memory bandwidth and the ring all-reduce, in about 5 s and with
mpiexec), but part 2's ranks are threads sharing one interpreter, which the planner does not model:
their time is printed as it is, to read with care (benchmarks/plan.py holds predicted against
measured step times of processes).

Exercises (the expected output follows each):

  - ``--local 4``: the run becomes dp 2 x pp 2 (no tp) and dp 2 x tp 2 with sequence parallelism.
    Each rank now holds its stage's whole matrices: pp rank 0's parameters 68,224 B, against 35,008 B
    under tp 2 (not quite double: the norms, the row-parallel biases and the position table are whole
    on every tp rank); tp sends nothing in part 2, and part 3's activations nearly double, 60,928 ->
    120,832 B (without cp every rank keeps all 16 tokens of its sequences).
  - Layout 4 with the interleaved schedule (2 chunks per rank):
        python -m minidist.plan --model llama3-70b --seq 8192 --dp 16 --tp 8 --pp 8 \\
            --micro-batches 64 --zero 1 --sequence-parallel --recompute selective \\
            --schedule interleaved --virtual-stages 2
    the bubble falls from 9.9% to 5.2% (v = 2: (p-1)/(v m + p-1)), but pp rank 0 now keeps more
    micro-batch chunks in flight: its activations grow from 42.8 to 61.5 GiB (66.9 GiB in all). The step
    is a little faster, 10.31 s against 10.77: the smaller bubble outweighs the sends, though rank 0's
    two chunks have three stage boundaries, so it sends "pp 3.0 GiB" a step instead of 1.0, and the
    pipeline's sends are not hidden (timing.py).
"""
import argparse
import textwrap

from minidist.launch_check import check_launch
from minidist.plan import PROFILES, RunSpec, from_gpt_config, predict, preset
from minidist.plan.comm import comm_bytes_per_step
from minidist.plan.layout import run_spec_of
from minidist.train.measure import measure
from minidist.plan.memory import (activation_bytes, embedding_activation_bytes, head_activation_bytes,
                                  layer_activation_terms, model_state_bytes, optimizer_numel, stage_weights)
from minidist.plan.models import layers_per_stage
from minidist.plan.report import describe_run, human
from minidist.train.config import TrainConfig

SHAPE = dict(n_layer=4, n_head=4, n_embd=32, block_size=16, batch_size=8)  # minidist's GPT, 256-byte vocabulary
RECIPE = dict(micro_batches=2, zero=1, dtype="float16")  # float16 + float32 masters and AdamW moments
LAYOUTS = {  # ranks: (the pipelined run of parts 1 and 2, the run without a pipeline of part 3)
    8: (dict(dp=2, pp=2, tp=2), dict(dp=2, cp=2, tp=2, sequence_parallel=True)),
    4: (dict(dp=2, pp=2), dict(dp=2, tp=2, sequence_parallel=True)),
}
STATES = ("parameters", "gradients", "master_weights", "optimizer_states")
COMPONENTS = STATES + ("activations", "buffers")
WIDTH = 112  # the prose's lines
SHORT = {"parameters": "params", "gradients": "grads", "master_weights": "masters", "optimizer_states": "optim",
         "activations": "acts", "buffers": "buffers"}

BIG, SEQ, GPUS, BATCH, HARDWARE = "llama3-70b", 8192, 1024, 1024, "h100"  # global batch: 1,024 sequences of 8,192
# The search's 2,400 layouts, timed with `time` on the 2-core AMD EPYC virtual machine this lesson was
# written on: 6-7 s of CPU, 7-15 s of wall time while other work shared the two cores.
SEARCH_TIME = "about 10 s on a 2-core AMD EPYC: 7 s of one core, longer while other work shares it"
SCALE = [  # (label in the picture, the layout: dp is what is left of the 1,024 GPUs, micro-batches of 1 sequence)
    ("dp 1024\nZeRO-3", dict(zero=3)),
    ("dp 1024, ZeRO-3\nfull recompute", dict(zero=3, recompute="full")),
    ("tp 8 x dp 128\nZeRO-1, SP", dict(tp=8, zero=1, sequence_parallel=True)),
    ("tp 8 x pp 8 x dp 16\nZeRO-1, SP, selective", dict(tp=8, pp=8, zero=1, sequence_parallel=True,
                                                        recompute="selective")),
    ("tp 8 x pp 8 x dp 16\nZeRO-1, SP, full", dict(tp=8, pp=8, zero=1, sequence_parallel=True, recompute="full")),
    ("tp 8 x pp 4 x cp 2 x dp 16\nZeRO-1, SP, selective", dict(tp=8, pp=4, cp=2, zero=1, sequence_parallel=True,
                                                               recompute="selective")),
]


def scale_run(fields) -> RunSpec:
    """One of SCALE's layouts on GPUS devices: dp = GPUS / (tp pp cp), m = BATCH / dp micro-batches of 1."""
    dp = GPUS // (fields.get("tp", 1) * fields.get("pp", 1) * fields.get("cp", 1))
    return RunSpec(seq=SEQ, micro_batch_size=1, micro_batches=BATCH // dp, dp=dp, dtype="bfloat16", **fields)


def say(text, indent="  ", first=None):
    """Print ``text`` wrapped to WIDTH columns."""
    print(textwrap.fill(text, WIDTH, initial_indent=indent if first is None else first, subsequent_indent=indent))


def b(n) -> str:
    return f"{n:,.0f}"


def coords(row) -> str:
    return "(" + ",".join(map(str, row["coords"])) + ")"


def command_line(cfg) -> str:
    """``python -m minidist.plan`` for a TrainConfig's model and run."""
    run = run_spec_of(cfg)
    shape = (f"--n-layer {cfg.n_layer} --n-embd {cfg.n_embd} --n-head {cfg.n_head} --vocab 256 "
             f"--block-size {cfg.block_size}")
    layout = " ".join(f"--{axis} {getattr(run, axis)}" for axis in ("dp", "tp", "pp", "cp") if getattr(run, axis) > 1)
    recipe = (f"--seq {run.seq} --micro-batch-size {run.micro_batch_size} --micro-batches {run.micro_batches} "
              f"--zero {run.zero} --dtype {run.dtype}" + (" --sequence-parallel" if run.sequence_parallel else ""))
    return f"python -m minidist.plan {shape} \\\n      {layout} {recipe}"


def layout_of(r) -> str:
    """'dp 16 x pp 8 x cp 1 x tp 8: ZeRO-1, SP, selective recompute, 1f1b, 64 micro-batches' (r: a RunSpec's dict)."""
    extras = [f"ZeRO-{r['zero']}"] + (["SP"] if r["sequence_parallel"] else []) + (
        [f"{r['recompute']} recompute"] if r["recompute"] != "none" else []) + (
        [r["schedule"]] if r["pp"] > 1 else []) + ([f"{r['cp_algorithm']} attention"] if r["cp"] > 1 else [])
    return (f"dp {r['dp']} x pp {r['pp']} x cp {r['cp']} x tp {r['tp']}: {', '.join(extras)}, "
            f"{r['micro_batches']} micro-batch{'es' if r['micro_batches'] > 1 else ''}")


def part1(cfg):
    """The plan, before anything runs. Returns (model, run, prediction)."""
    model, run = from_gpt_config(cfg), run_spec_of(cfg)
    p = predict(model, run, HARDWARE)  # the hardware only matters for the time, which parts 1-3 do not use
    print(f"=== 1. The plan, before anything runs: minidist's GPT ({p['parameters']:,} parameters) on {run.world} "
          "ranks ===")
    print(f"{cfg.n_layer} blocks, {cfg.n_embd} wide, {cfg.n_head} heads; run_spec_of(TrainConfig(...)):\n"
          f"  {describe_run(p['run'])}")
    print("predicted bytes per rank by component (data-parallel rank 0 of each pp rank; every tp rank the same):")
    print(f"  {'pp rank':>7}" + "".join(f"{SHORT[c]:>10}" for c in COMPONENTS) + f"{'total':>10}")
    for r, row in enumerate(p["per_pp_rank"]):
        print(f"  {r:>7}" + "".join(f"{b(row[c]):>10}" for c in COMPONENTS) + f"{b(row['total']):>10}")
    # where the model states come from: the paper's bytes per element of the stage this tp rank holds
    for r, row in enumerate(p["per_pp_rank"]):
        whole, shard = optimizer_numel(model, run, r)
        assert (row["parameters"], row["gradients"]) == (2 * whole, 2 * whole), "float16 P and G: 2 B each"
        assert (row["master_weights"], row["optimizer_states"]) == (4 * shard, 8 * shard), "ZeRO-1: 12 B / dp"
        print(f"  pp rank {r}: {whole:,} elements a tp rank x (2 + 2) B float16; its ZeRO-1 shard, 1/{run.dp} = "
              f"{shard:,}, x (4 + 8) B float32")
    counts = layers_per_stage(model, run.n_stages)
    weights = stage_weights(model, run)
    for r, row in enumerate(p["per_pp_rank"]):
        flight = min(run.pp - r, run.micro_batches)  # lesson 4: 1F1B keeps min(p - r, m) micro-batches on rank r
        assert row["activations"] == flight * weights[r], "1F1B's in-flight count"
        ends = " + the embeddings" if r == 0 else " + the head, float32 logits" if r == run.pp - 1 else ""
        print(f"  activations, pp rank {r}: 1F1B keeps min(p - r, m) = {flight} x {b(weights[r])} B "
              f"({counts[r]} blocks{ends})")
    print("predicted bytes each rank sends per step, per axis (comm.comm_bytes_per_step):")
    for r in range(run.pp):
        sent = comm_bytes_per_step(model, run, r)
        print(f"  pp rank {r}: " + "  ".join(f"{axis} {b(v)}" for axis, v in sent.items() if v))
    print(f"the same plan on the command line:\n  {command_line(cfg)}")
    return model, run, p


def state_rows(rows, model, run, cfg, columns):
    """Print each rank's measured bytes beside the plan's for it; return the mismatches."""
    width = 9
    print(f"  {'rank':>4} {'(dp,pp,cp,tp)':<14}" + "".join(f"{SHORT[c]:>{width}}" for c in columns) + "  |"
          + "".join(f"{SHORT[c]:>{width}}" for c in columns))
    wrong = []
    for rank, row in enumerate(rows):
        d, pp_rank, c, _ = row["coords"]
        planned = model_state_bytes(model, run, pp_rank, d * cfg.cp + c)  # its ZeRO shard: dp x cp ranks
        got = dict(row["model_states"])
        if "activations" in columns:
            planned["activations"], got["activations"] = activation_bytes(model, run)[pp_rank], row["activations"]
        print(f"  {rank:>4} {coords(row):<14}" + "".join(f"{b(got[k]):>{width}}" for k in columns) + "  |"
              + "".join(f"{b(planned[k]):>{width}}" for k in columns))
        wrong += [(rank, k, got[k], planned[k]) for k in columns if got[k] != planned[k]]
    return wrong


def sent_rows(rows, model, run):
    """Print each rank's bytes sent per axis in the last step beside the plan's; return (axes, per rank
    the measured and the planned dicts)."""
    planned = [comm_bytes_per_step(model, run, row["coords"][1]) for row in rows]
    axes = [a for a in planned[0]
            if any(p[a] for p in planned) or any(r["comm_bytes_per_step"].get(a, 0) for r in rows)]
    width = 9
    print(f"  {'rank':>4} {'(dp,pp,cp,tp)':<14}" + "".join(f"{a:>{width}}" for a in axes) + "  |"
          + "".join(f"{a:>{width}}" for a in axes))
    pairs = []
    for rank, (row, plan) in enumerate(zip(rows, planned)):
        got = {a: row["comm_bytes_per_step"].get(a, 0.0) for a in axes}
        print(f"  {rank:>4} {coords(row):<14}" + "".join(f"{b(got[a]):>{width}}" for a in axes) + "  |"
              + "".join(f"{b(plan[a]):>{width}}" for a in axes))
        pairs.append((got, plan))
    return axes, pairs


def part2(cfg, model, run):
    """The same run, measured on threads, beside the plan."""
    print(f"\n=== 2. The run: measure() trains it 2 steps on {run.world} threads; measured | planned, per rank ===")
    rows = measure(cfg, steps=2)
    print("model states after the last backward, bytes (planned: memory.model_state_bytes(model, run, pp_rank, "
          "dp_rank)):")
    wrong = state_rows(rows, model, run, cfg, STATES)
    assert not wrong, f"model states differ from the plan: {wrong}"
    print("bytes sent in the last step per axis, from the trace (planned: comm.comm_bytes_per_step(model, run, "
          "pp_rank)):")
    axes, pairs = sent_rows(rows, model, run)
    off = [(rank, a) for rank, (got, plan) in enumerate(pairs) for a in axes if got[a] != plan[a]]
    assert not off, f"bytes sent differ from the plan: {off}"
    print(f"model states: {len(rows)} ranks x {len(STATES)} components, measured = planned to the byte")
    print(f"bytes sent: {len(rows)} ranks x {len(axes)} axes ({', '.join(axes)}), measured = planned to the byte")
    say("activations: under a pipeline they depend on the schedule's in-flight count, the simulator's above "
        "(tests/test_pipeline_engine.py holds it against the engine); measure() counts them without one: part 3",
        first="")
    times = sorted(row["step_time_s"] for row in rows)
    say(f"step time measured: {times[-1]:.3f} s (the slowest rank); {run.world} threads share one interpreter and "
        "the cores: indicative only (the time model is for processes: benchmarks/plan.py)", first="")


def part3(cfg):
    """A run without a pipeline: the activations too, term by term."""
    model, run = from_gpt_config(cfg), run_spec_of(cfg)
    print(f"\n=== 3. Without a pipeline the activations are exact too ===\n{describe_run(run.__dict__)}")
    s, mb = run.seq // run.cp, run.micro_batch_size
    say(f"one micro-batch's activations on one rank ({mb} sequences x {s} of the {run.seq} tokens: cp {run.cp}; "
        f"h = {model.n_embd}, {model.n_head} heads, tp {run.tp}; float16), per block "
        "(memory.layer_activation_terms):", first="")
    terms = layer_activation_terms(model, run)
    for what, v in terms:
        print(f"  {what:<52}{b(v):>8} B")
    per_layer = sum(v for _, v in terms)
    head, embed = head_activation_bytes(model, run), embedding_activation_bytes(model, run)
    total = activation_bytes(model, run)[0]
    assert model.n_layer * per_layer + head + embed == total
    print(f"  = {b(per_layer)} B a block x {model.n_layer} blocks + the head {b(head)} B (float32 logits, the final "
          f"norm, targets)\n    + the embeddings {b(embed)} B (token and position ids) = {b(total)} B")
    rows = measure(cfg, steps=2)
    print("model states, and one micro-batch's activations (its autograd graph: accounting.activation_bytes), bytes:")
    wrong = state_rows(rows, model, run, cfg, STATES + ("activations",))
    assert not wrong, f"model states or activations differ from the plan: {wrong}"
    print("bytes sent in the last step per axis:")
    axes, pairs = sent_rows(rows, model, run)
    # Exact on every rank, but for one count: under ZeRO with sequence parallelism the norms' gradients are
    # summed over tp on each rank's own ZeRO shard, and where the shard boundaries fall decides how many of
    # them a rank holds. The plan counts the mean over the ranks that share (pp rank, tp rank).
    averaged = {"tp"} if run.zero and run.sequence_parallel else set()
    off = [(rank, a) for rank, (got, plan) in enumerate(pairs) for a in axes if a not in averaged and got[a] != plan[a]]
    assert not off, f"bytes sent differ from the plan: {off}"
    groups = {}
    for row, (got, plan) in zip(rows, pairs):
        groups.setdefault((row["coords"][1], row["coords"][3]), []).append((got, plan))
    for a in averaged:
        for key, members in groups.items():
            mean = sum(got[a] for got, _ in members) / len(members)
            assert mean == members[0][1][a], f"{a} on (pp, tp) = {key}: mean {mean} != planned {members[0][1][a]}"
        spread = sorted({got[a] for got, _ in pairs})
        say(f"{a}: the ranks send {', '.join(b(x) for x in spread)} B: the norms' gradients are summed over tp "
            f"on each rank's ZeRO shard, and the shard boundaries fall differently; the mean of the {run.dp * run.cp}"
            f" ranks that share a tp rank is the plan's {b(pairs[0][1][a])} B")
    exact = [a for a in axes if a not in averaged]
    print(f"model states and activations: {len(rows)} ranks x {len(STATES) + 1}, measured = planned to the byte")
    print(f"bytes sent: {', '.join(exact)} measured = planned to the byte on every rank"
          + (f"; {', '.join(sorted(averaged))} on the mean of each group" if averaged else ""))


def part4():
    """Llama 3 70B on 1,024 H100s: six layouts. Returns the predictions."""
    model = preset(BIG)
    runs = [scale_run(fields) for _, fields in SCALE]
    preds = [predict(model, run, HARDWARE) for run in runs]
    for p in preds:
        assert not p["problems"], p["problems"]
    gib = 2**30
    limit = preds[0]["memory_bytes"]
    psi = preds[0]["parameters"]
    print(f"\n=== 4. {BIG} ({psi / 1e9:.2f} B parameters) on {GPUS:,} x {preds[0]['hardware']} "
          f"({limit / gib:.0f} GiB each) ===")
    print(f"{SEQ:,} tokens a sequence, global batch {BATCH:,} sequences in micro-batches of 1, bfloat16 + AdamW; "
          "six layouts:")
    for i, p in enumerate(preds, 1):
        print(f"  {i}  {layout_of(p['run'])}")
    print("bytes per rank by component, GiB (the largest pipeline rank), and the predicted step:")
    print(f"  {'#':>2}" + "".join(f"{SHORT[c]:>9}" for c in COMPONENTS) + f"{'total':>9}  {'fits':<6}{'step s':>7}"
          f"{'MFU':>7}{'bubble':>8}")
    for i, p in enumerate(preds, 1):
        row = p["per_rank_bytes"]
        print(f"  {i:>2}" + "".join(f"{row[c] / gib:>9.1f}" for c in COMPONENTS) + f"{row['total'] / gib:>9.1f}  "
              f"{'yes' if p['fits'] else 'no':<6}{p['step_time_s']:>7.2f}{100 * p['mfu']:>6.1f}%"
              f"{100 * p['bubble']:>7.1f}%")

    # the claims below, checked against the formulas of the earlier lessons
    a, h, s, L = model.n_head, model.n_embd, SEQ, model.n_layer
    one, full, tp8, pp8, pp8full, cp2 = preds
    states = lambda p: sum(p["per_rank_bytes"][k] for k in STATES)  # noqa: E731
    largest = lambda p: max(COMPONENTS, key=p["per_rank_bytes"].get)  # noqa: E731
    probs = one["activation_terms"]["attention probabilities"]
    assert probs == 2 * a * s * (s + 32) / 2, "a s (s + 32) b / 2 probabilities of 2 bytes (causal blocks of 32 queries)"
    assert abs(states(one) - 16 * psi / GPUS) < 16 * 2 * (L + 4), "ZeRO-3: 16 Psi / N (+ array_split's rounding)"
    assert largest(one) == largest(tp8) == "activations" and not one["fits"] and not tp8["fits"]
    assert full["activation_bytes_per_layer"] == 2 * s * h, "full recompute keeps the block's input"
    assert pp8full["activation_bytes_per_layer"] == 2 * s * h / 8, "... cut by tp under sequence parallelism"
    assert tp8["per_rank_bytes"]["parameters"] == tp8["per_rank_bytes"]["gradients"], "ZeRO-1 shards neither"
    for p in (pp8, pp8full, cp2):
        r = p["run"]
        weights = stage_weights(model, RunSpec(**r))
        assert p["per_pp_rank"][0]["activations"] == min(r["pp"], r["micro_batches"]) * weights[0], "1F1B's p in flight"
        assert abs(p["bubble"] - (r["pp"] - 1) / (r["micro_batches"] + r["pp"] - 1)) < 1e-12, "(p-1)/(m+p-1)"
    assert cp2["per_rank_bytes"]["activations"] < pp8["per_rank_bytes"]["activations"] / 1.9
    stage0 = layers_per_stage(model, 8)[0]
    hw = PROFILES[HARDWARE]
    dp_seconds = full["comm_bytes_per_step"]["dp"] / hw.inter_bandwidth  # dp 1024 spans 128 nodes

    print("\nwhat dominates, and why:")
    why = [
        f"activations, {human(one['per_rank_bytes']['activations'])}: each layer's attention probabilities alone are "
        f"a s (s + 32) b / 2 x 2 B = {a} x {s:,} x {s + 32:,} / 2 x 2 B = {human(probs)}, x {L} layers (causal "
        "attention keeps its scores in blocks of 32 queries, each over the keys up to its last: about half the "
        "s x s square). ZeRO-3 has cut the model states to "
        f"16 Psi / N = 16 x {psi / 1e9:.2f} B / {GPUS:,} = {human(states(one))}, but no ZeRO stage touches "
        "activations: only recompute, or cutting the sequence (tp with SP, cp), does.",
        f"full recompute keeps each block's input only (s b h x 2 B = {human(full['activation_bytes_per_layer'])} a "
        f"layer) and the head's float32 logits over {model.vocab_size:,} words: "
        f"{human(full['per_rank_bytes']['activations'])}. It fits, at the price of a second forward in every "
        f"backward, and ZeRO-3 sends {human(full['comm_bytes_per_step']['dp'])} a step from every GPU (each parameter "
        f"gathered twice, reduced once): {dp_seconds:.1f} s of its {full['step_time_s']:.1f} s step at the "
        f"{hw.inter_bandwidth / 1e9:.0f} GB/s a GPU gets across nodes. The plan hides all of it under the compute "
        "(timing.py's overlap rules); a real run would hide less.",
        f"tp 8 cuts the matrices by 8, but ZeRO-1 shards only the optimizer: parameters and gradients, "
        f"{human(tp8['per_rank_bytes']['parameters'])} each, are whole on every dp rank. The activations "
        f"({human(tp8['per_rank_bytes']['activations'])}) still keep "
        f"{human(tp8['activation_terms']['attention probabilities'])} of probabilities a layer (a s (s + 32) b / 2t), and "
        "minidist's column-parallel Linears save their all-gathered input, 2 s b h x 2 B = "
        f"{human(tp8['activation_terms']['norm outputs (Linear inputs; gathered under SP)'])} a layer, which sequence "
        "parallelism does not cut.",
        f"pp 8 leaves {stage0} layers on pp rank 0 (model states {human(states(pp8))}) and selective recompute drops "
        f"the probabilities ({human(pp8['activation_bytes_per_layer'])} a layer), but 1F1B keeps p = 8 micro-batches "
        f"in flight on rank 0: 8 x {stage0} x {human(pp8['activation_bytes_per_layer'])} = "
        f"{human(pp8['per_rank_bytes']['activations'])}, activations again the largest part. The bubble is "
        f"(p-1)/(m+p-1) = 7/71 = {100 * pp8['bubble']:.1f}%.",
        f"full recompute: 8 x {stage0} x {human(pp8full['activation_bytes_per_layer'])} (each block's input, / t "
        f"under SP) = {human(pp8full['per_rank_bytes']['activations'])}, {human(pp8full['per_rank_bytes']['total'])} "
        f"in all; but {pp8full['step_time_s']:.1f} s a step against {pp8['step_time_s']:.1f} s: the forward runs "
        "twice.",
        f"cp 2 gives each rank half the tokens, and pp 4 half the micro-batches in flight (4): "
        f"{human(cp2['per_rank_bytes']['activations'])}. Ring attention keeps its output and log-sum-exp, never the "
        f"probabilities; the bubble is 3/67 = {100 * cp2['bubble']:.1f}%, and the ring's "
        f"{human(cp2['comm_bytes_per_step']['cp'])} a step run under the attention they feed.",
    ]
    for i, text in enumerate(why, 1):
        say(text, "     ", first=f"  {i}  ")
    fitting = [i for i, p in enumerate(preds, 1) if p["fits"]]
    best = min(fitting, key=lambda i: preds[i - 1]["step_time_s"])
    say(f"{len(fitting)} of the 6 fit in {limit / gib:.0f} GiB; the fastest of them is layout {best}: "
        f"{preds[best - 1]['step_time_s']:.2f} s a step, {preds[best - 1]['tokens_per_s']:,.0f} tokens/s, "
        f"MFU {100 * preds[best - 1]['mfu']:.1f}% (the time model's assumptions are written in minidist/plan/timing.py "
        "and hardware.py).", first="")
    print("every layout of 1,024 GPUs that fits, fastest first (the layouts above are a few of them):")
    print(f"  python -m minidist.plan --model {BIG} --seq {SEQ} --search --gpus {GPUS} --global-batch-size {BATCH}")
    print(f"  ({SEARCH_TIME})")
    return preds


def draw(path, preds):
    """Per layout a stacked bar of the largest pipeline rank's bytes by component, the device's memory as
    a dashed line (a bar taller than the chart is cut, its total written on it); below, the model states
    alone, on their own scale."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    gib = 2**30
    colours = {"parameters": "#4c72b0", "gradients": "#dd8452", "master_weights": "#8172b3",
               "optimizer_states": "#55a868", "activations": "#c44e52", "buffers": "#937860"}
    names = {"parameters": "parameters (bf16)", "gradients": "gradients (bf16)",
             "master_weights": "master weights (fp32)", "optimizer_states": "AdamW moments (fp32)",
             "activations": "activations in flight", "buffers": "ZeRO's working buffers"}
    limit = preds[0]["memory_bytes"] / gib
    fig, (ax, low) = plt.subplots(2, 1, figsize=(13, 8.6), sharex=True, gridspec_kw=dict(height_ratios=(3, 1.25)))
    states = max(sum(p["per_rank_bytes"][c] for c in STATES) for p in preds) / gib
    for axis, parts, top in ((ax, COMPONENTS, 2.2 * limit), (low, STATES, 1.3 * states)):
        for i, p in enumerate(preds):
            bottom = 0.0
            for c in parts:
                value = p["per_rank_bytes"][c] / gib
                axis.bar(i, max(0.0, min(value, top - bottom)), bottom=bottom, width=0.6, color=colours[c],
                         edgecolor="black", linewidth=0.4, zorder=2)
                bottom += value
            if axis is low:
                axis.text(i, bottom + top * 0.02, f"{bottom:.1f} GiB", ha="center", va="bottom", fontsize=9)
            elif bottom > top:
                axis.text(i, top * 0.985, f"{bottom:,.0f} GiB\n(cut)\ndoes not fit", ha="center", va="top",
                          fontsize=9, color="white", fontweight="bold", zorder=3)
            else:
                axis.text(i, bottom + top * 0.01, f"{bottom:.1f} GiB\n{'fits' if p['fits'] else 'does not fit'}",
                          ha="center", va="bottom", fontsize=9)
        axis.set_ylim(0, top)
        axis.grid(axis="y", color="#dddddd", zorder=0)
    ax.axhline(limit, color="black", linestyle="--", linewidth=1.2, zorder=3)
    ax.text(len(preds) - 1.5, limit + 2, f"{limit:.0f} GiB: one {preds[0]['hardware']}", ha="center", va="bottom",
            fontsize=9)
    ax.set_ylabel("GiB per GPU (the pipeline rank with the most)")
    low.set_ylabel("model states only, GiB")
    labels = [f"{i}. {label}\n{p['step_time_s']:.1f} s a step, MFU {100 * p['mfu']:.0f}%"
              for i, ((label, _), p) in enumerate(zip(SCALE, preds), 1)]
    low.set_xticks(range(len(preds)), labels, fontsize=9)
    low.set_xlim(-0.5, len(preds) - 0.5)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[c]) for c in reversed(COMPONENTS)]
    ax.legend(handles, [names[c] for c in reversed(COMPONENTS)], loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize=9, frameon=False)
    ax.set_title(f"{BIG}, {SEQ:,} tokens a sequence, {GPUS:,} GPUs, global batch {BATCH:,}: memory per GPU by "
                 "component (predicted)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"\nMemory per rank by component, for the six layouts, drawn in {path}")


def lesson(ranks, png=None):
    piped, flat = (TrainConfig(**SHAPE, **RECIPE, **layout) for layout in LAYOUTS[ranks])
    model, run, _ = part1(piped)
    part2(piped, model, run)
    part3(flat)
    preds = part4()
    if png:
        draw(png, preds)
    print("\nTry:")
    print("  1. --local 4 (dp 2 x pp 2, no tp; part 3 dp 2 x tp 2, no cp). Expect pp rank 0 to hold its stage's whole "
          "matrices,\n     34,112 elements (17,504 a tp rank at tp 2): 68,224 B of float16 parameters; no tp column "
          "in the bytes sent\n     (dp 68,248, pp 12,304 B); a micro-batch's activations 120,832 B on every rank "
          "(60,928 with cp 2), each\n     still measured = planned to the byte; the 70B layouts unchanged.")
    print(f"\nThe plan of {ranks} ranks = the run, to the byte (model states, bytes per axis; activations without a "
          f"pipeline);\n{sum(p['fits'] for p in preds)} of 6 layouts of {BIG} fit on {GPUS:,} GPUs.")
    print("All checks passed.")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local", type=int, nargs="?", const=8, default=8, metavar="N",
                    help="the small run's ranks, as threads (8: dp 2 x pp 2 x tp 2, or 4: dp 2 x pp 2; default 8)")
    ap.add_argument("--png", help="draw memory per rank by component for the 70B layouts into this PNG")
    args = ap.parse_args()
    check_launch(ap, args, ranks=LAYOUTS, mpiexec=False)  # its ranks are threads (measure())
    lesson(args.local, args.png)
