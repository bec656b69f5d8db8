"""The planner against published numbers, each test citing its source, and its command line.

Validation against minidist's own runs is tests/test_plan_validation.py.
"""
import json
import subprocess
import sys

import pytest

from minidist.inspect.accounting import zero_formula
from minidist.plan import PROFILES, ModelSpec, RunSpec, parameter_count, predict, preset, search
from minidist.plan.memory import activation_bytes_per_layer, model_state_bytes
from minidist.plan.models import active_parameters
from minidist.plan.timing import simulated

GB = 1e9


@pytest.mark.parametrize("name, published", [
    ("llama3-8b", 8.03e9), ("llama3-70b", 70.6e9), ("llama3-405b", 405.9e9),  # Meta's model cards
    ("gpt3-175b", 175.0e9),  # Brown et al. 2020, Table 2.1
])
def test_parameter_counts_are_within_one_percent_of_the_published_ones(name, published):
    assert abs(parameter_count(preset(name)) / published - 1) < 0.01


@pytest.mark.parametrize("name, count", [("gpt2", 124_439_808), ("gpt2-medium", 354_823_168),
                                         ("gpt2-large", 774_030_080), ("gpt2-xl", 1_557_611_200)])
def test_gpt2_parameter_counts_are_exactly_hugging_faces(name, count):
    """The counts of Hugging Face's GPT2LMHeadModel (tied embeddings) for the four released sizes."""
    assert parameter_count(preset(name)) == count


def bytes_per_parameter(run: RunSpec) -> dict:
    """Model-state bytes per parameter of a ~7.5B model under ``run`` (units are sharded with
    numpy.array_split, so the ceilings make the figure a hair above the paper's at N = 64)."""
    model = ModelSpec("7.5b", n_layer=64, n_embd=3072, n_head=24, vocab_size=50257, block_size=2048)
    held = model_state_bytes(model, run)
    return sum(held.values()) / parameter_count(model)


