"""Training on a GPU (``--device cuda``), checked on the CPU with the fake-CuPy double.

The double's "device" arrays live in host memory, compute with NumPy's arithmetic, and refuse to mix
with NumPy arrays (TypeError), as CuPy's do. So a run on device arrays must give BITWISE the losses
and weights of the same run on NumPy, and any host buffer the training stack makes for a device
model (a gradient bucket, a ZeRO flat buffer, a pipeline receive buffer, an optimizer state, a
loss-scaling seed) fails here as it would on a GPU. Covered: one process (SGD with momentum, AdamW),
data, tensor, sequence, context and pipeline parallelism, ZeRO 1-3, recomputation, float16 mixed precision,
checkpoints, and the command line's refusals.
"""
import dataclasses
import importlib.util
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from minidist import run_local
from minidist.checkpoint import step_dir
from minidist.device import to_device
from minidist.model import GPT, GPTConfig
from minidist.train import train
from minidist.train.config import ConfigError, TrainConfig, check_config
from minidist.train.cli import parse_args

TINY = dict(n_layer=2, n_head=4, n_embd=16, block_size=16, batch_size=8, steps=4, eval_every=2,
            eval_iters=1, dtype="float64", sample_tokens=0, warmup=2, lr=1e-2, grad_clip=0.5, bucket_mb=0.001)


@pytest.fixture
def cupy():
    from tests.doubles import fake_cupy
    try:
        yield fake_cupy.install(device_count=2)
    finally:
        fake_cupy.uninstall()


def run(cfg):
    """``train(cfg)`` on dp * pp * tp in-process ranks: per rank (losses, val losses, state_dict,
    the types of the parameters' arrays)."""
    def body(group):
        model, history = train(cfg, progress=False, world=group)
        return ([r["loss"] for r in history], [r["val_loss"] for r in history if "val_loss" in r], model.state_dict(),
                {type(p.data) for p in model.parameters()})
    return run_local(body, cfg.dp * cfg.pp * cfg.cp * cfg.tp)


def assert_same_arrays(got: dict, want: dict, rtol: float, atol: float) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert type(got[name]) is np.ndarray, f"{name}: a state_dict / export holds NumPy arrays"
        np.testing.assert_allclose(got[name], value, rtol=rtol, atol=atol, err_msg=name)


def assert_device_run_is_the_host_run(cupy, cfg, tmp_path, rtol=0.0, atol=0.0):
    """The run of ``cfg`` on device arrays gives the losses, the weights (every rank's state_dict)
    and the consolidated export of the run on NumPy: bitwise (tolerances 0), or within ``rtol``
    (losses, weights) and ``atol`` (weights) where the two compute differently on purpose."""
    host = run(dataclasses.replace(cfg, export=str(tmp_path / "host.npz")))
    device = run(dataclasses.replace(cfg, device="cuda", export=str(tmp_path / "device.npz")))
    for (losses, val, state, types), (ref_losses, ref_val, ref_state, ref_types) in zip(device, host):
        assert types == {cupy.ndarray} and ref_types == {np.ndarray}
        np.testing.assert_allclose(losses, ref_losses, rtol=rtol, atol=0)
        np.testing.assert_allclose(val, ref_val, rtol=rtol, atol=0)
        assert_same_arrays(state, ref_state, rtol, atol)
    assert_same_arrays(dict(np.load(tmp_path / "device.npz")), dict(np.load(tmp_path / "host.npz")), rtol, atol)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_one_process_on_device_arrays_trains_bitwise_like_numpy(cupy, data_dir, tmp_path, optimizer):
    cfg = TrainConfig(**TINY, data_dir=data_dir, optimizer=optimizer, momentum=0.9)
    assert_device_run_is_the_host_run(cupy, cfg, tmp_path)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_data_parallel_on_device_arrays_trains_bitwise_like_numpy(cupy, data_dir, tmp_path, optimizer):
    cfg = TrainConfig(**TINY, data_dir=data_dir, optimizer=optimizer, dp=2, micro_batches=2)
    assert_device_run_is_the_host_run(cupy, cfg, tmp_path)


