"""Build what a training run needs, from its :class:`~minidist.train.config.TrainConfig`: the
device, the data, the model (or this rank's shard / pipeline stage of it), the optimizer, the
gradient sync, the pipeline engine and mixed precision (train/describe.py says what results).
"""
import dataclasses
from pathlib import Path

import numpy as np

from minidist.amp import COMPUTE_DTYPES, DynamicLossScaler, MixedPrecision
from minidist.autograd import get_array_module
from minidist.checkpoint.hf import HFFormatError, from_hf, read_hf_config
from minidist.comm import LocalTransport, ProcessGroup, Trace
from minidist.comm.trace import KEEP_RECENT
from minidist.checkpoint.identity import data_identity
from minidist.data import ByteTokenizer, HFTokenizer, TokenIds, default_corpus, train_val_split
from minidist.data.folder import MANIFEST, Corpus, open_corpus, read_manifest
from minidist.data.meta_pkl import META, read_meta
from minidist.data.hf_tokenizer import tokenizer_bytes
from minidist.data.tokens import DataError
from minidist.device import require_cupy, use_gpu
from minidist.model import GPT, GPTConfig
from minidist.optim import SGD, AdamW
from minidist.parallel.context.context_parallel import context_parallel
from minidist.parallel.compose.gradients import flatten_on_buckets
from minidist.parallel.compose.grad_ownership import ReplicaGroups
from minidist.parallel.data.data_parallel import DataParallel
from minidist.parallel.expert.experts import expert_parallel
from minidist.parallel.zero.offload import Offload
from minidist.parallel.pipeline import PipelineEngine, PipelineStage, placement_of
from minidist.nn.recompute import recompute_blocks
from minidist.parallel.tensor.apply import tensor_parallel
from minidist.parallel.state import ShardedState, WholeState
from minidist.train.config import ConfigError, TrainConfig, bucket_bytes

def world_of_one(timeout: float = 60.0) -> ProcessGroup:
    """A one-rank world without MPI: what ``train`` runs on when it is given no world. Its trace
    keeps the last ``KEEP_RECENT`` events, as ``init()``'s does, so a long run's memory stays flat."""
    return ProcessGroup(LocalTransport.world(1, timeout)[0], trace=Trace(0, keep=KEEP_RECENT))


def select_device(cfg, local_rank: int) -> None:
    """``--device cuda``: CuPy and a GPU must be there (else a :class:`ConfigError` saying so, on
    every rank, before anything is sent), and this rank takes GPU ``local_rank % gpu_count``, its
    index among the ranks of its machine (``comm/machines.py``; with ``--backend nccl`` the NCCL
    group has chosen it already). Nothing for ``cpu``; sends nothing."""
    if cfg.device != "cuda":
        return
    try:
        require_cupy("--device cuda")
    except (ImportError, RuntimeError) as e:
        raise ConfigError(str(e)) from e
    if cfg.backend != "nccl":
        use_gpu(local_rank)


def load_data(cfg):
    """(cfg, corpus): the :class:`~minidist.data.folder.Corpus` of ``cfg.data`` (a file, or a folder of
    shards: data/folder.py), else of the default corpus, generated and cached on first use; and
    ``cfg`` with the model's vocabulary (:func:`model_vocab_size`). With an ``--init-from-hf``
    folder that holds a tokenizer.json a text file is encoded with it instead (:func:`tokenizer_for`).

    A bad folder, a token outside the vocabulary, or a part without one window of ``block_size + 1``
    tokens is a :class:`ConfigError` naming the file. The verdict depends on the files alone, so every
    rank reaches it before anything is sent (call this before building the mesh)."""
    path = Path(cfg.data) if cfg.data is not None else default_corpus(cfg.data_dir)
    tokenizer = tokenizer_for(cfg)
    try:
        if isinstance(tokenizer, HFTokenizer) and path.is_file():
            corpus = encoded_corpus(path, tokenizer)
        else:
            corpus = open_corpus(path)
    except DataError as e:
        raise ConfigError(f"--data {e}") from e
    theirs = Path(cfg.init_from_hf) / "tokenizer.json" if cfg.init_from_hf is not None else None
    if theirs is not None and theirs.is_file() and corpus.kind != "file" and corpus.tokenizer is not None and (
            corpus.tokenizer == "bytes" or tokenizer_bytes(corpus.tokenizer, ConfigError) != tokenizer_bytes(theirs, ConfigError)):
        raise ConfigError(f"--data {path} was tokenized with {corpus.tokenizer}, not with {theirs}: its ids would "
                          "mean other tokens to the --init-from-hf model")
    cfg = dataclasses.replace(cfg, vocab_size=model_vocab_size(cfg, corpus, path))
    if corpus.largest >= cfg.vocab_size:
        how = {"bytes": "byte ", None: ""}.get(corpus.tokenizer, f"{Path(corpus.tokenizer or '').name} ")
        whose = "the --init-from-hf model's" if cfg.init_from_hf else "the model's"
        shard = f" (in {Path(corpus.largest_in).name})" if corpus.kind != "file" else ""
        raise ConfigError(f"--data {path}: {how}token id {corpus.largest}{shard} is outside {whose} vocabulary of "
                          f"{cfg.vocab_size}")
    need = cfg.block_size + 1
    if min(len(corpus.train), len(corpus.val)) < need:
        raise ConfigError(f"--data {path}: {len(corpus.train) + len(corpus.val)} tokens, {len(corpus.train)} for "
                          f"training and {len(corpus.val)} for validation; each needs at least block_size + 1 = "
                          f"{need} (one window)" + (f". The last 10% validates: give at least {10 * need} tokens, "
                                                    "or a smaller --block-size" if corpus.kind == "file" else ""))
    return cfg, corpus


