"""Scale planner benchmark: the planner's predictions against minidist's own runs, and at scale against papers.

    python benchmarks/plan.py                  (about 2.5 minutes on 2 idle cores)
    python benchmarks/plan.py --quick          (fewer layouts, 2 rounds, no search; files go to $TMPDIR)
    python benchmarks/plan.py --parts scale search     (the paper tables alone, no training)
    python benchmarks/plan.py --from benchmarks/results/plan.json     (reprint the tables, redraw the figure)

Four parts (``--parts``):

  timing   predicted against measured step time on this machine. For each layout of minidist's default
           GPT (2 layers, 64 wide, 4 heads, T 64, batch 16, float32, AdamW) and of a bigger one (4
           layers, 128 wide), ``OMP_NUM_THREADS=1 mpiexec -n N python -m minidist.train <flags>
           --steps 40 --eval-every 1000 --sample-tokens 0 --out DIR``; the measured step is the median of
           batch_size x block_size / tokens_per_s from DIR/metrics.jsonl over the steps after the first 5,
           without the last (rank 0's clock around train_step). Each layout runs ``--reps`` times,
           round-robin over the layouts (every round runs every layout once), so load hits all alike.
           The prediction is ``minidist.plan.predict(from_gpt_config(cfg), run_spec_of(cfg), "local")``:
           the local profile (minidist/plan/calibrate.py) times, in this process on its one BLAS thread,
           the forward + backward of one tp rank's share of a ``minidist.model.Block`` (Linears cut as tp
           cuts them) and of the embeddings + head + loss (vocabulary / tp), at the run's micro-batch
           rows, seq / cp, C, F, heads and dtype (16-bit: minidist's storage); timing.py charges a third
           of each forward and two thirds backward, slowed by ranks / cores, plus the modelled traffic
           (nothing overlaps) and the optimizer. The profile is measured once per shape, before any
           training run starts. The table shows the profile's block and head milliseconds, the
           predicted step and the part of it that is modelled traffic (the prediction again with free
           links). Ratio = measured / predicted, per round; the table shows the median, min and max over
           rounds.
  exact    the quantities the planner counts exactly: model-state bytes per rank, one micro-batch's
           activation bytes (no pipeline) and bytes sent per axis per step, predicted against
           ``minidist.train.measure.measure(cfg)`` (the same layouts, on threads, in this process).
  scale    no measurement, the planner's output beside published numbers: (a) the ZeRO paper's Figure 1
           (7.5B parameters, N_d = 64, mixed-precision Adam); (b) Llama 3 405B in Meta's layouts (TP 8,
           PP 16, DP 128 or 64, sequence 8192, bf16, ZeRO-1, sequence parallel, interleaved schedule) on
           the H100 profile (fused attention, 70% GEMM efficiency): MFU against Meta's, the step's time
           broken down, memory per rank (minidist's activations, and Korthikanti's with ``dropout``:
           the step time does not depend on it).
  search   the wall time of ``python -m minidist.plan --model llama3-70b --seq 8192 --search --gpus 1024
           --global-batch-size 1024`` and its five fastest layouts.

Writes benchmarks/results/plan.json and benchmarks/figures/plan.png (--quick: the same names under
$TMPDIR/minidist-plan-quick/), and prints the tables of the RESULTS.md section.
"""
import argparse
import dataclasses
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# one BLAS thread, as the training runs use: set before NumPy loads, or the local profile's matmul speed is
# that of every core (calibrate.py measures in this process, with whatever threads NumPy was given)
os.environ["OMP_NUM_THREADS"] = "1"
import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from minidist.inspect.accounting import zero_formula  # noqa: E402
from minidist.plan import RunSpec, from_gpt_config, predict, preset  # noqa: E402
from minidist.plan import comm, timing  # noqa: E402
from minidist.plan.comm import comm_bytes_per_step  # noqa: E402
from minidist.plan.hardware import GIB, PROFILES  # noqa: E402
from minidist.plan.memory import activation_bytes_per_layer, layer_activation_terms, model_state_bytes  # noqa: E402
from minidist.plan.models import ModelSpec, layers_per_stage, parameter_count  # noqa: E402
from minidist.plan.predict import hardware_profile  # noqa: E402
from minidist.train.config import TrainConfig  # noqa: E402

PARTS = ("timing", "exact", "scale", "search")
SKIP = 5  # warm-up steps left out of the median (and the last step: it evaluates after)
BIG = dict(n_layer=4, n_embd=128)