@pytest.mark.parametrize("changes", [
    dict(tp=2), dict(tp=2, sequence_parallel=True), dict(dp=2, recompute="full"),
    dict(pp=2, schedule="1f1b", micro_batches=2), dict(dp=2, pp=2, zero=1, micro_batches=2),
    dict(dp=2, pp=2, zero=2, schedule="zb-h1", micro_batches=4), dict(pp=2, schedule="zbv", virtual_stages=2, n_layer=4),
    dict(dp=2, zero=1), dict(dp=2, zero=2, micro_batches=2), dict(dp=2, zero=3), dict(dp=2, tp=2, zero=3),
    dict(dp=2, pp=2, zero=3, micro_batches=2), dict(dp=2, tp=2, zero=2, sequence_parallel=True),
    dict(dp=2, zero=3, recompute="full"), dict(dp=2, zero=3, dtype="bfloat16"),
    dict(dp=2, pp=2, zero=2, micro_batches=2, dtype="bfloat16"),
    dict(cp=2), dict(cp=2, cp_algorithm="zigzag", tp=2, sequence_parallel=True),
    dict(cp=2, cp_algorithm="ulysses", dp=2, zero=3), dict(cp=2, cp_algorithm="zigzag", pp=2, micro_batches=2),
    dict(n_experts=4), dict(n_experts=4, dp=2, ep=2, tp=2, zero=1), dict(n_experts=4, dp=2, ep=2, pp=2, micro_batches=2),
    dict(n_experts=4, dp=2, ep=2, zero=3, capacity_factor=1.0),
    dict(dp=2, zero=2, offload="optimizer"), dict(dp=2, pp=2, zero=1, micro_batches=2, offload="optimizer"),
    dict(dp=2, zero=3, offload="optimizer,params", dtype="bfloat16"), dict(zero=0, offload="optimizer"),
    dict(dropout=0.2, tp=2, sequence_parallel=True), dict(dropout=0.2, dp=2, cp=2, cp_algorithm="zigzag", recompute="full"),
], ids=lambda c: " ".join(f"{k}={v}" for k, v in c.items()))
def test_parallel_layouts_on_device_arrays_train_bitwise_like_numpy(cupy, data_dir, tmp_path, changes):
    cfg = dataclasses.replace(TrainConfig(**TINY, data_dir=data_dir, optimizer="adamw"), **changes)
    assert_device_run_is_the_host_run(cupy, cfg, tmp_path)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the loss scaler's probe for a lower scale
def test_float16_mixed_precision_on_device_arrays_tracks_numpy(cupy, data_dir, tmp_path):
    # Not bitwise, on purpose: a float16 matmul on NumPy is done by float32 BLAS and rounded (what
    # tensor cores do), on the device by the device's own float16 matmul (here NumPy's float16 loop):
    # the same math, summed in another order. SGD keeps such differences as small as they start.
    cfg = TrainConfig(**dict(TINY, dtype="float16", steps=6), data_dir=data_dir, optimizer="sgd", dp=2)
    assert_device_run_is_the_host_run(cupy, cfg, tmp_path, rtol=1e-3, atol=1e-4)


def test_emulated_bfloat16_on_device_arrays_trains_bitwise_like_numpy(cupy, data_dir, tmp_path):
    cfg = TrainConfig(**dict(TINY, dtype="bfloat16"), data_dir=data_dir, optimizer="sgd")
    assert_device_run_is_the_host_run(cupy, cfg, tmp_path)


def test_checkpoints_of_a_device_run_resume_bitwise_like_numpy(cupy, data_dir, tmp_path):
    cfg = TrainConfig(**dict(TINY, steps=6), data_dir=data_dir, optimizer="adamw", dp=2, zero=1, save_every=2)
    results = {}
    for device in ("cpu", "cuda"):
        ckpt = dataclasses.replace(cfg, device=device, ckpt_dir=str(tmp_path / device))
        run(ckpt)
        shutil.rmtree(step_dir(ckpt.ckpt_dir, 6))  # as if the job had died after saving step 4
        results[device] = run(dataclasses.replace(ckpt, resume=True))  # steps 4, 5 from step-4
    for (losses, _, state, _), (ref_losses, _, ref_state, _) in zip(results["cuda"], results["cpu"]):
        assert losses == ref_losses and len(losses) == 2
        for name, value in ref_state.items():
            np.testing.assert_array_equal(state[name], value, err_msg=name)