@pytest.mark.parametrize("stage, paper_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_figure_1_model_states_of_7_5b_on_64_devices(stage, paper_gb):
    """Rajbhandari et al. 2020 (ZeRO), Figure 1: Psi = 7.5B, mixed-precision Adam (K = 12), N_d = 64:
    120, 31.4, 16.6 and 1.9 GB per device for the baseline and stages 1-3."""
    per_parameter = bytes_per_parameter(RunSpec(dp=64, zero=stage, dtype="bfloat16"))
    assert round(per_parameter * 7.5e9 / GB, 1) == paper_gb
    formula = zero_formula(stage, 2 * 7.5e9, 12 * 7.5e9, 64)
    assert round(sum(formula.values()) / GB, 1) == paper_gb


def test_playbooks_16_bytes_per_parameter_70b_needs_1120_gb():
    """The Ultra-Scale Playbook (Hugging Face, 2025), "memory usage in transformers": mixed-precision
    Adam keeps 2 + 2 + 4 + 4 + 4 = 16 bytes per parameter, so 70B parameters hold 1,120 GB."""
    run = RunSpec(dtype="bfloat16")
    model = preset("llama3-70b")
    held = model_state_bytes(model, run)
    assert held == {"parameters": 2 * parameter_count(model), "gradients": 2 * parameter_count(model),
                    "master_weights": 4 * parameter_count(model), "optimizer_states": 8 * parameter_count(model)}
    assert 16 * 70e9 / GB == 1120


# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 2:
# activation bytes per transformer layer with 16-bit activations and dropout, s = 2048, b = 1,
# h = 12288, a = 96, t = 8: the GPT-3 175B layer of their Section 6.
S, B, H, A, T = 2048, 1, 12288, 96, 8
SBH = S * B * H
KORTHIKANTI = {
    "no parallelism": (dict(tp=1), SBH * (34 + 5 * A * S / H)),
    "tensor parallel": (dict(tp=T), SBH * (10 + 24 / T + 5 * A * S / (H * T))),
    "tensor + sequence parallel": (dict(tp=T, sequence_parallel=True), SBH / T * (34 + 5 * A * S / H)),
    "tensor parallel + selective recompute": (dict(tp=T, recompute="selective"), SBH * (10 + 24 / T)),
    "tensor + sequence parallel + selective recompute": (dict(tp=T, sequence_parallel=True, recompute="selective"),
                                                         SBH * 34 / T),
    "full recompute": (dict(tp=T, recompute="full"), 2 * SBH),
}


@pytest.mark.parametrize("case", list(KORTHIKANTI))
def test_korthikantis_table_2_for_the_gpt3_175b_layer(case):
    changes, published = KORTHIKANTI[case]
    run = RunSpec(seq=S, micro_batch_size=B, dropout=True, **changes)
    assert activation_bytes_per_layer(preset("gpt3-175b"), run) == pytest.approx(published, rel=1e-12)


def test_sequence_parallelism_with_selective_recompute_is_5x_smaller_than_tensor_parallelism_alone():
    """Korthikanti et al., Section 5: with t = 8 the two together need 34/t against 10 + 24/t + 5as/(ht),
    about 5x less at GPT-3's shape."""
    model = preset("gpt3-175b")
    tp = activation_bytes_per_layer(model, RunSpec(seq=S, tp=T, dropout=True))
    both = activation_bytes_per_layer(model, RunSpec(seq=S, tp=T, sequence_parallel=True, recompute="selective",
                                                     dropout=True))
    assert 4.5 < tp / both < 5.5


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m_per_p", [1, 2, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
def test_the_simulated_bubble_is_the_1f1b_and_interleaved_formula(p, m_per_p, v):
    """Narayanan et al. 2021 (Megatron-LM): the 1F1B bubble is (p-1) of m + p - 1 slots; interleaving v
    chunks per rank shrinks it to (p-1)/(v m + p - 1) of the step (their (p-1)/(v m) of the ideal)."""
    m = m_per_p * p
    _, bubble = simulated("1f1b" if v == 1 else "interleaved", p, m, v, 2.0)
    assert bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p, m", [(4, 8), (4, 16), (8, 16)])
def test_zb_h1_idles_p_minus_1_times_f_plus_b_minus_w(p, m):
    """Qi et al. 2023 (zero bubble), ZB-H1: the idle per rank is (p-1)(T_F + T_B - T_W), a third of
    1F1B's (p-1)(T_F + T_B + T_W) when the three are equal (F = 1, B = 1, W = 1 here)."""
    makespan, bubble = simulated("zb-h1", p, m, 1, 2.0)
    assert makespan == pytest.approx(3 * m + (p - 1) * 1)
    assert bubble == pytest.approx((p - 1) / makespan)


def test_model_flops_count_6_per_parameter_and_token_and_the_attention():
    """Kaplan et al. 2020 / PaLM appendix B: 6 N + 12 L h s training FLOPs per token."""
    from minidist.plan.timing import model_flops_per_token
    model = preset("llama3-8b")
    assert model_flops_per_token(model, 8192) == 6 * active_parameters(model) + 12 * 32 * 4096 * 8192
    assert active_parameters(model) == parameter_count(model) - 128256 * 4096  # untied: the lookup is free


def test_a_prediction_has_the_contracted_keys_and_adds_up():
    p = predict(preset("llama3-70b"), RunSpec(seq=8192, dp=16, tp=8, pp=8, micro_batches=16, zero=1,
                                              sequence_parallel=True, recompute="selective"), "h100")
    for key in ("parameters", "per_rank_bytes", "activation_bytes_per_layer", "bubble", "comm_bytes_per_step",
                "step_time_s", "mfu"):
        assert key in p
    held = p["per_rank_bytes"]
    assert set(held) >= {"parameters", "gradients", "master_weights", "optimizer_states", "activations", "total"}
    assert held["total"] == sum(v for k, v in held.items() if k != "total")
    assert held["total"] == max(row["total"] for row in p["per_pp_rank"])
    assert 0 < p["mfu"] < PROFILES["h100"].matmul_efficiency
    assert p["bubble"] == pytest.approx(7 / (16 + 7))
    assert p["comm_bytes_per_step"]["dp"] > 0 and p["comm_bytes_per_step"]["cp"] == 0


def test_a_layout_that_cannot_run_names_every_reason():
    p = predict(preset("gpt2"), RunSpec(seq=2048, tp=5, pp=16, cp=3), "h100")
    assert "step_time_s" not in p
    text = "\n".join(p["problems"])
    assert "n_head 12 is not divisible by tp 5" in text
    assert "pp * virtual_stages = 16 * 1 pipeline stages" in text and "the sequence of 2048 tokens is not divisible by 3" in text


def plan_cli(*args):
    return subprocess.run([sys.executable, "-m", "minidist.plan", *args], capture_output=True, text=True, timeout=300)


def test_the_cli_prints_json_with_the_contracted_keys():
    done = plan_cli("--model", "gpt2", "--seq", "1024", "--dp", "8", "--zero", "2", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["parameters"] == 124_439_808
    assert set(out["per_rank_bytes"]) >= {"parameters", "gradients", "master_weights", "optimizer_states",
                                          "activations", "total"}
    for key in ("activation_bytes_per_layer", "bubble", "comm_bytes_per_step", "step_time_s", "mfu"):
        assert key in out


def test_the_cli_prints_a_readable_table():
    done = plan_cli("--model", "llama3-8b", "--seq", "8192", "--tp", "8", "--dp", "4", "--zero", "1",
                    "--sequence-parallel")
    assert done.returncode == 0, done.stderr
    assert "llama3-8b: 8.030 B parameters" in done.stdout
    assert "memory per rank" in done.stdout and "MFU" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["--tp", "3"], "n_head 4 is not divisible by tp 3"),
    (["--model", "llama9"], "unknown model preset 'llama9'"),
    (["--seq", "128", "--block-size", "64"], "longer than the model's 64 learned positions"),
    (["--search"], "--search needs --gpus"),
])
def test_the_cli_refuses_bad_input_with_exit_2(args, message):
    done = plan_cli(*args)
    assert done.returncode == 2
    assert message in done.stderr


