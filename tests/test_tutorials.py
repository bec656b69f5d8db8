"""Every tutorial runs and passes its own verification: under mpiexec with the world size it is
written for (by default a sample, UNDER_MPIEXEC_BY_DEFAULT; every one with --slow and under Open MPI
in CI), and started alone, ``python tutorials/NN.py``, as a learner first tries it (its ranks as
threads in one process; 03 with ``--local 4``, and started alone in tests/test_fuzz_tutorials.py).

Each lesson checks its claims against one process and exits non-zero when one fails; the last line
asserted here is the one it prints only once every check has passed, the others what the lesson
shows on the way. Both runs draw the lesson's picture (``--png``): the file must be written, and the
lesson's last line must say "All checks passed" (08 without a GPU, 21 without Open MPI: the one
line that says why it stops, and no picture). What a picture shows is tests/test_lesson_pictures.py's, never its pixels. What a lesson checks is exact (values, bytes, counts, orders); the times it
measures are printed, never asserted, here or in the lesson: a loaded machine must not fail a
correct lesson. HANG_SECONDS only stops a lesson that hangs, far above the minute each takes on
2 cores (tutorials/README.md promises it; ``pytest --durations`` shows it).
"""
import os
import re
import subprocess
import sys

import pytest

from minidist.device import gpu_count
from minidist.launchers import mpiexec_flavour
from tests.mpi.harness import REPO, find_mpiexec, run_mpi

TUTORIALS = REPO / "tutorials"
FLAVOUR = mpiexec_flavour(find_mpiexec()) if find_mpiexec() else None  # lesson 16 says which

