"""Hugging Face's GPT-2 format, in and out: a folder with ``config.json`` and ``model.safetensors``
that ``transformers.GPT2LMHeadModel.from_pretrained(folder)`` loads, and back.

The conversion rule, in one place (:func:`to_hf` and :func:`from_hf` both use it):

    names       the same GPT-2 names (``transformer.h.0.attn.c_attn.weight``); folders saved from
                GPT2Model (``h.0...`` without ``transformer.``) are read too, and the causal-mask
                buffers (``attn.bias``, ``attn.masked_bias``) of old checkpoints are skipped
    Conv1D      GPT-2's c_attn, attn.c_proj, c_fc and mlp.c_proj are Conv1D, weight (in, out);
                minidist's are Linear, weight (out, in): those four weights are transposed, both ways
                (attn.c_proj is square: forgetting it would load silently transposed)
    lm_head     Linear in both, (vocab, C); written only when it is not tied to ``transformer.wte``
                (``tie_word_embeddings``)
    config      n_layer, n_head, n_embd, vocab_size (unpadded), n_positions = n_ctx = block_size;
                ``gelu_new`` (minidist's GELU is the tanh approximation), layer_norm_epsilon 1e-5,
                n_inner 4 n_embd, every dropout 0, attention scaled by 1/sqrt(head size)

Anything minidist's GPT would compute differently (another activation, epsilon or MLP width,
attention scaled by layer, no biases) is refused with an :class:`HFFormatError` naming it, never
loaded approximately. Nothing here sends anything; no pickle anywhere.

    write_hf("gpt2-out", state, config)      # state: {GPT-2 name: full array}, config: GPTConfig
    state, config = from_hf("gpt2-out")      # the same arrays and GPTConfig back
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save as safetensors_bytes

from minidist.files import real_folder, write_atomically
from minidist.untrusted import read_bounded
from minidist.checkpoint.format import CheckpointError
from minidist.checkpoint.schema import parse_json
from minidist.model import GPTConfig

CONFIG, WEIGHTS = "config.json", "model.safetensors"
CONV1D = ("c_attn", "c_proj", "c_fc")  # modules inside a block whose weight GPT-2 stores as (in, out)
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both are 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
EPS = 1e-5  # minidist's LayerNorm epsilon
FLOATS = ("F16", "F32", "F64")  # the safetensors dtypes NumPy reads
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")  # not parameters: old checkpoints stored the causal mask
MAX_CONFIG_BYTES = 1 << 20  # GPT-2's config.json is about 1 KB: a larger one is not a config, and is not read whole
SIZE_LIMIT = 2 ** 63  # every size of config.json is below it: NumPy's shapes and their products are int64
TENSORS_PER_BLOCK = 12  # ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj: a weight and a bias each


class HFFormatError(ValueError):
    """A folder that is not a GPT-2 minidist can compute exactly (the message names what is wrong)."""


def is_conv1d(name: str) -> bool:
    """Whether GPT-2 stores parameter ``name``'s weight transposed, as (in_features, out_features)."""
    module, kind = name.split(".")[-2:]
    return name.startswith("transformer.h.") and module in CONV1D and kind == "weight"