def test_search_ranks_what_fits_and_says_why_the_rest_does_not():
    model = preset("gpt2-xl")
    fits, rejected = search(model, 16, PROFILES["a100"], RunSpec(seq=1024, micro_batch_size=4), 64,
                            memory_bytes=20 * 2**30)
    assert fits and rejected
    times = [p["step_time_s"] for p in fits]
    assert times == sorted(times)
    assert all(p["per_rank_bytes"]["total"] <= 20 * 2**30 for p in fits)
    assert all(p["run"]["dp"] * p["run"]["tp"] * p["run"]["pp"] * p["run"]["cp"] == 16 for p in fits)
    reasons = [why for _, why in rejected]
    assert any("GiB of" in why and why.endswith("> 20") for why in reasons)


def test_the_cli_search_prints_the_table_and_the_reasons():
    done = plan_cli("--model", "gpt2", "--seq", "1024", "--search", "--gpus", "8", "--memory-gib", "4",
                    "--global-batch-size", "32", "--top", "3")
    assert done.returncode == 0, done.stderr
    assert "layouts fit" in done.stdout and "rejected, by reason" in done.stdout


def test_the_local_profile_is_measured_here_and_predicts_a_step():
    """``--hardware local`` measures this machine (matmul, memory, overheads, the all-reduce over MPI
    or threads); the numbers are only checked to be sane, never timed against a target."""
    from minidist.plan import from_gpt_config, hardware_profile
    from minidist.train.config import TrainConfig
    cfg = TrainConfig(dp=2, tp=2)
    model, run = from_gpt_config(cfg), RunSpec(seq=64, micro_batch_size=8, dp=2, tp=2, dtype="float32")
    hw = hardware_profile("local", model, run)
    assert hw.flops > 1e8 and hw.memory_bandwidth > 1e8 and hw.intra_bandwidth > 1e6
    assert 0 < hw.intra_latency < 0.1 and 0 < hw.layer_overhead < 0.1 and hw.cores >= 1
    p = predict(model, run, hw)
    assert p["step_time_s"] > 0 and p["hardware"] == "local" and "measured here" in p["hardware_note"]
