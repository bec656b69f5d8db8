"""The ``local`` hardware profile: this machine, measured.

    python -m minidist.plan.calibrate            # prints the profile as JSON

Each measurement is the median of a few repeats:

- a rank's compute: the forward and backward of one tp rank's share of a minidist block (its four
  Linears cut as tp cuts them), and of the embeddings, head and loss, at the run's shapes and dtype
  (``Hardware.block_seconds``, ``head_seconds``: what the time model uses for a model small enough
  to build here);
- matmul speed, for models too large to time: NumPy's ``x @ w`` on the four GEMMs of one block's
  forward at the model's shapes on a tp rank, in the dtype minidist multiplies in (float32 for both
  16-bit dtypes), with this process's BLAS threads (set ``OMP_NUM_THREADS`` as the run will: the
  benchmarks use 1);
- memory bandwidth: ``numpy.add`` of two 32 MiB arrays into a third (3 x 32 MiB moved);
- the fixed costs: the same two on a (1, 2, 8) input, where FLOPs and bytes are nothing and the
  interpreter is everything (for models too large to time); of an AdamW step per parameter tensor;
- the all-reduce: the collectives benchmark's ring on 2 MPI processes (``mpiexec``, when there is
  one), else on 2 threads; its 4 KiB time is the latency, its 4 MiB bus bandwidth the link's.

All ranks of a local run share the machine's cores: :class:`Hardware` ``cores`` says how many run at
once, and the time model slows each rank by ranks / cores when there are more ranks than cores.
Nothing overlaps here (``overlap=False``): a rank's communication and its compute take turns on
the same cores, so every transfer is on the step's path. Attention writes its probabilities
(``flash_attention=False``), as minidist's NumPy attention does.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from functools import lru_cache

import numpy as np

from minidist.plan.hardware import GIB, Hardware

SMALL, LARGE = 4096, 4 << 20  # all-reduce sizes for the latency and the bandwidth
CALIBRATION = "setup: calibrating the link (a timed all-reduce)"


def _median_time(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops(rows: int, width: int, hidden: int, tp: int, dtype: str) -> float:
    """FLOP/s of one block's four forward GEMMs on a tp rank, as minidist runs them: (rows, C) x
    (C, 3C/t), (rows, C/t) x (C/t, C), (rows, C) x (C, F/t) and (rows, F/t) x (F/t, C), C = ``width``,
    F = ``hidden``; all their FLOPs over all their time. 16-bit values multiply in float32
    (minidist/autograd/backend.py), float64 in float64."""
    np_dtype = np.float64 if dtype == "float64" else np.float32
    rng = np.random.default_rng(0)
    shapes = [(width, 3 * width // tp), (width // tp, width), (width, hidden // tp), (hidden // tp, width)]
    pairs = [(rng.random((rows, k)).astype(np_dtype), rng.random((k, n)).astype(np_dtype)) for k, n in shapes]
    flops = sum(2 * rows * k * n for k, n in shapes)
    repeats = max(3, int(2e8 // (flops + 1)))
    seconds = _median_time(lambda: [x @ w for _ in range(repeats) for x, w in pairs]) / repeats
    return flops / seconds


def memory_bandwidth() -> float:
    """Bytes/s that ``numpy.add(a, b, out=c)`` moves on 32 MiB float32 arrays."""
    a = np.ones(8 << 20, dtype=np.float32)
    b, c = np.ones_like(a), np.empty_like(a)
    return 3 * a.nbytes / _median_time(lambda: np.add(a, b, out=c))


def _forward_backward_seconds(module_pass, repeats: int = 5) -> float:
    module_pass()  # warm
    return min(_median_time(module_pass, repeats) for _ in range(2))


def rank_block_seconds(rows: int, seq: int, width: int, heads: int, hidden: int, tp: int, dtype: str) -> float:
    """Seconds of the forward and backward of one tp rank's share of a minidist block on a (rows,
    seq, C) input in ``dtype`` (16-bit: minidist's float16, or bfloat16's float32 storage): a
    ``minidist.model.Block`` whose four Linears are cut as tensor parallelism cuts them (c_attn
    to 3C/t outputs, c_proj from C/t, c_fc to F/t, c_proj from F/t; attention reads its heads from
    c_attn's width), with no communication: the rank's compute, interpreter included."""
    from minidist import nn
    from minidist.autograd import Tensor
    from minidist.model import Block, GPTConfig
    storage = "float32" if dtype == "bfloat16" else dtype
    block = Block(GPTConfig(n_embd=width, n_head=heads, block_size=seq), dtype=storage)
    block.attn.c_attn = nn.Linear(width, 3 * width // tp, dtype=storage)
    block.attn.c_proj = nn.Linear(width // tp, width, dtype=storage)
    block.mlp.c_fc = nn.Linear(width, hidden // tp, dtype=storage)
    block.mlp.c_proj = nn.Linear(hidden // tp, width, dtype=storage)
    x = np.random.default_rng(0).random((rows, seq, width)).astype(storage)

    def step():
        y = block(Tensor(x, requires_grad=True))
        y.backward(np.ones_like(y.data))
    return _forward_backward_seconds(step)


def rank_head_seconds(rows: int, seq: int, width: int, vocab: int, dtype: str) -> float:
    """Seconds of the forward and backward of minidist's embeddings, final LayerNorm, LM head (``vocab``
    rows: a tp rank's share) and cross-entropy on (rows, seq) tokens."""
    from minidist.autograd import Tensor
    from minidist.model import GPT, GPTConfig
    storage = "float32" if dtype == "bfloat16" else dtype
    model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=1, n_head=1, n_embd=width), dtype=storage)
    idx = np.random.default_rng(0).integers(0, vocab, (rows, seq))

    def step():
        x = model.embed(idx)
        _, loss = model.head(Tensor(x.data, requires_grad=True), idx)
        loss.backward()
        x.backward(np.ones_like(x.data))
    return _forward_backward_seconds(step)