# name -> (the model's and layout's TrainConfig fields); the world is dp x pp x cp x tp
LAYOUTS = {
    "1 rank": {},
    "dp 2": dict(dp=2),
    "tp 2": dict(tp=2),
    "tp 2 SP": dict(tp=2, sequence_parallel=True),
    "pp 2, m 4": dict(pp=2, micro_batches=4),
    "cp 2 (ring)": dict(cp=2),
    "dp 2 ZeRO-3": dict(dp=2, zero=3),
    "dp 2 bf16": dict(dp=2, dtype="bfloat16"),
    "dp 2 fp16 ZeRO-1": dict(dp=2, dtype="float16", zero=1),
    "dp 4": dict(dp=4),
    "dp 2 x tp 2": dict(dp=2, tp=2),
    "dp 2 x pp 2, m 4": dict(dp=2, pp=2, micro_batches=4),
    "big: 1 rank": dict(BIG),
    "big: dp 2": dict(BIG, dp=2),
    "big: tp 2": dict(BIG, tp=2),
    "big: pp 2, m 4": dict(BIG, pp=2, micro_batches=4),
    "big: dp 2 x tp 2": dict(BIG, dp=2, tp=2),
}
QUICK_LAYOUTS = ("1 rank", "dp 2", "tp 2", "pp 2, m 4", "dp 2 ZeRO-3", "dp 2 x tp 2", "big: 1 rank")


def config(fields: dict) -> TrainConfig:
    return TrainConfig(**fields)


def world_of(cfg) -> int:
    return cfg.dp * cfg.pp * cfg.cp * cfg.tp


def train_flags(fields: dict) -> list[str]:
    flags = []
    for key, value in fields.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def spec_of(cfg):
    from minidist.plan.layout import run_spec_of
    return from_gpt_config(cfg), run_spec_of(cfg)


# ---- part 1: predicted against measured step time ---------------------------------------------------

def train_once(mpiexec: str, fields: dict, steps: int, out: Path) -> dict:
    """One ``python -m minidist.train`` run; its median step time after the warm-up."""
    cfg = config(fields)
    if out.exists():
        shutil.rmtree(out)
    cmd = [mpiexec, "-n", str(world_of(cfg)), sys.executable, "-m", "minidist.train", *train_flags(fields),
           "--steps", str(steps), "--eval-every", "1000", "--sample-tokens", "0", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    seconds = [cfg.batch_size * cfg.block_size / r["tokens_per_s"] for r in records[SKIP:-1]]
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "wall_s": wall}


def free_links(hw):
    """``hw`` with links that cost nothing: the prediction with it is the step without its traffic."""
    return dataclasses.replace(hw, intra_bandwidth=float("inf"), inter_bandwidth=float("inf"), intra_latency=0.0,
                               inter_latency=0.0)