def test_a_device_model_generates_the_tokens_of_the_host_model(cupy):
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8)
    host, device = GPT(config, seed=3, dtype="float64"), GPT(config, seed=3, dtype="float64").to("cuda")
    prompt = np.array([[1, 2, 3]])
    out = device.generate(prompt, 6, top_k=5, rng=np.random.default_rng(0))
    assert type(out) is np.ndarray
    np.testing.assert_array_equal(out, host.generate(prompt, 6, top_k=5, rng=np.random.default_rng(0)))
    for name, value in device.state_dict().items():
        assert type(value) is np.ndarray, name
    assert all(type(p.data) is np.ndarray for p in device.to("cpu").parameters())


def test_to_device_moves_arrays_and_refuses_unknown_devices(cupy):
    a = np.arange(3.0)
    on_gpu = to_device(a, "cuda")
    assert type(on_gpu) is cupy.ndarray and to_device(on_gpu, "cuda") is on_gpu
    assert type(to_device(on_gpu, "cpu")) is np.ndarray
    with pytest.raises(ValueError, match="device must be one of cpu, cuda, got 'tpu'"):
        to_device(a, "tpu")


def test_each_rank_takes_the_gpu_of_its_local_rank(cupy, data_dir):
    picked = {}

    def body(group):
        train(TrainConfig(**dict(TINY, steps=1), data_dir=data_dir, dp=4, device="cuda"), progress=False, world=group)
        picked[group.rank] = cupy.cuda.runtime.getDevice()  # this thread's current GPU

    run_local(body, 4)
    assert picked == {0: 0, 1: 1, 2: 0, 3: 1}  # 4 ranks on one machine with 2 GPUs


@pytest.mark.parametrize("changes, message", [
    (dict(backend="nccl"), "--backend nccl moves GPU buffers only: it needs --device cuda"),
    (dict(device="cuda", backend="mpi"), "--device cuda with --backend mpi is not supported"),
    (dict(device="cuda", mode="ps", servers=1), "--device cuda with --mode ps is not supported"),
])
def test_combinations_the_device_path_cannot_run_are_refused(changes, message):
    world = 2 if changes.get("mode") or changes.get("pp") else 1
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(dataclasses.replace(TrainConfig(**TINY), **changes), world)


def test_the_flags_map_onto_the_config():
    assert (parse_args([]).device, parse_args([]).backend) == ("cpu", "ring")
    cfg = parse_args(["--device", "cuda", "--backend", "nccl"])
    assert (cfg.device, cfg.backend) == ("cuda", "nccl")
    with pytest.raises(SystemExit):
        parse_args(["--device", "tpu"])


no_cupy = pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")


@no_cupy
def test_device_cuda_without_cupy_fails_with_a_clear_message_in_process(data_dir):
    with pytest.raises(ConfigError, match=r"--device cuda needs CuPy and an NVIDIA GPU"):
        train(TrainConfig(**TINY, data_dir=data_dir, device="cuda"), progress=False)


@no_cupy
@pytest.mark.parametrize("flags, message", [
    (["--device", "cuda"], "--device cuda needs CuPy and an NVIDIA GPU"),
    (["--device", "cuda", "--backend", "nccl"], "backend 'nccl' needs CuPy and an NVIDIA GPU"),
    (["--device", "cuda", "--backend", "mpi"], "--device cuda with --backend mpi is not supported"),
])
def test_the_command_line_refuses_what_this_machine_cannot_run(data_dir, flags, message):
    run = subprocess.run([sys.executable, "-m", "minidist.train", *flags, "--steps", "1", "--data-dir", data_dir],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert message in run.stderr and run.stderr.count("python -m minidist.train:") == 1, run.stderr
    assert "Traceback" not in run.stderr