def fixed_overheads() -> tuple[float, float, float]:
    """(a block's, the embeddings' + head's + loss's, an AdamW step's per parameter tensor) seconds
    at a size where FLOPs and bytes are nothing and the interpreter is everything."""
    from minidist.model import GPT, GPTConfig
    from minidist.optim import AdamW
    model = GPT(GPTConfig(vocab_size=16, block_size=2, n_layer=1, n_head=2, n_embd=8))
    idx = np.zeros((1, 2), dtype=np.int64)
    model(idx, idx)[1].backward()  # every parameter has a gradient to update
    optimizer = AdamW(model.named_parameters(), lr=1e-3)
    optimizer.step()
    update = min(_median_time(optimizer.step, 11) for _ in range(3)) / len(optimizer.params)
    return rank_block_seconds(1, 2, 8, 2, 32, 1, "float32"), rank_head_seconds(1, 2, 8, 16, "float32"), update


def _all_reduce_times(group) -> dict:
    out = {}
    for nbytes in (SMALL, LARGE):
        x = np.ones(nbytes // 4, dtype=np.float32)
        group.all_reduce(x.copy(), label=CALIBRATION)
        group.barrier(label=CALIBRATION)
        out[nbytes] = _median_time(lambda: group.all_reduce(x.copy(), label=CALIBRATION), 7)
    return out


def all_reduce_link() -> tuple[float, float, str]:
    """(bus bandwidth bytes/s, latency s, how): the ring all-reduce on 2 ranks, over MPI processes
    when ``mpiexec`` runs here, else over threads."""
    times, how = None, "2 threads"
    try:
        from minidist.launchers import find_mpiexec, mpiexec_flags
        mpiexec = find_mpiexec()  # SystemExit when there is none
        root = hasattr(os, "geteuid") and os.geteuid() == 0
        cmd = [mpiexec, *mpiexec_flags(mpiexec, allow_root=root), "-n", "2", sys.executable, "-c",
               "from minidist.plan.calibrate import main; main(['--all-reduce'])"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
        times, how = {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}, "2 MPI processes"
    except (Exception, SystemExit):  # noqa: BLE001 -- no mpiexec, or it failed: the threads are the fallback
        from minidist import run_local
        times = run_local(_all_reduce_times, 2)[0]
    # bus bytes: 2 (n-1)/n = 1 on 2 ranks. On a loaded machine the small call can time longer than the
    # large one: latency and bandwidth are then not told apart, and the large call's whole time bounds it
    spent = times[LARGE] - times[SMALL] if times[LARGE] > times[SMALL] else times[LARGE]
    bandwidth = LARGE / spent
    return bandwidth, times[SMALL], how


MEASURED_LIMIT = 256 * 2**20  # the largest activation set the calibration builds to time a block
LARGE_GEMMS = (1024, 1024, 4096, 1)  # (rows, C, F, tp) timed for GEMMs too large to build: ~160 MiB


def gemm_shape(rows: int, width: int, hidden: int, tp: int) -> tuple[int, int, int, int]:
    """The (rows, C, F, tp) whose GEMMs ``matmul_flops`` times: the block's own when their operands
    (float64 at most) fit in :data:`MEASURED_LIMIT`, else :data:`LARGE_GEMMS` (GEMM speed levels off
    long before: a larger block multiplies at that rate)."""
    k = [(width, 3 * width // tp), (width // tp, width), (width, hidden // tp), (hidden // tp, width)]
    fits = 8 * sum(rows * a + a * b for a, b in k) <= MEASURED_LIMIT and min(b for _, b in k) > 0
    return (rows, width, hidden, tp) if fits else LARGE_GEMMS


@lru_cache(maxsize=8)
def _calibrate(rows: int, seq: int, width: int, heads: int, hidden: int, vocab: int, tp: int, dtype: str) -> Hardware:
    bandwidth, latency, how = all_reduce_link()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    tokens = rows * seq
    flops, memory = matmul_flops(*gemm_shape(tokens, width, hidden, tp), dtype), memory_bandwidth()
    block_overhead, outside, per_tensor = fixed_overheads()
    block = head = None
    weights = (12 * width + 2 * hidden + vocab + seq) * width * 8  # a whole block's, the embeddings', at most
    if tokens * (20 * width + hidden + seq * heads) * 4 + weights < MEASURED_LIMIT and tokens * vocab // tp * 4 < MEASURED_LIMIT:
        block = rank_block_seconds(rows, seq, width, heads, hidden, tp, dtype)
        head = rank_head_seconds(rows, seq, width, -(-vocab // tp), dtype)
    timed = (f"a block {1e3 * block:.2f} ms, the embeddings and head {1e3 * head:.2f} ms forward + backward"
             if block is not None else "the model too large to time a block: FLOPs and bytes")
    note = (f"measured here at {rows} x {seq} tokens, C {width}, tp {tp}, {dtype}: {timed}; GEMMs "
            f"{flops / 1e9:.1f} GFLOP/s; all-reduce over {how}")
    return Hardware("local", flops=flops, matmul_efficiency=1.0, memory_bandwidth=memory,
                    memory_bytes=0.75 * _memory_total(), devices_per_node=1 << 20, intra_bandwidth=bandwidth,
                    inter_bandwidth=bandwidth, intra_latency=latency, inter_latency=latency,
                    layer_overhead=block_overhead, microbatch_overhead=outside, tensor_update_overhead=per_tensor,
                    host_bandwidth=memory, host_memory_bandwidth=memory, disk_bandwidth=1e9, cores=cores,
                    overlap=False, flash_attention=False, block_seconds=block, head_seconds=head, note=note)


def _memory_total() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GIB


def calibrate(model=None, run=None) -> Hardware:
    """The ``local`` profile, measured at ``model``'s and ``run``'s shapes on one rank (b sequences
    of seq / cp tokens, C, F, the heads and vocabulary, tp) when given (cached per shape for the
    process); else at minidist's default GPT's."""
    rows, seq, tp, dtype = ((run.micro_batch_size, run.seq // run.cp, run.tp, run.dtype) if run is not None
                            else (16, 64, 1, "float32"))
    width, heads, hidden, vocab = ((model.n_embd, model.n_head, model.hidden, model.vocab_size) if model is not None
                                   else (64, 4, 256, 256))
    return _calibrate(rows, seq, width, heads, hidden, vocab, tp, dtype)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--all-reduce"]:  # one of the 2 MPI ranks all_reduce_link starts
        import minidist
        group = minidist.init()
        times = _all_reduce_times(group)
        if group.rank == 0:
            print(json.dumps(times))
        return
    profile = calibrate()
    print(json.dumps(vars(profile), indent=1))


if __name__ == "__main__":
    main()