def part_timing(layouts, reps: int, steps: int, scratch: Path) -> dict:
    from minidist.launchers import find_mpiexec
    mpiexec = find_mpiexec()
    rows = {}
    t0 = time.perf_counter()
    for name in layouts:  # every prediction (and calibration) before any training run
        cfg = config(LAYOUTS[name])
        model, run = spec_of(cfg)
        p = predict(model, run, "local")
        assert not p["problems"], (name, p["problems"])
        hw = hardware_profile("local", model, run)  # the profile predict used (cached per shape)
        rows[name] = {"fields": LAYOUTS[name], "ranks": world_of(cfg), "run": dataclasses.asdict(run),
                      "predicted_s": p["step_time_s"], "breakdown": p["time_breakdown"],
                      "shape": {"rows": run.micro_batch_size, "seq": run.seq // run.cp, "C": model.n_embd,
                                "F": model.hidden, "tp": run.tp, "dtype": run.dtype},
                      "traffic_s": p["step_time_s"] - timing.step_time(model, run, free_links(hw))["total"],
                      "local_profile": dict(vars(hw)), "measured": []}
    calibration_s = time.perf_counter() - t0
    for rnd in range(reps):
        for name in layouts:
            m = train_once(mpiexec, LAYOUTS[name], steps, scratch / "run")
            rows[name]["measured"].append(m)
            print(f"  round {rnd + 1}/{reps} {name:<20} measured {1e3 * m['median_s']:8.2f} ms, predicted "
                  f"{1e3 * rows[name]['predicted_s']:8.2f} ms ({m['wall_s']:.1f} s)", flush=True)
    for row in rows.values():
        ratios = [m["median_s"] / row["predicted_s"] for m in row["measured"]]
        row["measured_median_s"] = statistics.median(m["median_s"] for m in row["measured"])
        row["measured_min_s"] = min(m["median_s"] for m in row["measured"])
        row["measured_max_s"] = max(m["median_s"] for m in row["measured"])
        row["ratio"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return {"layouts": rows, "calibration_s": calibration_s, "steps": steps, "reps": reps}


# ---- part 2: the exact quantities --------------------------------------------------------------------

def part_exact(layouts) -> dict:
    from minidist.train.measure import measure
    rows = {}
    for name in layouts:
        cfg = config(LAYOUTS[name])
        model, run = spec_of(cfg)
        p = predict(model, run, PROFILES["h100"])  # bytes do not depend on the hardware
        measured = measure(cfg)
        diffs = {"model_states": [], "activations": [], "comm": []}
        for rank in measured:
            dp, pp, cp, tp = rank["coords"]
            want = model_state_bytes(model, run, pp, dp * run.cp + cp)
            for key, got in rank["model_states"].items():
                if got != want.get(key, 0):
                    diffs["model_states"].append(f"rank {rank['coords']} {key}: measured {got:,} predicted "
                                                 f"{want.get(key, 0):,.0f}")
            if rank["activations"] is not None and rank["activations"] != p["per_pp_rank"][pp]["activations"]:
                diffs["activations"].append(f"rank {rank['coords']}: measured {rank['activations']:,} "
                                            f"predicted {p['per_pp_rank'][pp]['activations']:,.0f}")
            if dp == 0:
                sent = comm_bytes_per_step(model, run, pp)
                for axis in sorted(set(sent) | set(rank["comm_bytes_per_step"])):
                    got, want_b = rank["comm_bytes_per_step"].get(axis, 0.0), sent.get(axis, 0.0)
                    if abs(got - want_b) > 1e-6 * max(1.0, want_b):
                        diffs["comm"].append(f"rank {rank['coords']} {axis}: measured {got:,.0f} predicted "
                                             f"{want_b:,.0f}")
        r0 = measured[0]
        rows[name] = {"ranks": len(measured), "diffs": diffs,
                      "rank0": {"model_states": r0["model_states"], "activations": r0["activations"],
                                "comm_bytes_per_step": r0["comm_bytes_per_step"]},
                      "predicted_rank0": {"model_states": {k: p["per_pp_rank"][0][k] for k in
                                                           ("parameters", "gradients", "master_weights",
                                                            "optimizer_states")},
                                          "activations": p["per_pp_rank"][0]["activations"],
                                          "comm_bytes_per_step": p["comm_bytes_per_step"]}}
        status = {k: "yes" if not v else f"{len(v)} differ" for k, v in diffs.items()}
        print(f"  {name:<20} {status}", flush=True)
    return rows


# ---- part 3: at scale, beside the papers -------------------------------------------------------------

def zero_figure1() -> dict:
    """ZeRO paper Figure 1: 7.5B parameters, N_d = 64, mixed-precision Adam (K = 12): 120, 31.4, 16.6,
    1.9 GB per device for stages 0-3. The formula for 7.5e9 parameters, and the planner's unit-by-unit
    count for a GPT of about that size (36 layers, 4096 wide, as a ModelSpec)."""
    psi, n = 7.5e9, 64
    paper = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    gpt = ModelSpec("gpt-7.5b", n_layer=36, n_embd=4096, n_head=32, vocab_size=50257, block_size=2048)
    rows = []
    for stage in range(4):
        formula = zero_formula(stage, 2 * psi, 12 * psi, n)
        run = RunSpec(seq=2048, dp=n, zero=stage, dtype="float16")
        held = model_state_bytes(gpt, run)
        rows.append({"stage": stage, "paper_gb": paper[stage], "formula_gb": sum(formula.values()) / 1e9,
                     "formula_parts_gb": {k: v / 1e9 for k, v in formula.items()},
                     "planner_gb": sum(held.values()) / 1e9, "planner_parts_gb": {k: v / 1e9 for k, v in held.items()}})
    return {"parameters_formula": psi, "planner_model": dataclasses.asdict(gpt),
            "planner_parameters": parameter_count(gpt), "rows": rows}


def time_components(model, run, hw) -> dict:
    """The step of ``run`` taken apart (timing.py's terms). step_time charges every chunk the mean
    chunk of the busiest pipeline rank, so: that rank's chunks' forward + backward per micro-batch
    split into GEMMs, attention scores, memory passes (minidist's activations without dropout; no
    attention probabilities where ``hw.flash_attention``), fixed overhead, recompute, exposed tp, cp,
    ep and pp traffic and the head, scaled to the rank's busy time (chunks x micro-batches); then the
    bubble, the exposed data-parallel sync and the optimizer. Sums to the planner's step time."""
    costs = timing.stage_costs(model, run, hw)
    stages = timing.busiest_stages(run, costs) if run.pp > 1 else [0]
    busiest = stages[0] % run.pp if run.pp > 1 else 0  # (its first stage's rank)
    counts = layers_per_stage(model, run.n_stages)
    slow = max(1.0, run.world / hw.cores) if hw.cores else 1.0  # timing._slowdown
    written = dataclasses.replace(run, recompute="selective" if hw.flash_attention else "none", dropout=False)
    kept = dataclasses.replace(run, recompute="none", dropout=False)
    parts = dict.fromkeys(("GEMMs at 70% of peak", "attention scores (full square)", "memory passes",
                           "of which the attention probabilities", "fixed overhead", "recompute", "TP exposed",
                           "CP exposed", "EP exposed", "PP sends", "LM head + loss"), 0.0)
    for stage in stages:
        first = sum(counts[:stage])
        for layer in range(first, first + counts[stage]):
            f, core = timing.block_forward_time(model, run, hw, layer)
            passes = 3 * activation_bytes_per_layer(model, written, layer) / (hw.memory_bandwidth / slow)
            overhead = hw.layer_overhead * slow
            parts["GEMMs at 70% of peak"] += 3 * (f - core - passes - overhead / 3)
            parts["attention scores (full square)"] += 3 * core
            parts["memory passes"] += 3 * passes
            if not hw.flash_attention:
                terms = dict(layer_activation_terms(model, kept, layer))
                probabilities = sum(v for k, v in terms.items() if "probabilities" in k and "router" not in k)
                parts["of which the attention probabilities"] += 9 * probabilities / (hw.memory_bandwidth / slow)
            parts["fixed overhead"] += overhead
            parts["recompute"] += {"none": 0.0, "selective": core, "full": f}[run.recompute]
            parts["TP exposed"] += timing.tp_time_per_block(model, run, hw)
            parts["CP exposed"] += timing.cp_exposed_per_block(model, run, hw, core)
            if run.ep > 1 and model.is_moe(layer):
                routed = comm.one_way(comm.activation(model, run) * model.top_k, run.ep)
                parts["EP exposed"] += (2 * run.forwards + 2) * timing.transfer_time(hw, run, "ep", routed,
                                                                                            run.ep - 1)
        if stage == run.n_stages - 1:
            parts["LM head + loss"] = 3 * timing.head_forward_time(model, run, hw)  # its fixed overhead included
    x_pp = comm.activation(model, run) / (run.tp if run.sequence_parallel else 1)
    parts["PP sends"] = 2 * len(stages) * timing.transfer_time(hw, run, "pp", x_pp) if run.pp > 1 else 0.0
    charged = sum(sum(costs[s]) for s in stages)
    total = sum(parts.values()) - parts["of which the attention probabilities"]
    assert abs(total - charged) < 1e-9 * charged, (parts, charged)
    t = timing.step_time(model, run, hw)
    busy = t["pipeline"] - t["bubble"]  # = micro-batches x the busiest rank's chunks' F + B
    scale = busy / charged
    out = {k: v * scale for k, v in parts.items()}
    out.update({"pipeline bubble": t["bubble"], "DP exposed": t["dp_exposed"], "optimizer": t["optimizer"]})
    assert abs(sum(out.values()) - out["of which the attention probabilities"] - t["total"]) < 1e-6 * t["total"]
    tokens = run.global_batch * run.seq
    ideal = timing.model_flops_per_token(model, run.seq) * tokens / run.world / hw.flops
    return {"busiest_rank": busiest, "stages": stages, "layers_per_chunk": [counts[s] for s in stages],
            "layers_on_rank": sum(counts[s] for s in stages), "max_layers_per_stage": max(counts),
            "micro_batches_charged": scale, "seconds": out, "total": t["total"],
            "model_flops_at_peak_s": ideal, "model_flops_at_70_percent_s": ideal / hw.matmul_efficiency}


def llama_runs() -> dict:
    base = dict(seq=8192, micro_batch_size=1, tp=8, pp=16, cp=1, zero=1, dtype="bfloat16",
                sequence_parallel=True, schedule="interleaved")
    return {  # Llama 3 paper, Table 4: GPUs, TP, CP, PP, DP, seq, batch/DP, TFLOPs/GPU, BF16 MFU
        "16,384 GPUs, DP 128 (41%)": dict(base, dp=128, micro_batches=16),
        "8,192 GPUs, DP 64 (43%)": dict(base, dp=64, micro_batches=32),
    }


META_TABLE4 = [  # Llama 3 paper (Dubey et al. 2024), Table 4
    {"gpus": 8192, "tp": 8, "cp": 1, "pp": 16, "dp": 64, "seq": 8192, "batch_per_dp": 32, "tflops": 430, "mfu": 0.43},
    {"gpus": 16384, "tp": 8, "cp": 1, "pp": 16, "dp": 128, "seq": 8192, "batch_per_dp": 16, "tflops": 400, "mfu": 0.41},
    {"gpus": 16384, "tp": 8, "cp": 16, "pp": 16, "dp": 8, "seq": 131072, "batch_per_dp": 16, "tflops": 380, "mfu": 0.38},
]


def part_scale() -> dict:
    out = {"zero_figure1": zero_figure1(), "meta_table4": META_TABLE4}
    model, hw = preset("llama3-405b"), PROFILES["h100"]
    rows = []
    for name, fields in llama_runs().items():
        for v in (1, 2, 4, 7):
            for recompute in ("none", "selective", "full"):
                for dropout in (False, True):
                    run = RunSpec(**dict(fields, virtual_stages=v, recompute=recompute, dropout=dropout,
                                         schedule="1f1b" if v == 1 else "interleaved"))
                    p = predict(model, run, hw)
                    if p["problems"]:
                        rows.append({"layout": name, "run": dataclasses.asdict(run), "problems": p["problems"]})
                        continue
                    rows.append({"layout": name, "run": dataclasses.asdict(run), "mfu": p["mfu"],
                                 "tflops_per_gpu": p["mfu"] * hw.flops / 1e12, "step_s": p["step_time_s"],
                                 "tokens_per_s": p["tokens_per_s"], "bubble": p["bubble"],
                                 "time_breakdown": p["time_breakdown"], "per_rank_bytes": p["per_rank_bytes"],
                                 "per_pp_rank_total_gib": [r["total"] / GIB for r in p["per_pp_rank"]],
                                 "fits": p["fits"], "comm_bytes_per_step": p["comm_bytes_per_step"],
                                 "components": time_components(model, run, hw)})
    out["llama3_405b"] = rows
    out["parameters_405b"] = parameter_count(model)
    out["flops_per_token"] = timing.model_flops_per_token(model, 8192)
    out["attention_share_of_flops"] = 12 * model.n_layer * model.n_embd * 8192 / out["flops_per_token"]
    out["h100_profile"] = {k: v for k, v in vars(hw).items()}
    return out


# ---- part 4: the search's wall time ------------------------------------------------------------------

SEARCH = ["--model", "llama3-70b", "--seq", "8192", "--search", "--gpus", "1024", "--global-batch-size", "1024"]


def part_search() -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "minidist.plan", *SEARCH, "--top", "5"], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    print(done.stdout, flush=True)
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["dp", "tp"])
    top = [line for line in lines[header + 1:header + 6]]
    counts = re.search(r"(\d+) layouts fit, (\d+) do not", done.stdout)
    return {"command": "python -m minidist.plan " + " ".join(SEARCH), "wall_s": wall, "stdout": done.stdout,
            "header": lines[header], "top5": top, "fit": int(counts[1]), "rejected": int(counts[2])}


