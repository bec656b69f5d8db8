"""LayerNorm over the last axis, with learned scale (starts at 1) and optional shift (starts at 0)."""
import numpy as np

from minidist.autograd import layer_norm
from minidist.nn.module import Module
from minidist.nn.parameter import Parameter


class LayerNorm(Module):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis of size ``ndim``."""

    def __init__(self, ndim: int, bias: bool = True, eps: float = 1e-5, dtype="float32"):
        super().__init__()
        self.eps = eps
        self.weight = Parameter(np.ones(ndim, dtype=dtype))
        self.bias = Parameter(np.zeros(ndim, dtype=dtype)) if bias else None

    def forward(self, x):  # (..., C)
        return layer_norm(x, self.weight, self.bias, self.eps)
