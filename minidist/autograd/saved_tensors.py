"""Saved-tensor hooks: what a Function keeps for backward can be packed away and unpacked later.

A Function keeps what its backward needs as attributes of ``ctx`` (function.py): activations, and
often a weight (a Linear keeps ``ctx.weight``). Inside ``saved_tensors_hooks(pack, unpack)`` every
array such an attribute holds is replaced, right after forward, by ``pack(array)``; just before
backward runs, the engine puts ``unpack(packed)`` back. This is PyTorch's
``torch.autograd.graph.saved_tensors_hooks``, and what ZeRO-3 / FSDP rely on:

    pack(array)    a full weight that is about to be freed -> a small reference to it
                   anything else (an activation)           -> the array itself
    unpack(ref)    the reference -> the weight, gathered again for backward

so a unit's full parameters are freed after its forward while its activations are kept, and
nothing is recomputed. Offloading would pack to host memory and unpack to the device the same way.

The hooks are per thread (ranks simulated as threads must not see each other's) and nest: the
innermost pair packs. Outside every pair nothing changes and nothing is paid.
"""
from __future__ import annotations

import threading

from minidist.autograd.backend import is_cupy

_state = threading.local()


class saved_tensors_hooks:
    """Context manager: Functions recorded inside pack what they save with ``pack`` and get it back
    through ``unpack`` when their backward runs (which may be long after the block has ended)."""

    def __init__(self, pack, unpack):
        self.pack, self.unpack = pack, unpack

    def __enter__(self):
        _stack().append(self)
        return self

    def __exit__(self, *exc):
        _stack().pop()
        return False


class Packed:
    """What ``pack`` returned for one saved array, and the ``unpack`` that turns it back."""

    __slots__ = ("value", "unpack")

    def __init__(self, value, unpack):
        self.value, self.unpack = value, unpack


def _stack() -> list:
    if not hasattr(_state, "stack"):
        _state.stack = []
    return _state.stack


def _is_array(x) -> bool:
    return hasattr(x, "__array_interface__") or is_cupy(x)


def pack_saved(ctx) -> None:
    """After ``ctx``'s forward: pass every array attribute of ``ctx`` through the innermost pack
    hook, if any pair is active on this thread."""
    stack = getattr(_state, "stack", None)
    if not stack:
        return
    hooks = stack[-1]
    for name, value in vars(ctx).items():
        if _is_array(value):
            packed = hooks.pack(value)
            if packed is not value:
                setattr(ctx, name, Packed(packed, hooks.unpack))


def unpack_saved(ctx) -> None:
    """Before ``ctx``'s backward: turn every packed attribute back into its array."""
    for name, value in vars(ctx).items():
        if type(value) is Packed:
            setattr(ctx, name, value.unpack(value.value))
