"""What a run says of its data and its layout at the start (rank 0, before the first step): its data
and vocabulary, who holds which part of the model and what each parallelism cut further, and under
ZeRO the model states' bytes, the paper's formula beside what the arrays hold. Sends nothing.
"""
from pathlib import Path

import numpy as np

from minidist.inspect import zero_memory
from minidist.inspect.accounting import format_memory_table
from minidist.parallel.context.ring_attention import sequence_chunks, token_ranges
from minidist.parallel.pipeline import placement_of, rank_stages
from minidist.parallel.tensor.layout import ep_block


def describe_data(cfg, corpus) -> str:
    """What the run reads and how its tokens are counted: the data, its vocabulary and tokenizer, and
    that a loss is per token of that vocabulary (so runs compare only under the same tokenizer)."""
    where = cfg.data if cfg.data is not None else "the generated corpus"
    kind = {"file": "a text file", "prepared": "a prepared folder", "llm.c": "llm.c shards",
            "nanogpt": "nanoGPT's train.bin / val.bin"}[corpus.kind]
    tokenizer = corpus.tokenizer
    how = ("a token per byte" if tokenizer == "bytes" else "token ids alone (no tokenizer beside them)" if tokenizer is None
           else f"the characters of {Path(tokenizer).name}" if Path(tokenizer).name == "meta.pkl"
           else f"the tokenizer {Path(tokenizer).name}")
    return (f"data: {where} ({kind}), vocabulary {cfg.vocab_size:,}: {how}. The loss is per token of this "
            f"vocabulary: compare it only with runs of the same tokenizer")


def describe_layout(cfg, mesh, model) -> str:
    """Who holds what, one line per rank: its (dp, pp, cp, tp) coordinates, the blocks of its
    pipeline stage(s), and what tensor parallelism, context parallelism and ZeRO cut further; on
    several machines first which ranks each holds and which axes cross them (``mesh.machine_lines``)."""
    shape = mesh.shape
    counts = model.layers_per_stage if cfg.pp > 1 else [cfg.n_layer]
    starts = np.cumsum([0] + counts)
    held = []
    for pp_rank in range(shape.pp):
        stages = rank_stages(pp_rank, shape.pp, cfg.virtual_stages, placement_of(cfg.schedule))
        parts = ["embeddings"] if 0 in stages else []
        parts += [f"blocks {starts[s]}-{starts[s + 1] - 1}" if counts[s] > 1 else f"block {starts[s]}"
                  for s in stages]
        parts += ["ln_f, lm_head"] if len(counts) - 1 in stages else []
        held.append(", ".join(parts))
    sharded = ["optimizer states", "gradients and optimizer states", "parameters, gradients and optimizer states"]
    replicas = shape.dp * shape.cp
    cut = ([f"1/{shape.tp} of its matrices (tp)"] if shape.tp > 1 else []) + (
        [f"1/{replicas} of their {sharded[cfg.zero - 1]} (ZeRO-{cfg.zero})"] if cfg.zero else [])
    if cfg.offload != "none":
        where = f"files under {cfg.offload_dir}" if cfg.offload_dir else "host memory"
        what = "optimizer shard (masters, moments)" + (" and parameter shards" if cfg.offload != "optimizer" else "")
        cut.append(f"its {what} in {where}, updated there (offload)")
    pipeline = f", {cfg.schedule} schedule" if cfg.pp > 1 else ""
    cp = f" x cp {shape.cp}" if shape.cp > 1 else ""
    lines = [f"mesh: dp {shape.dp} x pp {shape.pp}{cp} x tp {shape.tp} = {shape.world} ranks, "
             f"per dp rank {cfg.micro_batches} micro-batch(es) x {cfg.batch_size // (cfg.dp * cfg.micro_batches)} "
             f"row(s){pipeline}"] + [f"  {line}" for line in mesh.machine_lines()]
    if shape.cp > 1:
        zigzag = cfg.cp_algorithm == "zigzag"
        lines.append(f"  every sequence of {cfg.block_size} tokens is cut over the cp ranks ({cfg.cp_algorithm}): "
                     + ", ".join(f"cp {c} tokens {token_ranges(sequence_chunks(cfg.block_size, cfg.cp, c, zigzag))}"
                                 for c in range(shape.cp)))
    if cfg.n_experts:
        lines.append(f"  experts: {cfg.n_experts} per MoE block, top-{cfg.top_k}" + (
            f", split over ep groups of {cfg.ep} dp ranks (tokens travel by all-to-all)" if cfg.ep > 1 else
            ", on every rank"))
    for rank in range(shape.world):
        d, p, c, t = shape.coords(rank)
        where = f"dp {d} pp {p}" + (f" cp {c}" if shape.cp > 1 else "") + f" tp {t}"
        block = ep_block(cfg.n_experts, d % cfg.ep, cfg.ep) if cfg.ep > 1 else None
        shards = f", sharded 1/{shape.dp // cfg.ep * shape.cp} by ZeRO" if cfg.zero and block else ""  # the expert-dp group
        experts = [f"experts {block.start}-{block.stop - 1} (ep {d % cfg.ep}){shards}"] if block else []
        lines.append(f"  rank {rank}: {where}  holds {held[p]}" + "".join(f"; {c}" for c in cut + experts))
    return "\n".join(lines)


def memory_table(state) -> str:
    """The model's state's bytes on this rank (parallel/state.py: ZeRO's paper's formula beside what the
    arrays hold: device memory, then under offload the host's and the disk's), and under mixed
    precision the paper's bytes per parameter (2 + 2 + K)."""
    device = ("parameters", "gradients", "optimizer")  # then the device's total, then host and disk if any
    table = format_memory_table([{"label": r["label"], **{k: r[k] for k in device}, "total": sum(r[k] for k in device),
                                  **{k: v for k, v in r.items() if k not in device + ("label",)}}
                                 for r in state.memory_rows()])
    if not state.mixed_precision:
        return table
    k = zero_memory.optimizer_bytes_per_parameter(state)
    b = state.shards[0].unit.dtype.itemsize
    emulated = " (bfloat16 emulated in float32 storage)" if b == 4 else ""
    return (table + f"\n(mixed precision, the paper's model: {state.mixed_precision} parameters and gradients, "
            f"{b} + {b} bytes{emulated}; float32 masters and {type(state.optimizer).__name__.lower()} state, K = {k} bytes per parameter)")