def encoded_corpus(path, tokenizer):
    """A text file encoded in memory with an ``--init-from-hf`` folder's tokenizer.json: a Corpus of
    arrays (the last 10% validates)."""
    try:
        tokens = tokenizer.encode(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text, which its tokenizer.json encodes ({e})") from e
    train, val = train_val_split(tokens, val_fraction=0.1)
    return Corpus(train, val, "file", tokenizer.vocab_size, int(tokens.max()) if len(tokens) else 0, str(path), "tokenizer.json",
                  data_identity(train))


def model_vocab_size(cfg, corpus, path) -> int:
    """The model's vocabulary: an ``--init-from-hf`` folder's; else ``--vocab-size`` (at least the
    data's); else the data's (bytes: 256; a manifest's or a tokenizer.json's). A :class:`ConfigError`
    when none says it."""
    if cfg.init_from_hf is not None:
        return read_hf_config(cfg.init_from_hf).vocab_size
    known = corpus.vocab_size
    if known is None and corpus.tokenizer is not None and corpus.tokenizer != "bytes":  # a tokenizer.json
        known = tokenizer_at(corpus.tokenizer, "--data").vocab_size
    if cfg.vocab_size:
        if known is not None and cfg.vocab_size < known:
            raise ConfigError(f"--vocab-size {cfg.vocab_size} is below the vocabulary of --data {path} ({known})")
        return cfg.vocab_size
    if known is None:
        raise ConfigError(f"--data {path}: its vocabulary is not recorded (no manifest.json, no tokenizer.json; "
                          f"its largest token is {corpus.largest}): give --vocab-size N")
    return known


def tokenizer_for(cfg):
    """How ``--data`` becomes tokens: the ``tokenizer.json`` of the ``--init-from-hf`` folder when it
    has one (:class:`~minidist.data.HFTokenizer`; without the ``tokenizers`` package, or with a file
    it cannot read, a :class:`ConfigError`), else the :class:`~minidist.data.ByteTokenizer`."""
    path = Path(cfg.init_from_hf) / "tokenizer.json" if cfg.init_from_hf is not None else None
    if path is None or not path.is_file():
        return ByteTokenizer()
    return tokenizer_at(path, "--init-from-hf")


def tokenizer_at(path, flag: str):
    """The :class:`~minidist.data.HFTokenizer` of the tokenizer.json ``path``, or the character
    vocabulary of nanoGPT's meta.pkl ``path`` (data/meta_pkl.py); a :class:`ConfigError` naming
    ``flag`` without the ``tokenizers`` package, or with a file it cannot read."""
    try:
        return read_meta(Path(path)) if Path(path).name == META else HFTokenizer(path)
    except (ImportError, ValueError) as e:  # a DataError is a ValueError
        raise ConfigError(f"{flag} {e}") from e


def sample_tokenizer(cfg):
    """How the sample at the end is written: the tokenizer of ``--init-from-hf``; else that of a
    ``--data`` folder (bytes, or the tokenizer.json its manifest names or that lies beside its shards,
    or nanoGPT's meta.pkl); else :class:`~minidist.data.TokenIds` (a folder of ids only: the sample is
    its ids). Reads one small file."""
    folder = Path(cfg.data) if cfg.data is not None else None
    if cfg.init_from_hf is not None or folder is None or not folder.is_dir():
        return tokenizer_for(cfg)
    if (folder / MANIFEST).is_file() and read_manifest(folder)["tokenizer"]["kind"] == "bytes":
        return ByteTokenizer()
    for name in ("tokenizer.json", META):
        if (folder / name).is_file():
            return tokenizer_at(folder / name, "--data")
    return TokenIds()


HF_MODEL_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")  # what --init-from-hf's folder decides


def with_hf_model(cfg):
    """``cfg`` with the model size of its ``--init-from-hf`` folder (n_layer, n_head, n_embd and
    block_size = n_positions; the vocabulary is read again by :func:`build_model`), after checking
    the folder's config.json and the names and shapes in its model.safetensors (no weights read).
    A bad folder, or a flag set (to a non-default value) that contradicts the folder, is a
    :class:`ConfigError`. Reads files only: call it before anything is sent. ``cfg`` itself when
    there is no folder."""
    if cfg.init_from_hf is None:
        return cfg
    try:
        config = read_hf_config(cfg.init_from_hf)
    except HFFormatError as e:
        raise ConfigError(f"--init-from-hf {e}") from e
    default = TrainConfig()
    conflicts = [f"--{f.replace('_', '-')} {getattr(cfg, f)} (the folder has {getattr(config, f)})"
                 for f in HF_MODEL_FIELDS
                 if getattr(cfg, f) != getattr(default, f) and getattr(cfg, f) != getattr(config, f)]
    if conflicts:
        raise ConfigError(f"--init-from-hf {cfg.init_from_hf} decides the model's size; these flags contradict "
                          f"it: {', '.join(conflicts)} (leave them out)")
    return dataclasses.replace(cfg, **{f: getattr(config, f) for f in HF_MODEL_FIELDS})


def build_model(cfg, tp_group=None, cp_group=None, ep_group=None, announce: bool = False):
    """A GPT of the configured size and vocabulary (``cfg.vocab_size``; 0: bytes, 256), initialised from ``cfg.seed``; with
    ``cfg.tp > 1`` this rank's tensor-parallel shard of it over ``tp_group`` (the whole GPT is built,
    then cut: minidist/parallel/tensor/apply.py); with ``cfg.cp > 1`` running on this rank's tokens of
    every sequence, attention over ``cp_group`` (context_parallel.py); with ``cfg.n_experts`` a
    mixture of experts (minidist/moe.py), and with ``cfg.ep > 1`` holding its block of the experts,
    tokens sent over ``ep_group`` (minidist/parallel/expert/experts.py). Initialised on the host
    (the same values on any device), then moved to ``cfg.device``. With ``cfg.init_from_hf`` the
    GPT of that Hugging Face folder (its vocabulary, tied or untied head) holding its weights:
    every rank reads the whole file, and tensor parallelism then keeps its part (the checkpoints'
    split rule; vocabulary padding rows zero), and with ``announce`` (global rank 0) says so in one
    line. Sends nothing."""
    state = None
    if cfg.init_from_hf is not None:
        try:
            state, config = from_hf(cfg.init_from_hf)
        except HFFormatError as e:
            raise ConfigError(f"--init-from-hf {e}") from e
    else:
        config = GPTConfig(vocab_size=cfg.vocab_size or ByteTokenizer.vocab_size, block_size=cfg.block_size,
                           n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, n_experts=cfg.n_experts,
                           top_k=cfg.top_k, moe_every=cfg.moe_every, capacity_factor=cfg.capacity_factor,
                           aux_loss_coef=cfg.aux_loss_coef, bias=not cfg.no_bias)
    dtype = np.dtype(COMPUTE_DTYPES.get(cfg.dtype, cfg.dtype)).name  # mixed precision: how the weights are stored
    model = GPT(config, seed=cfg.seed, dtype=dtype)
    if state is not None:
        load_full_state(model, state)
        if announce:
            print(f"initialised from {cfg.init_from_hf}: {sum(p.data.size for p in model.parameters()):,} parameters "
                  f"of a Hugging Face GPT-2 ({config.n_layer} layers, {config.n_head} heads, {config.n_embd} wide, "
                  f"vocabulary {config.vocab_size}, {config.block_size} positions"
                  + (", tied embeddings)" if config.tie_embeddings else ", untied head)"), flush=True)
    if cfg.tp > 1:
        tensor_parallel(model, tp_group, sequence_parallel=cfg.sequence_parallel)
    if cfg.cp > 1:
        context_parallel(model, cp_group, cfg.cp_algorithm)
    if cfg.ep > 1:
        expert_parallel(model, ep_group)
    return model.to(cfg.device)


def load_full_state(model, state: dict) -> None:
    """Overwrite every parameter of the whole GPT ``model`` with its value in the full state_dict
    ``state`` ({GPT-2 name: full array}), cast to the parameter's dtype. Sends nothing."""
    for name, p in model.named_parameters():
        p.data[...] = get_array_module(p.data).asarray(state[name])


def optimizer_settings(cfg) -> dict:
    """The hyper-parameters of ``cfg.optimizer``: AdamW (its betas) or SGD with momentum."""
    extra = {"betas": (cfg.beta1, cfg.beta2)} if cfg.optimizer == "adamw" else {"momentum": cfg.momentum}
    return dict(lr=cfg.lr, weight_decay=cfg.weight_decay, **extra)


def build_optimizer(model, cfg, named_parameters=None):
    """AdamW or SGD (:func:`optimizer_settings`) over the model's named parameters (or over
    ``named_parameters``: mixed precision's float32 masters)."""
    params = named_parameters if named_parameters is not None else model.named_parameters()
    return (AdamW if cfg.optimizer == "adamw" else SGD)(params, **optimizer_settings(cfg))


def build_loss_scaler(cfg, world):
    """--dtype float16 / bfloat16: the loss scaler, over ``world`` (every rank must skip an
    overflowing step together): dynamic for float16 unless --loss-scale fixes it, a fixed scale
    (default 1) for bfloat16. None for float32 / float64."""
    if cfg.dtype not in COMPUTE_DTYPES:
        return None
    if cfg.dtype == "float16" and cfg.loss_scale == "dynamic":
        return DynamicLossScaler(growth_interval=cfg.loss_scale_window, group=world)
    return DynamicLossScaler.static(1.0 if cfg.loss_scale == "dynamic" else float(cfg.loss_scale), group=world)


def build_parallel(cfg, mesh):
    """This rank's part of the run: (model, state, engine). Collective over ``mesh``.

    ``model``: the GPT, its tensor-parallel shard over ``mesh.tp_group``, and with ``cfg.pp > 1`` the
    PipelineStage of this pp rank (blocks recomputed in backward with ``cfg.recompute``).
    ``state``: the model's state (parallel/state.py), chosen here and nowhere else: with ``cfg.zero``
    (or ``cfg.offload``) ZeRO's shards over ``mesh.dp_cp_group`` (the dp group, and under context
    parallelism the cp ranks too: they hold the same parameters), which sync the gradients, hold the
    sharded float32 masters and the loss scaler under mixed precision, and with offload keep their
    state on the host or in ``cfg.offload_dir`` (parallel/zero/offload.py); else whole tensors: SGD /
    AdamW, a DataParallel, and with ``--dtype float16 / bfloat16`` the MixedPrecision whose float32
    masters the optimizer updates. ``engine``: the PipelineEngine running ``cfg.schedule`` (None
    without pipeline parallelism)."""
    model = build_model(cfg, mesh.tp_group, mesh.cp_group, mesh.ep_group, announce=mesh.rank == 0)
    if cfg.recompute == "full":
        recompute_blocks(model)
    if cfg.pp > 1:
        model = PipelineStage(model, mesh.pp_rank, cfg.pp, cfg.virtual_stages, placement=placement_of(cfg.schedule))
    scaler = build_loss_scaler(cfg, mesh.world)
    mixed = cfg.dtype if scaler is not None else None
    if cfg.zero_optimizer:
        offload = (Offload(cfg.offload, cfg.offload_dir, mesh.rank, gpu=cfg.device == "cuda")
                   if cfg.offload != "none" else None)
        replicas = ReplicaGroups(mesh.dp_cp_group, replicas=cfg.dp, experts=mesh.expert_dp_group)
        state = ShardedState(model, replicas, cfg.zero, cfg.optimizer, mixed_precision=mixed, scaler=scaler,
                             offload=offload, reshard_after_forward=cfg.pp == 1, **optimizer_settings(cfg))
    else:
        dp = DataParallel(model, mesh.dp_cp_group, bucket_bytes=bucket_bytes(cfg.bucket_mb), replicas=cfg.dp,
                          expert_group=mesh.expert_dp_group)
        amp = MixedPrecision(model, cfg.dtype, scaler) if mixed else None
        optimizer = build_optimizer(model, cfg, amp.master_parameters() if amp else None)
        flatten_on_buckets(optimizer, dp)  # one update per bucket (compose/gradients.py)
        state = WholeState(model, optimizer, dp, amp)
    engine = None
    if cfg.pp > 1:
        engine = PipelineEngine(model, mesh, cfg.schedule, cfg.micro_batches, cfg.virtual_stages, no_sync=state.no_sync)
    return model, state, engine
