"""The planner's words: a prediction and a search as text a learner reads in a terminal."""
from __future__ import annotations

from minidist.plan.hardware import GIB
from minidist.plan.layout import RunSpec
from minidist.plan.limits import TOO_LONG

MEMORY_COLUMNS = ("parameters", "gradients", "master_weights", "optimizer_states", "activations", "buffers", "total")


def human(nbytes: float) -> str:
    """1536 -> '1.5 KiB', 3 * 2**30 -> '3.0 GiB'."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes:.0f} B"


def describe_run(run: dict) -> str:
    """'dp 16 x pp 8 x cp 1 x tp 8 = 1024 ranks, ZeRO-1, SP, 1f1b, 16 micro-batches of 1 x 8192 tokens, bfloat16'."""
    r = RunSpec(**run)
    extras = [f"ZeRO-{r.zero}"] + (["SP"] if r.sequence_parallel else []) + (
        [f"recompute {r.recompute}"] if r.recompute != "none" else []) + (
        [f"{r.schedule}" + (f" v{r.virtual_stages}" if r.virtual_stages > 1 else "")] if r.pp > 1 else []) + (
        [f"ep {r.ep}"] if r.ep > 1 else []) + ([f"cp {r.cp_algorithm}"] if r.cp > 1 else []) + (
        [f"offload {r.offload} to {r.offload_to}"] if r.offload != "none" else [])
    return (f"dp {r.dp} x pp {r.pp} x cp {r.cp} x tp {r.tp} = {r.world} ranks, {', '.join(extras)}, "
            f"{r.micro_batches} micro-batch(es) of {r.micro_batch_size} x {r.seq} tokens, {r.dtype}")


def format_prediction(p: dict) -> str:
    """The prediction of :func:`~minidist.plan.predict.predict` as a few short tables."""
    lines = [f"{p['model']['name']}: {p['parameters'] / 1e9:.3f} B parameters" if p["parameters"] >= 1e8
             else f"{p['model']['name']}: {p['parameters']:,} parameters",
             f"layout: {describe_run(p['run'])}", f"hardware: {p['hardware']}" + (f" ({p['hardware_note']})" if p["hardware_note"] else ""),
             "", "memory per rank (pp rank: model states, activations in flight, ZeRO's working buffers)"]
    offload = "host" in p["per_rank_bytes"]
    columns = MEMORY_COLUMNS + (("host", "disk") if offload else ())
    lines.append("pp rank " + "".join(f"{c.replace('_', ' '):>17}" for c in columns))
    for r, row in enumerate(p["per_pp_rank"]):
        lines.append(f"{r:>7} " + "".join(f"{human(row[c]):>17}" for c in columns))
    verdict = "fits" if p["fits"] else "does NOT fit"
    lines += [f"largest rank: {human(p['per_rank_bytes']['total'])}, {verdict} in {human(p['memory_bytes'])}", "",
              f"activations of one layer, one micro-batch, one rank: {human(p['activation_bytes_per_layer'])}"]
    lines += [f"  {what:<52} {human(v):>12}" for what, v in p["activation_terms"].items()]
    lines += ["", "bytes each rank sends per step (pp rank 0): " + ", ".join(
        f"{axis} {human(v)}" for axis, v in p["comm_bytes_per_step"].items() if v)]
    t = p["time_breakdown"]
    lines += ["", f"step {t['total']:.4g} s: forward/backward and pipeline {t['pipeline']:.4g} s (bubble "
              f"{100 * p['bubble']:.1f}%, {t['bubble']:.3g} s idle), data-parallel sync exposed {t['dp_exposed']:.3g} s, "
              f"optimizer {t['optimizer']:.3g} s",
              f"{p['tokens_per_s']:,.0f} tokens/s, MFU {100 * p['mfu']:.1f}%"]
    return "\n".join(lines)


def format_search(model, hw, gpus: int, batch: int, limit: float, fits: list, rejected: list, top: int) -> str:
    """The fastest ``top`` layouts that fit, then how many failed and why (grouped by reason)."""
    lines = [f"{model.name} on {gpus} x {hw.name} ({limit / GIB:.0f} GiB each), global batch {batch} sequences: "
             f"{len(fits)} layouts fit, {len(rejected)} do not", "",
             f"{'dp':>5} {'tp':>3} {'pp':>3} {'cp':>3} {'ep':>3} {'zero':>4} {'recompute':>9} {'schedule':>13} {'m':>5}"
             f" {'memory':>10} {'step s':>8} {'MFU':>6} {'bubble':>7}"]
    for p in fits[:top]:
        r = p["run"]
        schedule = r["schedule"] + (f" v{r['virtual_stages']}" if r["virtual_stages"] > 1 else "") if r["pp"] > 1 else "-"
        lines.append(f"{r['dp']:>5} {r['tp']:>3} {r['pp']:>3} {r['cp']:>3} {r['ep']:>3} {r['zero']:>4} {r['recompute']:>9} "
                     f"{schedule:>13} {r['micro_batches']:>5} {human(p['per_rank_bytes']['total']):>10} "
                     f"{p['step_time_s']:>8.3g} {100 * p['mfu']:>5.1f}% {100 * p['bubble']:>6.1f}%")
    kinds = {}
    for run, why in rejected:
        kind = why.split(" ")[0] if "GiB" in why else TOO_LONG if TOO_LONG in why else why
        kinds.setdefault(kind, []).append((run, why))
    lines += ["", "rejected, by reason (first example of each):"]
    for kind, items in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        run, why = items[0]
        lines.append(f"  {len(items):>5} x {why}   e.g. dp {run.dp} tp {run.tp} pp {run.pp} cp {run.cp} "
                     f"ZeRO-{run.zero} recompute {run.recompute}")
    return "\n".join(lines)
