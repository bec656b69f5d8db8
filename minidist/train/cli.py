"""The trainer's command line: a flag per field of :class:`~minidist.train.config.TrainConfig`, grouped
for ``--help``, and which rank prints a usage error before MPI has started."""
import argparse
import contextlib
import dataclasses
import io

from minidist.device import DEVICES
from minidist.optim.state_bytes import ITEMSIZE, OPTIMIZERS
from minidist.parallel.context.context_parallel import ALGORITHMS
from minidist.parallel.pipeline import SCHEDULES
from minidist.parallel.spec import BACKENDS, flag
from minidist.parallel.zero.offload import CHOICES as OFFLOAD_CHOICES
from minidist.train.config import TrainConfig
from minidist.tune.asha import SCHEDULERS
from minidist.tune.samplers import BATCH_RULES, SAMPLERS

LAUNCHER_RANKS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")  # hydra, Open MPI, PMIx, srun


def launcher_rank(environ) -> int:
    """This process's rank as its launcher set it in ``environ`` before MPI started (the first of
    :data:`LAUNCHER_RANKS`; the entry point passes ``os.environ``), 0 when none is (run alone; under an
    unknown launcher every rank then prints its usage error, as without this)."""
    for value in (environ.get(name, "") for name in LAUNCHER_RANKS):
        if value.isdigit():
            return int(value)
    return 0


def parse_args(argv=None, quiet: bool = False) -> TrainConfig:
    """The command line as a :class:`TrainConfig` (flags are the field names with dashes). A usage
    error exits with status 2 and --help with 0, as argparse does, printing nothing when ``quiet``
    (every rank of a job but rank 0, so that a job prints them once)."""
    silenced = io.StringIO()
    with (contextlib.redirect_stdout(silenced) if quiet else contextlib.nullcontext()), \
            (contextlib.redirect_stderr(silenced) if quiet else contextlib.nullcontext()):
        return TrainConfig(**vars(argument_parser().parse_args(argv)))


CHOICES = {"mode": ["collective", "ps", "pbt", "search"], "sampler": list(SAMPLERS), "scheduler": list(SCHEDULERS),
           "batch_rule": list(BATCH_RULES), "dtype": list(ITEMSIZE), "optimizer": list(OPTIMIZERS),
           "schedule": list(SCHEDULES), "cp_algorithm": list(ALGORITHMS), "zero": [0, 1, 2, 3],
           "offload": list(OFFLOAD_CHOICES), "device": list(DEVICES), "backend": list(BACKENDS),
           "recompute": ["none", "full"]}
BARE = {"recompute": "full"}  # a flag that alone means this value (--recompute: recompute every block)
METAVARS = {int: "N", float: "X", "data": "PATH", "export": "PATH", "loss_scale": "S",
            "offload": '{none,optimizer,"optimizer,params"}', "explore": "NAMES", "log_scale": "NAMES"}  # else DIR

PAIRS = ("lr_range", "weight_decay_range", "warmup_range", "grad_clip_range")

