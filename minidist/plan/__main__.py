"""``python -m minidist.plan``: memory, traffic and time of a training run, from 8 processes to 10,000 GPUs.

    python -m minidist.plan --model llama3-70b --seq 8192 --dp 16 --tp 8 --pp 8 --micro-batches 16 \\
        --zero 1 --sequence-parallel --recompute selective
    python -m minidist.plan --model llama3-70b --seq 8192 --search --gpus 1024 --memory-gib 80 \\
        --global-batch-size 1024
    python -m minidist.plan --n-layer 2 --n-embd 64 --n-head 4 --vocab 256 --seq 64 --dp 2 --tp 2 \\
        --dtype float32 --hardware local --json

Without ``--model`` the model is minidist's default GPT (2 layers, 64 wide, 4 heads, 256 bytes of
vocabulary, 64 tokens; learned positions for ``--seq`` tokens when it is given); the shape flags
override a preset's. A preset may be spelled as it is usually written (``llama-3-70b``, ``Llama-3-70B``). A configuration that cannot run exits
with status 2 and every reason; so does one that is more work than the planner does (a schedule too
long to simulate, a search that would take more than a minute: ``limits.py``, ``search.py``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from minidist.parallel.zero.offload import CHOICES as OFFLOAD_CHOICES
from minidist.parallel.pipeline import SCHEDULES
from minidist.plan.hardware import GIB, PROFILES
from minidist.parallel.layout import RECOMPUTE
from minidist.plan.layout import ITEMSIZE, RunSpec, layout_problems, number_problems
from minidist.plan.limits import flag_problems
from minidist.plan.models import PRESETS, ModelSpec, parameter_count, preset, with_shape
from minidist.plan.predict import hardware_profile, predict
from minidist.plan.report import format_prediction, format_search
from minidist.plan.search import search, search_problems

MINIDIST_DEFAULT = ModelSpec("minidist", n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=64)


def build_parser() -> argparse.ArgumentParser:
    """The planner's command line (its flags: what the fuzz tests generate arguments from)."""
    p = argparse.ArgumentParser(prog="python -m minidist.plan", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", help=f"a preset: {', '.join(PRESETS)}, in any case, dashes and underscores optional "
                                   "(llama-3-70b, Llama_3_70B) (default: minidist's GPT)")
    for flag, what in (("--n-layer", "blocks"), ("--n-embd", "width h"), ("--n-head", "attention heads"),
                       ("--vocab", "vocabulary size"), ("--n-kv-head", "key/value heads (GQA)"),
                       ("--ffn", "MLP width (default 4h)"),
                       ("--block-size", "learned positions' table length (default: a preset's; else --seq, or 64)"),
                       ("--n-experts", "experts per MoE block"), ("--top-k", "experts per token")):
        m.add_argument(flag, type=int, help=what)
    r = p.add_argument_group("run")
    r.add_argument("--seq", type=int, help="tokens per sequence (default: the model's block size)")
    r.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch")
    r.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step and dp rank")
    for axis in ("dp", "tp", "pp", "cp", "ep"):
        r.add_argument(f"--{axis}", type=int, default=1)
    r.add_argument("--zero", type=int, default=0, choices=range(4))
    r.add_argument("--dtype", default="bfloat16", choices=list(ITEMSIZE))
    r.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    r.add_argument("--sequence-parallel", action="store_true")
    r.add_argument("--recompute", default="none", choices=RECOMPUTE)
    r.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    r.add_argument("--virtual-stages", type=int, default=1)
    r.add_argument("--cp-algorithm", default="ring", choices=["ring", "zigzag", "ulysses"])
    r.add_argument("--dropout", action="store_true", help="Korthikanti et al.'s activations (with dropout masks)")
    r.add_argument("--offload", default="none", choices=OFFLOAD_CHOICES, metavar='{none,optimizer,"optimizer,params"}')
    r.add_argument("--offload-to", default="host", choices=["host", "disk"])
    h = p.add_argument_group("machine and output")
    h.add_argument("--hardware", default="h100", choices=[*PROFILES, "local"])
    h.add_argument("--json", action="store_true", help="print the prediction as JSON")
    s = p.add_argument_group("search")
    s.add_argument("--search", action="store_true", help="every layout of --gpus that fits, fastest first")
    s.add_argument("--gpus", type=int, help="devices to search layouts for")
    s.add_argument("--memory-gib", type=float, help="device memory (default: the hardware's)")
    s.add_argument("--global-batch-size", type=int, help="sequences per step (default: dp x micro-batches x size)")
    s.add_argument("--top", type=int, default=10, help="layouts shown")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def model_of(args) -> ModelSpec:
    """The model of ``args``: a preset (``--model``) or minidist's GPT, with the shape flags given. A
    custom shape (no preset) has as many learned positions as ``--seq`` unless ``--block-size`` says
    (minidist's GPT learns one position per token of its block); a preset keeps its published table."""
    base = preset(args.model) if args.model else MINIDIST_DEFAULT
    block_size = args.block_size
    if block_size is None and not args.model and args.seq is not None and not flag_problems({"seq": args.seq}):
        block_size = args.seq  # an out-of-range --seq is refused by its own name, not as a block size too
    return with_shape(base, n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab_size=args.vocab,
                      n_kv_head=args.n_kv_head, ffn=args.ffn, block_size=block_size, n_experts=args.n_experts,
                      top_k=args.top_k)


def run_of(args, model: ModelSpec) -> RunSpec:
    fields = {f.name for f in dataclasses.fields(RunSpec)} - {"seq"}
    return RunSpec(seq=args.seq if args.seq is not None else model.block_size,
                   **{k: v for k, v in vars(args).items() if k in fields})


def refuse(problems: list[str]) -> int:
    """Print ``problems`` as the reasons this run cannot be planned; exit status 2."""
    print("minidist.plan: this run cannot be planned:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        model = model_of(args)
        run = run_of(args, model)
    except ValueError as e:
        print(f"minidist.plan: {e}", file=sys.stderr)
        return 2
    found = flag_problems({k: getattr(args, k) for k in ("gpus", "memory_gib", "global_batch_size", "top")})
    if found:
        return refuse(found)
    if args.search:
        if args.gpus is None:
            print("minidist.plan: --search needs --gpus N", file=sys.stderr)
            return 2
        found = number_problems(model, run)  # each candidate's layout is the search's, the rest is the user's
        if found:
            return refuse(found)
        hw = hardware_profile(args.hardware, model, dataclasses.replace(run, tp=1, cp=1))
        limit = args.memory_gib * GIB if args.memory_gib is not None else hw.memory_bytes
        batch = args.global_batch_size if args.global_batch_size is not None else run.global_batch
        found = search_problems(model, args.gpus, hw, run, batch)
        if found:
            return refuse(found)
        fits, rejected = search(model, args.gpus, hw, run, batch, limit, progress=True)
        if args.json:
            print(json.dumps({"parameters": parameter_count(model), "fits": fits,
                              "rejected": [{"run": dataclasses.asdict(r), "why": why} for r, why in rejected]}))
        else:
            print(format_search(model, hw, args.gpus, batch, limit, fits, rejected, args.top))
        return 0
    problems = layout_problems(model, run)
    if problems:
        return refuse(problems)
    prediction = predict(model, run, args.hardware)
    print(json.dumps(prediction) if args.json else format_prediction(prediction))
    return 0


if __name__ == "__main__":
    sys.exit(main())