# (script, ranks under mpiexec or None for one process, in-process arguments or None, what it prints).
# What it prints: regular expressions that must each match, or (expression, n): exactly n matches.
# The last is the verification line.
LESSONS = [
    ("00_autograd_and_gpt.py", None, [], [r"All checks passed\."]),
    ("01_ring_allreduce.py", 4, [], [
        (r"(?m)^ +\d +(\d+) B +\1 B +\d+ B = \1 \+ \d+$", 4),  # bytes sent: measured = formula, = the trace's
        r"  mean 120\.0 B = 2\(n-1\)/n x N = 2 x 3/4 x 80 = 120\.0 B",
        r"\"auto\" \(the default\) picked 'doubling' for these 80 B",
        r"all ranks agree with numpy and with group\.all_reduce\(algorithm=\"ring\"\)",
        r"rank 2 called all_reduce with dtype float64, count 4 while rank 1 called all_reduce with dtype float32, count 8",
        r"Census: rank 3 never arrived at all_reduce #1 .*; ranks 0,1,2 waited in it",
        r"Try:\n  1\. --local 3 .*bytes sent per rank \[104, 112, 104\]",
        r"All checks passed: the hand-written ring = numpy = the library's ring"]),
    ("02_data_parallel.py", 2, [], [
        r"=== 1\. 7 buckets of >= 128 KiB",
        (r"rank \d: median +\d+% of the all-reduce time ran while backward was still computing "
         r"\(min \d+%, max \d+%\); exposed median", 2),
        (r"    bucket 6  \|", 2),  # a timeline row per bucket per rank (the median pass)
        r"At most min\(t_comm, t_backward - t_first\) = [\d.]+ ms",
        r"\n +1024 +1 +[\d.]+ ms  \|",  # the sweep's one-bucket row
        r"backward of micro-batch 0: 0 all-reduces started",
        r"backward of micro-batch 1: 7 all-reduces started",
        (r"= one process's on the full batch", 3),  # 2 gradients, then the weights
        r"all 2 replicas hold bitwise identical weights",
        r"Try:\n  1\. BUCKET_BYTES = 32 \* 1024\. Expect '=== 1\. 9 buckets of >= 32 KiB'",
        r"All checks passed: averaged and accumulated gradients and the weights = one process's"]),
    ("03_tensor_parallel.py", 2, ["--local", "4"], [
        r"ONE all-reduce \(g\) per MLP forward",  # why columns, then rows
        (r"  h\.[01] +backward +all_reduce 1024, all_reduce 1024\n", 2),  # backward counted per block
        r"  head +backward +all_reduce 1024\n",
        (r"  h\.[01] +(forward|backward) +all_gather 1024, reduce_scatter 1024, all_gather 1024, reduce_scatter 1024\n", 4),
        r"  per rank, measured: tp \d (\d[\d,]*) B, tp \d \+ sp (\d[\d,]*) B \(-",  # sp saves activation bytes
        r"as planned = measured, to the byte",
        (r"= one process's", 2),  # tensor parallel, then + sequence parallel
        r"tensor \+ sequence parallel: loss [\d.]+ = one process's",
        r"\nTry: ",
        r"Tensor parallelism on \d ranks: 2 all-reduces per block each way, .* a rank\. All checks passed\."]),
    ("04_pipeline.py", 4, [], [
        r"  t 0-\d+:\n",  # the interleaved timeline cut along time, every line <= 100 characters
        r"in flight per rank: \[[\d, ]+\] \(chunk, micro-batch\) pairs",
        r"every stage's weights and every loss equal one process's to 1e-10, for all three schedules",
        (r"  (gpipe|1f1b|interleaved) +measured +[\d.]+% +ideal +[\d.]+%", 3),
        r"cores' worth of CPU in the step",
        r"\nTry: ",
        r"GPipe, 1F1B and interleaved = one process\. All checks passed\."]),
    ("05_zero.py", 4, [], [
        r"    3      58\.8     58\.8    117\.5    235\.0    235\.0   \de-1\d",  # float64, stage 3, = formula
        (r"measured = paper to the byte", 4),
        r"    3 +15,040 +15,040 +90,240 +120,320 +4 Psi",  # mixed precision: (2 + 2 + 12) Psi / 4
        r"198\.5 KiB = transformer\.h\.0, transformer\.h\.1 \(prefetch\)",  # ZeRO-3's gathered peak
        r"    3 +0P +1P +2P +528\.8 +1\.5x",  # from the trace: all-gather twice, reduce-scatter once
        r"stages 1 and 2 send what stage 0 \(plain data parallelism\) sends; stage 3 sends 1\.5x",
        r"All checks passed: every stage's weights = one process's"]),
    ("06_checkpoint_and_restart.py", None, [], [
        r"manifest sha256 [0-9a-f]{16}\.\.\.; run identity: seed 0",
        r"it differs in\n +seed: saved 0, now 1\n",
        r"5\. checkpoint step-000006 skipped: .*manifest\.json: checksum mismatch",
        r"6\. exported \d+ parameters",
        r"tp rank 1 needs rows 32:64 <- rank-00000 rows 32:48, rank-00001 rows 48:64",  # resharding at tp 3
        r"attempt 1 exited with code",  # the launcher saw the killed rank ...
        r"restart 1/1 on 2 ranks with --resume from checkpoint ckpt/step-000006",  # ... and restarted the job
        r"final loss [\d.]+ = the uninterrupted run's, bitwise",
        r"\nTry: ",
        r"restart to the same loss\. All checks passed\."]),
    ("07_parameter_server.py", 4, [], [
        r"weights vs one process: max relative error \d\.\de-1\d",
        r"=== 2\. synchronous, .*\n(.*\n){4}  worker 1 +12 .*\n  worker 2 +12 ",  # synchronous: 12 pushes each
        # every fast worker's row of each run: pushes (asynchronous: as the scheduling went), waited vs
        # (n - s - 1)(T_slow - T_fast), both measured
        (r"\n  worker [12] +\d+ +[\d.]+ms +[\d.]+ms +-?[\d.]+ms   ", 6),
        r"max \d <= bound \(W-1\)\(2s\+1\) = 6; worker 0's first gradient: \d",
        r"max \d+ <= bound \(W-1\)\(2s\+1\) = 34; worker 0's first gradient: \d+",
        r"=== 2b\. equal data: time to 36 gradients of 2 rows \(72 sequences\) ===",
        r"  synchronous +[\d.]+s +12 +12\.0 ",
        r"ring all-reduce over 3 ranks",
        r"\nTry:\n  1\. STRAGGLER = 0\.06",
        r"Synchronous = one process; asynchronous staleness <= \(W-1\)\(2s\+1\); .* All checks passed\."]),
    # without a GPU the lesson says what it needs, once for the whole job (rank 0), and stops with status 0
    ("08_gpu.py", 2, [], [(r"Every GPU result equals the host ring's, element for element\. All checks passed\."
                           if gpu_count()
                           else r"Lesson 8 needs CuPy and an NVIDIA GPU", 1)]),
    ("09_mixed_precision_zero.py", 4, [], [
        r"    3 +15,040 +15,040 +30,080 +60,160 +120,320 +120,320   = 4 Psi",
        (r"step 2 rank \d: .* SKIPPED, scale 65536 -> 32768, skipped steps 1", 4),
        (r"step 3 rank \d: .* updated, scale 32768", 4),
        # underflow: measured on the step-0 gradients, unscaled against x 65536
        r"  unscaled +flushed to 0 +[\d,]+ \( *\d+\.\d\d%\) +subnormal +[\d,]+ \( *\d+\.\d\d%\)\n  x 65536 +flushed",
        # the scale grows back: x 2 after growth_interval = 2 clean steps, / 2 at the overflow
        r"  step 1: scale  65536 -> 131072   clean, 2 in a row: doubled\n  step 2: scale 131072 ->  65536   overflow",
        r"  step 4: scale  65536 -> 131072   clean, 2 in a row: doubled\n",
        r"\nTry:\n  1\. BLOWUP = 2\.0 \*\* 16",
        r"Mixed-precision ZeRO holds what the paper says, skips an overflow on every rank, and trains like one "
        r"process in float16\. All checks passed\."]),
    ("10_context_parallel.py", 4, [], [
        r"     1  kv 12-15 +- +kv 0-3 +F +kv 4-7 +F +kv 8-11 +F",  # contiguous: rank 0 skips, the others compute
        r"     1  kv 6-7,8-9 +--FF +kv 0-1,14-15 +F-F-",  # zig-zag: half of every block it meets
        (r"  hop \d: 0->1  1->2  2->3  3->0", 3),  # from the trace of a real ring_attention call
        r"zig-zag +2 +2 +2 +2 +max/min 1\n",
        r"rank 3: \(1, 4, 4, 8\) heads 0-3, tokens 12-15 +->  \(1, 1, 16, 8\) head 3, tokens 0-15",
        r"the 6 heads of each tp rank .* do not divide by cp 4: use --cp-algorithm ring or zigzag",
        (r"  (ring|zigzag|ulysses) +\d\.\de[-+]\d\d +3\.\d{12} \(", 3),
        r"\nTry:\n  1\. --local 2",
        r"Ring, zig-zag and Ulysses attention equal one process's to 1e-10; zig-zag balances the causal work "
        r"\(max/min 1 against contiguous' 7\)\. All checks passed\."]),
    ("11_experts.py", 2, [], [
        r"  sent     \(ep, E/ep\) rows to   r0: e0=2 e1=4   r1: e2=4 e3=6 ",  # route's choices, rank 0
        r"  received \(ep, E/ep\) rows from r0: e0=2 e1=4   r1: e0=3 e1=3 ",  # rank 1's sent, column 0
        r"  moe combine +12 rows 768 B +20 rows 1280 B\n",  # from the trace: rows x C x 8 bytes
        (r"  0\.1 +[01] +(\d+ +){8}1\.\d\d ", 2),  # with the aux loss: max/mean below 2 in both layers
        r"    e3: t0\.1 t4\.1 t5\.1 t6\.1  \| dropped: t7\.1 t3\.2\n",  # first choices queue first
        (r"  (0 \(dropless\)|1) +\d+/128 +3\.\d{12} +\d\.\de-\d\d ", 2),  # loss and gradients, dropless and not
        r"ep 2: loss and every gradient = one process's to 1e-10",
        r"\nTry:\n  1\. --local 4",
        r"All checks passed\."]),
    ("12_zero_bubble.py", 2, [], [
        r"after B: x\.grad\[0\] = \[.*\], weight\.grad = None, bias\.grad = None\n",
        r"x, weight, bias grads == one backward's \(np\.array_equal\): True",
        (r"  \d,\d,\d +1f1b +\d+ +(\d+) +\1 ", 2),  # 1F1B idles (p-1)(T_F+T_B+T_W), both cost ratios
        r"  1,1,1 +zb-h1 +\d+ +(\d+) +\1 ",  # ZB-H1 idles (p-1)(T_F+T_B-T_W) at unit costs
        r"  1,1,1 +zbv +[\d.]+ +([\d.]+) +>= \1 ",  # ZB-V reaches its bound (p-1) T_F / 2
        (r"(zb-h1|zbv) +losses( \d\.\d{10}){3}  matches one process", 2),
        r"\nTry:\n  1\. MICRO = 4",
        r"Zero-bubble schedules: B \+ W = backward bitwise; zb-h1 and zbv train as one process does\. "
        r"All checks passed\."]),
    ("13_offload.py", 2, [], [
        r"  measured = formula to the byte: 6 configurations x 2 ranks, every rank the same bytes",
        r"  ZeRO-3 \+ optimizer,params -> files +G/N = 1 +G/N = 1 +O/N \+ P/N = 7\n",  # 16 bytes/param, where
        # moved in one step: down G/N, up = the all-gathers' inputs, disk read = store + them, write = store
        r"  ZeRO-3 \+ optimizer,params -> files +27\.4 +56\.8 +248\.4 +191\.6  \| +27\.4 +56\.8 +248\.4 +191\.6\n",
        (r"vs ZeRO-[23]: 4 losses, 4 grad norms, 28,032 float32 masters; bitwise equal: True", 4),
        r"  20 files, 196,224 B = the disk column above .*: no file left",
        r"\nTry:\n  1\. --local 4",
        r"Offload: device bytes fall from 246\.4 to 82\.1 KiB \(ZeRO-2\) and from 219\.0 to 27\.4 KiB \(ZeRO-3\) per rank; "
        r"offloaded runs equal the runs without, bitwise\.\nAll checks passed\."]),
    # the planner runs its small layouts on threads itself (minidist.train.measure): one process only
    ("14_scale.py", None, [], [
        r"  pp rank 0: 17,504 elements a tp rank x \(2 \+ 2\) B float16; its ZeRO-1 shard, 1/2 = 8,752, x \(4 \+ 8\)",
        (r"     \d \(\d,\d,0,\d\) +(35,008 +35,008 +35,008 +70,016|34,112 +34,112 +34,112 +68,224) +\| +\1\n", 8),
        r"model states: 8 ranks x 4 components, measured = planned to the byte",
        r"bytes sent: 8 ranks x 4 axes \(dp, tp, pp, world\), measured = planned to the byte",
        r"  = [\d,]+ B a block x 4 blocks \+ the head [\d,]+ B .*\n    \+ the embeddings [\d,]+ B .* = 60,928 B",
        (r"     \d \(\d,0,\d,\d\) +(60,928 +60,928 +30,464 +60,928 +60,928) +\| +\1\n", 8),  # + activations
        r"model states and activations: 8 ranks x 5, measured = planned to the byte",
        r"the mean of the 4\s+ranks\s+that\s+share\s+a\s+tp\s+rank\s+is\s+the\s+plan's [\d,]+ B",  # tp (ZeRO + SP)
        (r"\n   [1-6]( +\d+\.\d){7}  (yes|no) ", 6),  # each 70B layout's bytes by component, fits or not
        r"\n   1( +\d+\.\d){4} +5\d\d\.\d( +\d+\.\d){2}  no ",  # dp 1024, ZeRO-3: 500+ GiB of activations
        r"python -m minidist\.plan --model llama3-70b --seq 8192 --search --gpus 1024 --global-batch-size 1024",
        r"\nTry:\n  1\. --local 4",
        r"The plan of 8 ranks = the run, to the byte .*\n\d of 6 layouts of llama3-70b fit on 1,024 GPUs\.\n"
        r"All checks passed\."]),
    ("15_recompute.py", 2, [], [
        r"= planned +5896\.0 KiB;  measured 5896\.0 KiB",  # a block's activations, planner = autograd graph
        r"= planned +256\.0 KiB;  measured 256\.0 KiB",  # recomputed: only the block input (B, T, C)
        r"a block keeps 23\.0x less: B x T x C x 8 = 262,144 B",
        r"rebuilt, one at a time \(last block first\): (5896\.0(, )?){4} KiB",
        r"\n    without +h\.0 h\.1 h\.2 h\.3 +-\n",  # block forwards, counted: once each ...
        r"\n    with recomputation +h\.0 h\.1 h\.2 h\.3 +h\.3 h\.2 h\.1 h\.0 \(last block first\)\n",  # ... twice
        r"backward grew by -?[\d.]+ ms: the blocks' forward run again \(timed alone: [\d.]+ ms",  # timed: any value
        r"52 gradients equal bitwise \(np\.array_equal\): True",
        (r"losses( 5\.\d{10}){3}; weights vs one process: max relative error \d\.\de-1\d", 2),
        r"tp all-reduces in one step: 22 without, 30 with recompute: 2 more per block",
        r"\nTry:\n  1\. CONFIG with block_size=128",
        r"Recomputation keeps 23\.0x less per block for one more forward of each block .*\nAll checks passed\."]),
    # it starts its own jobs (python -m minidist.run --hostfile ...): one process only
    # one process: 4 members of 2 thread ranks
    ("18_population_based_training.py", None, [], [
        (r"(?m)^  member \d: ranks \d-\d, lr \d\.\d\de-0\d$", 4),
        (r"(?m)^step +\d+  val loss (\d\.\d{4}, ){3}\d\.\d{4}  \(", 8),  # one line per ready point
        r"losses and gradient norms equal bitwise: True",
        r"its weights came through members",
        r"\nTry:\n",
        r"the lineage is recorded\. All checks passed\."]),
    # one process: 2 sub-groups of 1 thread rank
    ("19_hyperparameter_search.py", None, [], [
        r"=== 1\. 10 trials, 2 at a time, lr in \[0\.0001, 0\.3\] \(log\); rungs at \[4, 12\] of 36 steps ===",
        (r"(?m)^trial \d (completed|stopped early) at step (4|12|36): val loss \d\.\d{4} \(lr [\d.e-]+\); \d+ steps spent$", 10),
        r"(?m)^trial +lr +@4 +@12 +@36 +state$",
        r"final: the best trial is \d: val loss \d\.\d{4} \(lr [\d.e-]+\); 10 trials \(\d completed, \d stopped early\)",
        r"trials 2\.\.9: chosen again from the results each was chosen from: the same learning rates, to the last bit",
        r"\d trials stopped early at a rung, each outside the top 1/3 of the losses seen there",
        r"\nTry:\n",
        r"Each choice follows from the results before it, and each stop from its rung\. All checks passed\."]),
    # one process: part 2 on 4 thread ranks
    ("20_character_model.py", None, [], [
        r"vocabulary of 34: ",
        r"--data char: minidist reads the same ids and the vocabulary of meta\.pkl",
        r"  one process, --dropout 0\.2:  losses ([\d.]+), ([\d.]+), ([\d.]+)\n  dp 2 x tp 2 \(4 ranks\): +losses \1, \2, \3",
        r"drops nothing: ([\d.]+) twice",
        (r"(?m)^step +(1|251|500)  train loss [\d.]+  val loss [\d.]+$", 3),  # every 250 steps, and the last
        r"sample \(temperature 0\.8, top-k 20\):\n",
        r"val loss ~1\.88 after 2,000 iterations",
        r"  a training step here: \d+\.\d ms, this run's median",
        r"\nTry:\n",
        r"Dropout drew the same masks in every layout, and evaluation drew none\. All checks passed\."]),
    # one process: the run of part 2 on 8 thread ranks
    ("17_data_shards.py", None, [], [
        r"again: cached, nothing written",
        (r"(?m)^  dp \d pp \d cp \d +\[\d, \d\] +[\d. +]+ +32  train_\d{6}\.bin", 8),  # 2 rows x 8 positions x 2 B
        r"together: 256 bytes for a batch of 136 bytes \(4 rows x 17 tokens x 2 bytes\)",
        r"trained: losses \[([\d.]+), ([\d.]+)\], one process on the full batch \[\1, \2\]",
        r"with prefetch +each step waited +[\d.]+ ms",  # timed: any value
        r"the batches are the same, bitwise|The batches are the same, bitwise",
        r"\nTry:\n",
        r"the prefetched batches are the synchronous ones\. All checks passed\."]),
    ("16_several_machines.py", None, [], [
        r"   dp 2 x tp 2  tp groups inside a machine, dp groups across 2 machines\n",
        r"   tp 4         tp groups across 2 machines\n +warning: tensor-parallel groups cross machines",
        # said by the trainer, from MPI's split: hydra makes a machine of each of the two names of this
        # host, Open MPI one node of both (the lesson says so, and rehearses two machines under MPICH only)
        {"openmpi": r"   the trainer names no machine: MPI's split put ranks 0-3 on 1 machine"}.get(
            FLAVOUR, r"   the trainer: 2 machines \(rehearsed on one host, [\w.-]+\): ranks 0-1 on machine 0, ranks 2-3 on "
                     r"machine 1; tp groups inside a machine, dp groups across 2 machines\n"),
        r"largest relative difference \d\.\de-1\d \(<= 1e-10\)",
        r"\nTry: ",
        r"MPI's split says which ranks share a machine; the mesh says which groups cross machines\. All checks passed\."]),    # it starts its own Open MPI job with ULFM (python -m minidist.run): one process only. Under any other MPI
    # (MPICH) it says why in one line and stops with status 0, drawing nothing, as 08 does without a GPU
    ("21_fault_tolerance.py", None, [], [
        r"  step +4  ranks 1 lost \(ProcessFailedError\); going on with dp 2 on 2 ranks, the step redone",
        r"  step +4  1 replica joined \(rank 2, started in [\d.]+ s\); going on with dp 3 on 3 ranks",
        r"    replica 0 \[rank 0=p0\]  replica 1 \[rank 1=p2\]   lost: p1\n",
        r"    replica 0 \[rank 0=p0\]  replica 1 \[rank 1=p2\]  replica 2 \[rank 2=s0\*\]\n",
        r"= one process on the full batch, largest relative difference \d\.\de-\d\d \(<= 1e-10\)",
        r"\nTry:\n",
        r"the run equals one process\. All checks passed\."] if FLAVOUR == "openmpi" else [
        (r"Lesson 21 needs Open MPI 5's fault-tolerance interface \(ULFM\): (no mpiexec|.*has no fault-tolerance "
         r"interface \(ULFM\): a dead rank ends the job, and the restarting launcher \(python -m minidist\.run "
         r"--max-restarts N\) resumes it from its last checkpoint)", 1)]),
]
HANG_SECONDS = 300  # a safety net against a hung lesson, not a bound on its time