GROUPS = {  # the flags of --help, by what they are about: field -> help
    "training": {
        "steps": "optimizer steps", "batch_size": "sequences per step (the global batch)",
        "seed": "seeds the weights and the batches", "optimizer": "update rule",
        "lr": "peak learning rate (0: the weights never move, to evaluate or convert a model)",
        "min_lr": "learning rate at the end of the cosine decay (default: 3e-4, or --lr where that is lower)",
        "warmup": "linear warmup steps", "momentum": "SGD momentum",
        "beta1": "AdamW: decay of the gradient's running mean",
        "beta2": "AdamW: decay of the squared gradient's running mean (nanoGPT's character recipe: 0.99)", "weight_decay": "decay of >= 2-D parameters",
        "grad_clip": "max global grad norm (0: off)"},
    "model": {
        "n_layer": "transformer blocks", "n_head": "attention heads", "n_embd": "embedding width",
        "block_size": "context length T", "n_experts": "experts per MoE layer (0: a dense GPT)",
        "top_k": "experts each token is routed to", "moe_every": "every n-th block has experts (the last of every n)",
        "capacity_factor": "0: dropless; c > 0: each expert takes at most ceil(c k T / E) of each sequence's "
                           "assignments, the rest are dropped",
        "aux_loss_coef": "weight of the load-balancing loss (per sequence, Switch-style)",
        "no_bias": "no biases in the Linear and LayerNorm layers (nanoGPT's bias=False)",
        "dropout": "drop probability in training steps, where nanoGPT drops: the embeddings, the attention "
                   "probabilities, the attention's and the MLP's output projections (nanoGPT's "
                   "shakespeare_char config: 0.2, its CPU recipe: 0)",
        "vocab_size": "the model's vocabulary (0: the data's: 256 bytes, a prepared folder's manifest, a "
                      "tokenizer.json beside the shards; a folder without either needs it)",
        "init_from_hf": "start from a local Hugging Face GPT-2 folder (config.json + model.safetensors; its "
                        "tokenizer.json, if there, tokenizes --data): the model's size comes from it"},
    "data": {
        "data": "(default: the generated corpus) a text file, one token per byte, or a folder of token shards: "
                "prepared by python -m minidist.data.prepare, llm.c's, or nanoGPT's train.bin / val.bin",
        "no_prefetch": "read each step's batch when the step needs it, not in the background during the step before",
        "data_dir": "cache folder of the generated corpus (default: ~/.cache/minidist)",
        "eval_every": "steps between validation-loss estimates", "eval_iters": "validation batches per estimate"},
    "parallelism": {
        "dp": "data-parallel replicas", "pp": "pipeline stages per replica", "tp": "tensor-parallel ranks per "
        "pipeline stage", "cp": "context-parallel ranks: each holds 1/cp of every sequence's tokens",
        "ep": "expert-parallel ranks, inside dp: each holds 1/ep of every MoE layer's experts, tokens reach them "
              "by all-to-all",
        "sequence_parallel": "also split the LayerNorm and residual activations along the sequence over tp",
        "cp_algorithm": "how attention reaches the other cp ranks' tokens: ring (K/V blocks passed around), zigzag "
                        "(the ring with balanced causal work), ulysses (all-to-alls: heads split over cp)",
        "micro_batches": "micro-batches per step and dp rank (gradient accumulation; the pipeline's units)",
        "schedule": "pipeline schedule", "virtual_stages": "model chunks per pipeline rank (interleaved; 2 for zbv)",
        "zero": "ZeRO stage: shard optimizer states (1), + gradients (2), + parameters (3) over dp",
        "bucket_mb": "data-parallel gradient bucket size in MiB: a bucket closes once it holds this much (any "
                     "positive size: below the smallest parameter's, one bucket per parameter; above the model's, "
                     "one bucket)",
        "backend": "collectives: ring (hand-written, over MPI point-to-point), mpi (MPI's own), nccl (GPU buffers, "
                   "--device cuda)",
        "mode": "collective (all-reduce and friends), ps (parameter servers: ranks 0..K-1 serve, the rest work) or "
                "pbt (population-based training: --population members, each a collective run) or search "
                "(hyper-parameter search: --trials runs, --parallel at a time)",
        "population": "--mode pbt: members, each of world / K ranks in the layout the other flags give",
        "ready_every": "--mode pbt: steps between the members' agreeing on their validation losses (exploit, explore)",
        "explore": "--mode pbt: the hyper-parameters a copy perturbs (x0.8 or x1.2), comma-separated: lr, "
                   "weight_decay, grad_clip, min_lr",
        "exploit": "--mode pbt: truncation (the bottom --quantile copies the top) or tournament (each member "
                   "meets one other)",
        "quantile": "--mode pbt: the fraction of members that copy, and that are copied",
        "lr_range": "--mode pbt: each member's first --lr, drawn log-uniform in [A, B] (default: --lr for all); "
                    "--mode search: the range of --lr searched",
        "weight_decay_range": "--mode pbt: each member's first --weight-decay, drawn log-uniform in [A, B]; "
                              "--mode search: the range of --weight-decay searched",
        "warmup_range": "--mode search: the range of --warmup searched (integers)",
        "grad_clip_range": "--mode search: the range of --grad-clip searched",
        "log_scale": "--mode search: the hyper-parameters searched on a log scale, comma-separated (the others: "
                     "linear)",
        "trials": "--mode search: trials in all, each a run of --steps steps at most",
        "parallel": "--mode search: trials at a time, each on world / K ranks in the layout the other flags give",
        "sampler": "--mode search: where the next trials go: random, or gp (Bayesian optimization: a Gaussian "
                   "process, expected improvement)",
        "batch_rule": "--mode search, --sampler gp: how a round's trials are chosen together: believer (kriging "
                      "believer) or liar (constant liar)",
        "scheduler": "--mode search: early stopping: none, or asha (a trial goes on past a rung only in the top "
                     "1 / --reduction there)",
        "grace": "--mode search, --scheduler asha: steps to the first rung",
        "reduction": "--mode search, --scheduler asha: the rungs' ratio, and 1 / the fraction that goes on",
        "servers": "--mode ps: parameter-server ranks", "straggler": "--mode ps: seconds of sleep added to every "
        "step of worker 0", "staleness": "--mode ps: asynchronous with this staleness bound (-1: synchronous)"},
    "precision and memory": {
        "dtype": "parameter and activation dtype; float16 / bfloat16 (emulated): mixed precision, float32 masters",
        "loss_scale": "mixed precision: 'dynamic' (float16) or a fixed scale",
        "loss_scale_window": "dynamic loss scaling: clean steps before the scale doubles",
        "device": "where parameters, gradients, optimizer states and batches live: cpu (NumPy) or cuda (CuPy, "
                  "one GPU per rank: local rank modulo the GPUs of its machine)",
        "recompute": "recompute each block's activations in backward instead of keeping them",
        "offload": "ZeRO-Offload: keep the optimizer shard (masters, moments) off the device and update it on the "
                   "host; optimizer,params: with --zero 3 the parameter shards too",
        "offload_dir": "ZeRO-Infinity: keep the offloaded state in memory-mapped files under this folder instead of "
                       "host memory",
        "system_allocator": "keep glibc's default malloc settings (by default the trainer keeps freed memory "
                            "mapped for the next step: minidist/allocator.py)"},
    "checkpoints and faults": {
        "ckpt_dir": "directory of sharded checkpoints (step-<n>/ folders)",
        "save_every": "steps between checkpoints (0: none)", "keep": "newest checkpoints kept",
        "resume": "continue from the newest valid checkpoint in --ckpt-dir (in any layout); refused (exit 2) when "
                  "none is valid or it is another run's (model, seed, data or hyper-parameters differ)",
        "async_save": "write checkpoints in a background thread while training goes on",
        "comm_timeout": "seconds a collective or point-to-point call waits for a peer before the job fails "
                        "(exit status 3) naming the rank that never arrived",
        "fault_tolerant": "a lost data-parallel replica is dropped and the run goes on, live (Open MPI 5 started "
                          "with --with-ft ulfm --mca mpi_ft_detector true; ZeRO-1 or 2)",
        "fail_at_step": "fault injection: rank --fail-rank kills itself at the start of this step (-1: never; "
                        "not when resuming)", "fail_rank": "the rank --fail-at-step kills",
        "fail_hang": "fault injection: rank --fail-rank hangs at --fail-at-step instead (sleeps, no MPI call)",
        "spares": "--fault-tolerant: replicas the run may start live (MPI_Comm_spawn, Open MPI 5), each joining at "
                  "once when a replica is lost, with the weights and optimizer state of a live one",
        "grow_at": "with --spares: the spares join as new replicas at this step's start (dp + S; -1: only to "
                   "replace lost ones)"},
    "output and inspection": {
        "out": "directory for metrics.jsonl", "sample_tokens": "tokens sampled at the end",
        "export": "write the consolidated full-model state_dict here at the end (.npz or .safetensors; nanoGPT / "
                  "PyTorch layout, not Hugging Face's: use --export-hf)",
        "export_hf": "write a Hugging Face GPT-2 folder here at the end (config.json + model.safetensors, for "
                     "transformers.GPT2LMHeadModel.from_pretrained)",
        "trace": "run directory for python -m minidist.inspect: DIR/trace/rank<r>.jsonl, DIR/memory/rank<r>.json",
        "explain": "print each rank's first step: what it holds, what it sends to whom"},
}