# ---- the tables and the figure -----------------------------------------------------------------------

def gib(x):
    return f"{x / GIB:.1f}"


def print_tables(results: dict) -> None:
    if "timing" in results:
        t = results["timing"]
        print(f"\n### Predicted against measured step time ({t['reps']} rounds, {t['steps']} steps each)\n")
        print("| layout | ranks | profile: block, head ms (rows x seq / cp, C, tp) | predicted ms (of which traffic) | "
              "measured ms, median (min-max of rounds) | measured / predicted, median (min-max) |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, r in t["layouts"].items():
            g, hw = r["shape"], r["local_profile"]
            timed = (f"{1e3 * hw['block_seconds']:.2f}, {1e3 * hw['head_seconds']:.2f}" if hw["block_seconds"]
                     else "not timed (FLOPs)")
            print(f"| {name} | {r['ranks']} | {timed} "
                  f"({g['rows']} x {g['seq']}, {g['C']}, tp {g['tp']}) | "
                  f"{1e3 * r['predicted_s']:.2f} ({1e3 * r['traffic_s']:.2f}) | {1e3 * r['measured_median_s']:.2f} "
                  f"({1e3 * r['measured_min_s']:.2f}-{1e3 * r['measured_max_s']:.2f}) | {r['ratio']['median']:.2f} "
                  f"({r['ratio']['min']:.2f}-{r['ratio']['max']:.2f}) |")
        ratios = sorted(r["ratio"]["median"] for r in t["layouts"].values())
        print(f"\nmedians of measured / predicted: {ratios[0]:.2f} to {ratios[-1]:.2f}, median of them "
              f"{statistics.median(ratios):.2f}; calibration took {t['calibration_s']:.1f} s")
    if "exact" in results:
        print("\n### Exact quantities, predicted = measured\n")
        print("| layout | ranks | model states | activations (no pp) | bytes per axis | rank 0: states, "
              "activations, sent per axis (bytes) |")
        print("|---|---:|---|---|---|---|")
        for name, r in results["exact"].items():
            cells = []
            for key in ("model_states", "activations", "comm"):
                d = r["diffs"][key]
                skip = key == "activations" and r["rank0"]["activations"] is None
                cells.append("(pp)" if skip else "yes" if not d else "no: " + summary(d))
            r0 = r["rank0"]
            sent = ", ".join(f"{a} {v:,.0f}" for a, v in r0["comm_bytes_per_step"].items() if v) or "nothing sent"
            acts = "-" if r0["activations"] is None else f"{r0['activations']:,}"
            print(f"| {name} | {r['ranks']} | {' | '.join(cells)} | {sum(r0['model_states'].values()):,}, "
                  f"{acts}, {sent} |")
    if "scale" in results:
        s = results["scale"]
        z = s["zero_figure1"]
        print("\n### ZeRO paper Figure 1 (7.5B parameters, N_d = 64, mixed-precision Adam), GB = 1e9 bytes\n")
        print(f"| stage | paper | zero_formula(7.5e9) | planner, GPT {z['planner_parameters'] / 1e9:.2f}B "
              f"(36 x 4096) | planner's parts (params, grads, masters, moments) |")
        print("|---:|---:|---:|---:|---|")
        for r in z["rows"]:
            parts = ", ".join(f"{v:.2f}" for v in r["planner_parts_gb"].values())
            print(f"| {r['stage']} | {r['paper_gb']} | {r['formula_gb']:.2f} | {r['planner_gb']:.2f} | {parts} |")
        print("\n### Llama 3 405B, H100 profile (memory: minidist's activations / Korthikanti's with --dropout; "
              "the time does not depend on it)\n")
        print("| layout (Meta's MFU) | schedule | recompute | MFU | TFLOP/s per GPU | step s | bubble | "
              "largest rank GiB: minidist / Korthikanti (activations) | fits 80 GiB |")
        print("|---|---|---|---:|---:|---:|---:|---:|---|")
        rows = [r for r in s["llama3_405b"] if "problems" not in r]
        for r in rows:
            run = r["run"]
            if run["dropout"]:
                continue
            k = next(x for x in rows if x["run"] == dict(run, dropout=True))
            sched = "1f1b" if run["virtual_stages"] == 1 else f"interleaved v{run['virtual_stages']}"
            b, bk = r["per_rank_bytes"], k["per_rank_bytes"]
            same = abs(r["step_s"] - k["step_s"]) <= 1e-9 * r["step_s"]
            mfu = f"{100 * r['mfu']:.1f}%" + ("" if same else f" (dropout: {100 * k['mfu']:.1f}%)")
            print(f"| {r['layout']} | {sched} | {run['recompute']} | {mfu} | "
                  f"{r['tflops_per_gpu']:.0f} | {r['step_s']:.2f} | "
                  f"{100 * r['bubble']:.1f}% | {gib(b['total'])} ({gib(b['activations'])}) / {gib(bk['total'])} "
                  f"({gib(bk['activations'])}) | {'yes' if r['fits'] else 'no'} / {'yes' if k['fits'] else 'no'} |")
        pick = main_405b(s)
        c = pick["components"]
        print(f"\n### Where the step goes: {pick['layout']}, interleaved v{pick['run']['virtual_stages']}, "
              f"recompute {pick['run']['recompute']}\n")
        print("| part | seconds | share |")
        print("|---|---:|---:|")
        for k, v in c["seconds"].items():
            if not v and k in ("of which the attention probabilities", "CP exposed", "EP exposed"):
                continue
            name = f"  ({k})" if k.startswith("of which") else k
            print(f"| {name} | {v:.3f} | {100 * v / c['total']:.1f}% |")
        print(f"| total | {c['total']:.3f} | 100% |")
        print(f"\nmodel FLOPs per GPU at 100% of peak: {c['model_flops_at_peak_s']:.3f} s (= MFU x step); at 70%: "
              f"{c['model_flops_at_70_percent_s']:.3f} s; busiest pipeline rank {c['busiest_rank']}: chunks of "
              f"{c['layers_per_chunk']} layers ({c['layers_on_rank']} in all; the largest stage has "
              f"{c['max_layers_per_stage']}), each charged {c['micro_batches_charged']:.0f} times (micro-batches)")
    if "search" in results:
        s = results["search"]
        print(f"\n### `{s['command']}`: {s['wall_s']:.1f} s, {s['fit']} layouts fit, {s['rejected']} rejected\n")
        print("    " + s["header"])
        for line in s["top5"]:
            print("    " + line)


def summary(diffs: list[str]) -> str:
    """'measured = 2.00 x predicted (parameters, gradients; 2 ranks)' from part_exact's difference lines."""
    ratios, what, ranks = set(), [], set()
    for line in diffs:
        m = re.match(r"rank (\(.*?\)) ?(\w*): measured ([\d,.]+) predicted ([\d,.]+)", line)
        ranks.add(m[1])
        what.append(m[2] or "activations")
        ratios.add(f"{float(m[3].replace(',', '')) / float(m[4].replace(',', '')):.2f}")
    return (f"measured = {' / '.join(sorted(ratios))} x predicted ({', '.join(dict.fromkeys(what))}; "
            f"{len(ranks)} rank(s))")


def main_405b(scale: dict) -> dict:
    """The 16K-GPU layout, interleaved v2, selective recompute, minidist's activations."""
    return next(r for r in scale["llama3_405b"] if r["layout"].startswith("16,384") and "problems" not in r
                and r["run"]["virtual_stages"] == 2 and r["run"]["recompute"] == "selective" and not r["run"]["dropout"])


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in ("timing", "scale", "mfu") if p in results or (p == "mfu" and "scale" in results)]
    if not panels:
        return
    widths = {"timing": 7.5, "scale": 6.5, "mfu": 5.5}
    fig, axes = plt.subplots(1, len(panels), figsize=(sum(widths[p] for p in panels), 6.4), squeeze=False,
                             gridspec_kw={"width_ratios": [widths[p] for p in panels]})
    axes = list(axes[0])
    if "timing" in results:
        ax = axes.pop(0)
        rows = results["timing"]["layouts"]
        names = list(rows)[::-1]
        y = np.arange(len(names))
        pred = [1e3 * rows[n]["predicted_s"] for n in names]
        med = np.array([1e3 * rows[n]["measured_median_s"] for n in names])
        lo = med - [1e3 * rows[n]["measured_min_s"] for n in names]
        hi = np.array([1e3 * rows[n]["measured_max_s"] for n in names]) - med
        ax.scatter(pred, y, marker="D", s=36, facecolors="none", edgecolors="tab:blue", zorder=3,
                   label="predicted (--hardware local)")
        ax.errorbar(med, y, xerr=[lo, hi], fmt="o", color="tab:orange", ms=6, capsize=3, zorder=2,
                    label="measured: median of rounds (bars: min-max)")
        right = 1.6 * max(max(pred), max(med + hi))
        for yi, n in zip(y, names):
            ax.annotate(f"x{rows[n]['ratio']['median']:.2f}", (right, yi), ha="right", va="center", fontsize=8)
        ax.set_xscale("log")
        ax.set_xlim(0.7 * min(min(pred), min(med - lo)), right * 1.05)
        ax.set_yticks(y, [f"{n} ({rows[n]['ranks']} rk)" for n in names], fontsize=8)
        ax.set_xlabel("ms per step (log); right: measured / predicted, median of rounds")
        ax.set_title("minidist GPT on this 2-core machine\n(default: 2L 64d; big: 4L 128d; T 64, batch 16)",
                     fontsize=10)
        ax.grid(True, axis="x", which="both", alpha=0.3)
        ax.grid(True, axis="y", alpha=0.15)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=1)
    if "scale" in results:
        ax = axes.pop(0)
        wanted = [("none", False), ("selective", False), ("selective", True), ("full", False)]
        model, hw = preset("llama3-405b"), PROFILES["h100"]
        base = llama_runs()["16,384 GPUs, DP 128 (41%)"]
        labels, stacks = [], []
        keys = ("parameters", "gradients", "master_weights", "optimizer_states", "activations", "buffers")
        for recompute, dropout in wanted:
            run = RunSpec(**dict(base, virtual_stages=2, recompute=recompute, dropout=dropout))
            held = predict(model, run, hw)["per_rank_bytes"]
            labels.append(f"{recompute}\n{'Korthikanti' if dropout else 'minidist'}")
            stacks.append([held[k] / GIB for k in keys])
        x = np.arange(len(labels))
        bottom = np.zeros(len(labels))
        for i, k in enumerate(keys):
            vals = np.array([s[i] for s in stacks])
            ax.bar(x, vals, 0.6, bottom=bottom, label=k.replace("_", " "))
            bottom += vals
        for xi, total in zip(x, bottom):
            ax.annotate(f"{total:.0f}", (xi, total), ha="center", va="bottom", fontsize=9)
        ax.set_ylim(top=1.08 * max(bottom))
        ax.axhline(80, color="black", ls="--", lw=1)
        ax.annotate("80 GiB (H100)", (x[-1] + 0.35, 80), va="bottom", ha="right", fontsize=8)
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylabel("GiB on the largest pipeline rank")
        ax.set_title("Llama 3 405B, TP 8 x PP 16 x DP 128, interleaved v2,\nbf16, ZeRO-1, SP, seq 8192: "
                     "memory per rank by recompute", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    if "scale" in results:  # the predicted MFU by schedule beside Meta's
        ax = axes.pop(0)
        rows = [r for r in results["scale"]["llama3_405b"] if "problems" not in r and not r["run"]["dropout"]
                and r["run"]["recompute"] == "selective"]
        layouts = list(dict.fromkeys(r["layout"] for r in rows))
        schedules = sorted({r["run"]["virtual_stages"] for r in rows})
        width = 0.8 / len(schedules)
        x = np.arange(len(layouts))
        for i, v in enumerate(schedules):
            vals = [100 * next(r["mfu"] for r in rows if r["layout"] == lay and r["run"]["virtual_stages"] == v)
                    for lay in layouts]
            bars = ax.bar(x + (i - (len(schedules) - 1) / 2) * width, vals, width,
                          label="1F1B" if v == 1 else f"interleaved v{v}")
            for b, val in zip(bars, vals):
                ax.annotate(f"{val:.0f}", (b.get_x() + b.get_width() / 2, val - 1), ha="center", va="top", fontsize=8,
                            color="white", fontweight="bold")
        for xi, lay in zip(x, layouts):
            meta = float(re.search(r"\((\d+)%\)", lay)[1])
            ax.hlines(meta, xi - 0.45, xi + 0.45, color="black", ls="--", lw=1.2,
                      label="Meta (Llama 3 paper, Table 4)" if xi == 0 else None)
        ax.set_xticks(x, [lay.split(" (")[0].replace(", ", "\n") for lay in layouts], fontsize=9)
        ax.set_ylabel("BF16 MFU, % (H100 profile, selective recompute)")
        ax.set_ylim(0, 60)
        ax.set_title("Llama 3 405B, TP 8 x PP 16, seq 8192:\nplanner's MFU by schedule beside Meta's", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def planner_version() -> dict:
    """The commit this ran on and the planner's files that differ from it (another engineer may be editing them)."""
    def git(*args):
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else None
    return {"commit": git("rev-parse", "HEAD"), "dirty": git("status", "--porcelain", "minidist/plan")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--quick", action="store_true", help="fewer layouts, 2 rounds of 20 steps, no search")
    ap.add_argument("--reps", type=int, help="interleaved rounds per layout (default 3; --quick 2)")
    ap.add_argument("--steps", type=int, help="steps per training run (default 40; --quick 20)")
    ap.add_argument("--json", help="default: benchmarks/results/plan.json")
    ap.add_argument("--png", help="default: benchmarks/figures/plan.png")
    ap.add_argument("--from", dest="source", help="print the tables and draw the figure from this JSON, run nothing")
    args = ap.parse_args()
    if args.source:
        results = json.loads(Path(args.source).read_text())
        print_tables(results)
        plot(results, Path(args.png or HERE / "figures" / "plan.png"))
        return
    quick_dir = Path(tempfile.gettempdir()) / "minidist-plan-quick"
    json_path = Path(args.json or (quick_dir / "plan.json" if args.quick else HERE / "results" / "plan.json"))
    png_path = Path(args.png or (quick_dir / "plan.png" if args.quick else HERE / "figures" / "plan.png"))
    parts = [p for p in args.parts if not (args.quick and p == "search")]
    layouts = QUICK_LAYOUTS if args.quick else tuple(LAYOUTS)
    reps, steps = args.reps or (2 if args.quick else 3), args.steps or (20 if args.quick else 40)
    results = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                           "python": platform.python_version(), "numpy": np.__version__,
                           "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:])},
               "planner": planner_version(), "load_start": list(os.getloadavg())}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="minidist-plan-") as scratch:
        for part in parts:
            t0 = time.perf_counter()
            print(f"[{part}]", flush=True)
            if part == "timing":
                results[part] = part_timing(layouts, reps, steps, Path(scratch))
            elif part == "exact":
                results[part] = part_exact(layouts)
            elif part == "scale":
                results[part] = part_scale()
            else:
                results[part] = part_search()
            print(f"[{part}: {time.perf_counter() - t0:.0f} s]", flush=True)
    results["load_end"] = list(os.getloadavg())
    results["wall_s"] = time.perf_counter() - start
    print_tables(results)
    print(f"\nload average (1, 5, 15 min): start {results['load_start']}, end {results['load_end']}; "
          f"{results['wall_s']:.0f} s in all")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=1, default=float))
    plot(results, png_path)
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