def assert_ends_well(script, stdout, png, output):
    """The lesson drew its picture into ``png`` and its last line is its self-check; lesson 08
    without a GPU, and 21 without Open MPI: its last line says why it stops, and it drew nothing."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert lines, output
    if script.startswith("08") and not gpu_count():
        assert lines[-1].startswith("Lesson 8 needs CuPy and an NVIDIA GPU") and not png.exists(), output
        return
    if script.startswith("21") and FLAVOUR != "openmpi":
        assert lines[-1].startswith("Lesson 21 needs Open MPI 5's fault-tolerance interface") and not png.exists(), \
            output
        return
    assert "All checks passed" in lines[-1], f"the last line is not the self-check: {lines[-1]!r}\n{output}"
    assert png.is_file() and png.stat().st_size > 0, f"no picture in {png}:\n{output}"


def assert_printed(stdout, expected, output):
    """Every expectation of a LESSONS row holds for ``stdout`` (``output``: shown on failure)."""
    for pattern in expected:
        if isinstance(pattern, tuple):
            pattern, n = pattern
            assert len(re.findall(pattern, stdout)) == n, f"{pattern!r} not printed {n} times:\n{output}"
        else:
            assert re.search(pattern, stdout), f"{pattern!r} not printed:\n{output}"


# The lessons the default run also starts under mpiexec (MPICH): the first, one with an uneven split
# and one that moves state to files. Every lesson for several ranks runs under mpiexec with --slow and
# under Open MPI in CI (.ci/openmpi), and in one process below and in the docs build: the same lesson
# code over threads instead of ranks.
UNDER_MPIEXEC_BY_DEFAULT = ("01", "03", "13")


@pytest.mark.skipif(find_mpiexec() is None, reason="mpiexec not found")
@pytest.mark.parametrize("script, ranks, expected", [
    pytest.param(s, n, v, id=s[:2], marks=() if s[:2] in UNDER_MPIEXEC_BY_DEFAULT else pytest.mark.slow)
    for s, n, _, v in LESSONS if n is not None])
def test_tutorial_under_mpiexec(script, ranks, expected, tmp_path):
    png = tmp_path / f"{script[:2]}.png"
    run = run_mpi(ranks, TUTORIALS / script, "--png", png, timeout=HANG_SECONDS)
    assert_printed(run.stdout, expected, run.output)
    assert_ends_well(script, run.stdout, png, run.output)


@pytest.mark.parametrize("script, args, expected",
                         [(s, a, v) for s, _, a, v in LESSONS if a is not None],
                         ids=[s[:2] for s, _, a, _ in LESSONS if a is not None])
def test_tutorial_in_one_process(script, args, expected, tmp_path):
    """Started as a learner first tries it, ``python tutorials/NN.py`` (or with ``--local N``): a
    lesson for several ranks runs them as threads in this process, and says so in one line."""
    png = tmp_path / f"{script[:2]}.png"
    done = subprocess.run([sys.executable, str(TUTORIALS / script), *args, "--png", str(png)], capture_output=True,
                          text=True, timeout=HANG_SECONDS, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert_printed(done.stdout, expected, done.stdout)
    assert_ends_well(script, done.stdout, png, done.stdout + done.stderr)
    alone = [line for line in done.stdout.splitlines() if "started alone, so its" in line]
    assert len(alone) == (not args and script[:2] not in ("00", "06", "08", "14", "16", "17", "18", "19", "20", "21")), done.stdout


def test_every_tutorial_is_listed():
    assert sorted(p.name for p in TUTORIALS.glob("[0-9][0-9]_*.py")) == sorted(s for s, *_ in LESSONS)


@pytest.mark.parametrize("script", [s for s, *_ in LESSONS], ids=[s[:2] for s, *_ in LESSONS])
def test_every_lesson_takes_png(script):
    """A design contract: every lesson draws its idea with --png PATH (here: its --help says so)."""
    done = subprocess.run([sys.executable, str(TUTORIALS / script), "--help"], capture_output=True, text=True,
                          timeout=HANG_SECONDS, cwd=REPO)
    assert done.returncode == 0 and "--png" in done.stdout, done.stdout + done.stderr


def test_the_pipeline_lesson_explains_its_first_step_per_rank():
    done = subprocess.run([sys.executable, str(TUTORIALS / "04_pipeline.py"), "--local", "2", "--explain"],
                          capture_output=True, text=True, timeout=HANG_SECONDS, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    rank0, rank1 = done.stdout.split("=== rank 0:")[1].split("=== rank 1:")
    def messages(story, op, where):  # the story's lines of one direction, each told with its label
        return re.findall(rf"^  {op} [\d.]+ KiB {where} \(pp\S* rank \d\) — \S", story, flags=re.M)
    assert len(messages(rank0, "isend", "to rank 1")) == len(messages(rank0, "irecv", "from rank 1")) == 8  # m = 8
    assert len(messages(rank1, "irecv", "from rank 0")) == len(messages(rank1, "isend", "to rank 0")) == 8


@pytest.mark.skipif(find_mpiexec() is None, reason="mpiexec not found")
def test_the_gpu_lesson_runs_its_staged_ring_on_the_fake_gpu(tmp_path):
    """Lesson 08's GPU path on the fake-CuPy double (one fake GPU, so no NCCL): the staged ring on
    device arrays, checked by the lesson against the host ring, its picture drawn. Its timings mean
    nothing here, and the lesson says so."""
    png = tmp_path / "08.png"
    run = run_mpi(2, "on_fake_gpu.py", 1, TUTORIALS / "08_gpu.py", "--png", png, timeout=HANG_SECONDS)
    assert "not CUDA-aware: each message is staged through pinned host memory" in run.stdout, run.output
    assert "2 ranks on fake GPU (host memory)" in run.stdout and "the times below mean nothing" in run.stdout, run.output
    assert "Every GPU result equals the host ring's" in run.stdout, run.output
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    assert "All checks passed" in lines[-1] and png.is_file() and png.stat().st_size > 0, run.output