def hf_shapes(config: GPTConfig) -> dict:
    """{name: shape} of every tensor of ``config``'s model in Hugging Face's layout (lm_head.weight
    only when untied)."""
    C, V, T = config.n_embd, config.vocab_size, config.block_size
    shapes = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (T, C)}
    for i in range(config.n_layer):
        h = f"transformer.h.{i}."
        shapes.update({h + "ln_1.weight": (C,), h + "ln_1.bias": (C,),
                       h + "attn.c_attn.weight": (C, 3 * C), h + "attn.c_attn.bias": (3 * C,),
                       h + "attn.c_proj.weight": (C, C), h + "attn.c_proj.bias": (C,),
                       h + "ln_2.weight": (C,), h + "ln_2.bias": (C,),
                       h + "mlp.c_fc.weight": (C, 4 * C), h + "mlp.c_fc.bias": (4 * C,),
                       h + "mlp.c_proj.weight": (4 * C, C), h + "mlp.c_proj.bias": (C,)})
    shapes.update({"transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,)})
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (V, C)
    return shapes


def hf_config(config: GPTConfig) -> dict:
    """config.json of ``config``'s model for ``transformers.GPT2Config``."""
    if not config.bias:
        raise HFFormatError("Hugging Face's GPT-2 always has biases: a model built with bias=False has no GPT-2 form")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": config.vocab_size, "n_positions": config.block_size, "n_ctx": config.block_size,
            "n_embd": config.n_embd, "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": None,
            "activation_function": "gelu_new", "layer_norm_epsilon": EPS,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": config.tie_embeddings, "torch_dtype": "float32"}


def to_hf(state: dict, config: GPTConfig) -> tuple[dict, dict]:
    """(tensors, config.json dict) in Hugging Face's layout from a full minidist state_dict
    ({GPT-2 name: array}, as ``--export`` writes it): Conv1D weights transposed, a tied lm_head left out."""
    expected = hf_shapes(config)
    tensors = {}
    for name in expected:
        if name not in state:
            raise HFFormatError(f"the state_dict has no {name}")
        value = np.asarray(state[name])
        tensors[name] = np.ascontiguousarray(value.T if is_conv1d(name) else value)
    return tensors, hf_config(config)


def write_hf(folder, state: dict, config: GPTConfig) -> None:
    """Write FOLDER/config.json and FOLDER/model.safetensors (metadata {"format": "pt"}) for ``state``."""
    tensors, cfg = to_hf(state, config)
    folder = real_folder(folder)  # a link there is refused, not followed
    write_atomically(folder / WEIGHTS, safetensors_bytes(tensors, metadata={"format": "pt"}))
    write_atomically(folder / CONFIG, (json.dumps(cfg, indent=2) + "\n").encode())


def gpt_config(hf: dict, where: str = CONFIG) -> GPTConfig:
    """The GPTConfig of a parsed config.json; :class:`HFFormatError` listing every field minidist's
    GPT cannot compute exactly (defaults are ``transformers.GPT2Config``'s)."""
    problems = []
    if hf.get("model_type", "gpt2") != "gpt2":
        problems.append(f"model_type is {hf.get('model_type')!r}, not 'gpt2'")
    archs = hf.get("architectures") or ["GPT2LMHeadModel"]
    if not isinstance(archs, list) or not any(a in ("GPT2LMHeadModel", "GPT2Model") for a in archs):
        problems.append(f"architectures {archs!r} is not GPT2LMHeadModel")
    sizes = {}
    for field in ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions"):
        value = hf.get(field, hf.get("n_ctx") if field == "n_positions" else None)
        if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value < SIZE_LIMIT):
            problems.append(f"{field} must be a positive integer below 2**63, got {value!r}")
        sizes[field] = value
    if not problems and sizes["n_embd"] % sizes["n_head"]:
        problems.append(f"n_embd {sizes['n_embd']} is not divisible by n_head {sizes['n_head']}")
    if hf.get("activation_function", "gelu_new") not in ACTIVATIONS:
        problems.append(f"activation_function {hf.get('activation_function')!r}: minidist computes the tanh "
                        f"GELU ({' / '.join(ACTIVATIONS)})")
    if hf.get("layer_norm_epsilon", EPS) != EPS:
        problems.append(f"layer_norm_epsilon {hf.get('layer_norm_epsilon')}: minidist's LayerNorm uses {EPS}")
    width = 4 * sizes["n_embd"] if isinstance(sizes["n_embd"], int) else None
    if hf.get("n_inner") is not None and hf.get("n_inner") != width:
        problems.append(f"n_inner {hf.get('n_inner')}: minidist's MLP is 4 n_embd wide")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
        problems.append("attention must be scaled by 1/sqrt(head size) only (scale_attn_weights true, "
                        "scale_attn_by_inverse_layer_idx false)")
    if hf.get("add_cross_attention", False):
        problems.append("add_cross_attention: minidist's GPT has no cross-attention")
    if problems:
        raise HFFormatError(f"{where}: not a GPT-2 minidist can load:\n  - " + "\n  - ".join(problems))
    return GPTConfig(vocab_size=sizes["vocab_size"], block_size=sizes["n_positions"], n_layer=sizes["n_layer"],
                     n_head=sizes["n_head"], n_embd=sizes["n_embd"], bias=True,
                     tie_embeddings=bool(hf.get("tie_word_embeddings", True)))


def _canonical(name: str) -> str:
    """A tensor name as GPT2LMHeadModel names it (GPT2Model's folders lack ``transformer.``)."""
    return name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name


def read_config_json(path: Path) -> dict:
    """The object in config.json ``path``, read as every untrusted file is (minidist/untrusted.py): a
    regular file (a link to one is followed: Hugging Face's cache links a snapshot's files to its
    blobs) never opened if it is a FIFO or a device, at most :data:`MAX_CONFIG_BYTES` read, strict
    JSON (no NaN, no 1e999) nested at most 64 deep. :class:`HFFormatError` naming the file otherwise."""
    data = read_bounded(path, MAX_CONFIG_BYTES, "a GPT-2 config.json", HFFormatError)
    try:
        hf = parse_json(data, path, "a GPT-2 config.json")
    except CheckpointError as e:
        raise HFFormatError(str(e)) from e
    if not isinstance(hf, dict):
        raise HFFormatError(f"{path}: not a JSON object")
    return hf


def capacity_problems(config: GPTConfig, n_tensors: int, file_bytes: int) -> list[str]:
    """What ``config`` asks of a model.safetensors holding ``n_tensors`` tensors (its header's) in
    ``file_bytes`` bytes: no more blocks than the header has tensors (each block has 12), no more
    parameters than the file has bytes for (2 bytes each at least: F16). The blocks come first, so what
    is built per block is bounded by the header (``n_layer`` 10**9 builds nothing); a few blocks too
    many are left to the comparison by name, which says which tensors are missing."""
    if config.n_layer > n_tensors:
        return [f"{CONFIG}'s n_layer {config.n_layer}: more blocks than {WEIGHTS} holds tensors ({n_tensors}; "
                f"a block has {TENSORS_PER_BLOCK})"]
    numel = sum(math.prod(shape) for shape in hf_shapes(config).values())
    if 2 * numel > file_bytes:
        return [f"{WEIGHTS} is {file_bytes} bytes; the model of {CONFIG} has {numel} parameters, at least 2 bytes each"]
    return []


def read_hf_config(folder) -> GPTConfig:
    """The GPTConfig of the Hugging Face folder ``folder``, after checking, without reading the
    weights, that model.safetensors holds exactly the tensors of that model at their shapes (an
    untied lm_head is required; a tied one may be there and is ignored). Every size of config.json
    is checked against what model.safetensors can hold (:func:`capacity_problems`) before anything
    proportional to it is built. :class:`HFFormatError` naming the file and what is wrong otherwise."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HFFormatError(f"{folder}: {'not a folder' if folder.exists() else 'no such folder'}")
    for name in (CONFIG, WEIGHTS):
        if not (folder / name).is_file():
            raise HFFormatError(f"{folder}: no {name} (a Hugging Face GPT-2 folder holds {CONFIG} and {WEIGHTS})")
    config = gpt_config(read_config_json(folder / CONFIG), str(folder / CONFIG))
    try:
        with safe_open(folder / WEIGHTS, framework="numpy") as f:
            slices = {_canonical(k): f.get_slice(k) for k in f.keys() if not k.endswith(MASK_BUFFERS)}
            shapes = {k: tuple(s.get_shape()) for k, s in slices.items()}
            dtypes = {k: s.get_dtype() for k, s in slices.items()}
    except (SafetensorError, OSError, ValueError) as e:
        raise HFFormatError(f"{folder / WEIGHTS}: not a safetensors file ({e})") from e
    other = sorted({d for d in dtypes.values() if d not in FLOATS})
    if other:
        raise HFFormatError(f"{folder / WEIGHTS}: tensors of dtype {', '.join(other)}; minidist reads "
                            f"{', '.join(FLOATS)} (NumPy has no bfloat16: save the model in float32)")
    if config.tie_embeddings:
        shapes.pop("lm_head.weight", None)
    problems = capacity_problems(config, len(shapes), (folder / WEIGHTS).stat().st_size)
    if problems:
        raise HFFormatError(f"{folder} does not match {CONFIG}: " + "; ".join(problems))
    expected = hf_shapes(config)
    problems = [f"missing {n}" for n in expected if n not in shapes]
    problems += [f"unexpected {n}" for n in shapes if n not in expected]
    problems += [f"{n}: shape {shapes[n]}, the config needs {s}" for n, s in expected.items()
                 if n in shapes and shapes[n] != s]
    if problems:
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise HFFormatError(f"{folder / WEIGHTS} does not match {CONFIG}:\n  - " + "\n  - ".join(problems[:8]) + more)
    return config


def from_hf(folder) -> tuple[dict, GPTConfig]:
    """(state, config): the full minidist state_dict ({GPT-2 name: float array, Linear weights
    (out, in)}; a tied ``lm_head.weight`` is the same array as ``transformer.wte.weight``) and the
    GPTConfig of the Hugging Face GPT-2 folder ``folder`` (checked by :func:`read_hf_config`)."""
    config = read_hf_config(folder)
    try:
        raw = {_canonical(k): v for k, v in load_file(Path(folder) / WEIGHTS).items() if not k.endswith(MASK_BUFFERS)}
    except (SafetensorError, TypeError, ValueError) as e:  # e.g. bfloat16, which NumPy has no dtype for
        raise HFFormatError(f"{Path(folder) / WEIGHTS}: cannot be read as NumPy arrays ({e})") from e
    state = {}
    for name in hf_shapes(config):
        value = raw[name]
        state[name] = np.ascontiguousarray(value.T if is_conv1d(name) else value)
    if config.tie_embeddings:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    return state, config
