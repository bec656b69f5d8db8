"""One consolidated safetensors file with GPT-2 names, in nanoGPT / PyTorch layout, not Hugging Face's.

A sharded checkpoint is for resuming; an export is for using the model elsewhere. It holds every
model parameter whole (the global tensor: vocabulary padding was never stored, so it is not there
either), under its GPT-2 name, and no optimizer state (names ``slot/param``). Every Linear weight is
PyTorch's (out_features, in_features), as nanoGPT's ``GPT.load_state_dict`` expects. Hugging
Face's GPT-2 stores c_attn / c_fc / c_proj as Conv1D (in, out) and needs a config.json:
``transformers`` cannot load this file; use ``--export-hf DIR`` (minidist/checkpoint/hf.py) for that.
``metadata`` carries ``{"format": "pt"}``.

    export_safetensors(latest_valid("ckpt"), "model.safetensors")
    state = safetensors.numpy.load_file("model.safetensors")     # {name: full array}
"""
from __future__ import annotations

from safetensors.numpy import save as safetensors_bytes

from minidist.files import write_atomically
from minidist.checkpoint.reader import Checkpoint


def is_parameter(name: str) -> bool:
    """Model parameters have plain GPT-2 names; optimizer state is named ``slot/parameter``."""
    return "/" not in name


def save_state_dict(state: dict, path) -> None:
    """Write ``state`` ({name: NumPy array}) as one safetensors file, atomically."""
    write_atomically(path, safetensors_bytes(dict(state), metadata={"format": "pt"}))


def export_safetensors(step_dir, path) -> dict:
    """Write every model parameter of the checkpoint in ``step_dir``, whole, to the safetensors file
    ``path``; returns the {name: array} written."""
    ckpt = Checkpoint(step_dir)
    state = {name: ckpt.read_full(name) for name in ckpt.names if is_parameter(name)}
    save_state_dict(state, path)
    return state
