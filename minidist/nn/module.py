"""Module: the base class of layers and models, as in torch.nn.

Assigning a Parameter or a Module as an attribute registers it, in assignment order; that order
(depth first, a module's own parameters before its children's) is the stable order of
``named_parameters()`` that data parallelism and ZeRO rely on to lay out flat buffers.
"""
import numpy as np

from minidist.autograd.backend import get_array_module, to_numpy
from minidist.device import to_device
from minidist.nn.parameter import Parameter


class Module:
    """Holds Parameters and sub-Modules; ``module(*args)`` calls ``forward(*args)``."""

    def __init__(self):
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        self._parameters.pop(name, None)
        self._modules.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    # ---- walking the tree --------------------------------------------------------------------------
    def named_modules(self, prefix: str = ""):
        """Yield (dotted name, module) for this module and every descendant, depth first."""
        yield prefix, self
        for name, child in self._modules.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self, remove_duplicate: bool = True):
        """Yield (dotted name, Parameter) in registration order. A Parameter reachable under several
        names (tied weights) is yielded once, under its first name, unless ``remove_duplicate=False``."""
        seen = set()
        for prefix, module in self.named_modules():
            for name, p in module._parameters.items():
                if remove_duplicate:
                    if id(p) in seen:
                        continue
                    seen.add(id(p))
                yield (f"{prefix}.{name}" if prefix else name), p

    def parameters(self):
        """Yield each Parameter once, in the order of ``named_parameters()``."""
        for _, p in self.named_parameters():
            yield p

    # ---- modes and gradients -------------------------------------------------------------------------
    def train(self, mode: bool = True):
        """Set ``training`` on this module and all descendants; returns self."""
        for _, module in self.named_modules():
            object.__setattr__(module, "training", mode)
        return self

    def eval(self):
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True):
        """Clear every parameter's ``.grad``: drop it (default) or fill it with zeros in place."""
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad[...] = 0

    def to(self, device: str):
        """Move every parameter (and its gradient, if any) to ``device``: ``"cpu"`` (NumPy arrays) or
        ``"cuda"`` (CuPy arrays on the current GPU). In place: the Parameters stay the same objects,
        so tied weights stay one. Call it before anything keeps views of the parameters (data
        parallelism's buckets, ZeRO's flat buffers, mixed precision's masters). Returns self."""
        for p in self.parameters():
            p.data = to_device(p.data, device)
            if p.grad is not None:
                p.grad = to_device(p.grad, device)
        return self

    # ---- state -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """{dotted name: NumPy copy of the value} for every parameter name (tied ones under each name)."""
        return {name: to_numpy(p.data).copy() for name, p in self.named_parameters(remove_duplicate=False)}

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """Copy values into the parameters in place (casting to their dtype). Raises on shape mismatch,
        and with ``strict`` on missing or unexpected names. Returns (missing, unexpected) name lists."""
        own = dict(self.named_parameters(remove_duplicate=False))
        missing = [name for name in own if name not in state_dict]
        unexpected = [name for name in state_dict if name not in own]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        wrong = [f"{name}: checkpoint {np.shape(v)} vs model {own[name].shape}"
                 for name, v in state_dict.items() if name in own and tuple(np.shape(v)) != own[name].shape]
        if wrong:
            raise ValueError("load_state_dict: shape mismatch for " + "; ".join(wrong))
        for name, value in state_dict.items():
            if name in own:
                p = own[name]
                p.data[...] = get_array_module(p.data).asarray(value)
        return missing, unexpected