def argument_parser() -> argparse.ArgumentParser:
    """The trainer's argparse parser: a flag per field of :class:`TrainConfig`, in the groups of
    :data:`GROUPS`, each default shown once."""
    resolved = TrainConfig()  # the type of a field whose default is None (--min-lr: float)
    p = argparse.ArgumentParser(prog="python -m minidist.train", description="Train a GPT: ``python -m minidist.train``.",
                                usage="%(prog)s [--flag value ...]  (--help lists every flag)")  # an error: 2 lines
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for title, helps in GROUPS.items():
        group = p.add_argument_group(title)
        for name, text in helps.items():
            default = fields[name].default
            if default is not None and default is not False and "default" not in text:
                text += " (default: %(default)s)"
            if isinstance(default, bool):
                group.add_argument(flag(name), action="store_true", help=text)
                continue
            if name in BARE:  # --recompute, or --recompute none | full
                group.add_argument(flag(name), nargs="?", const=BARE[name], default=default, choices=CHOICES[name],
                                   help=text)
                continue
            if name in PAIRS:  # two numbers: --lr-range A B
                group.add_argument(flag(name), type=float, nargs=2, default=None, help=text, metavar=("A", "B"))
                continue
            kind = type(getattr(resolved, name)) if getattr(resolved, name) is not None else str
            metavar = METAVARS.get(name, None if name in CHOICES else METAVARS.get(kind, "DIR"))
            group.add_argument(flag(name), type=kind, default=default, choices=CHOICES.get(name), help=text,
                               metavar=metavar)
    return p
