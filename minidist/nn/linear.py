"""Linear layer, PyTorch layout: weight (out_features, in_features), y = x @ weight.T + bias."""
import numpy as np

from minidist.autograd import linear
from minidist.nn.module import Module
from minidist.nn.parameter import Parameter


class Linear(Module):
    """Affine map of the last axis. Weight and bias start at zero: the model that owns the layer
    initialises them by parameter name (see :mod:`minidist.nn.init`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype="float32"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(np.zeros((out_features, in_features), dtype=dtype))
        self.bias = Parameter(np.zeros(out_features, dtype=dtype)) if bias else None

    def forward(self, x):  # (..., in) -> (..., out)
        return linear(x, self.weight, self.bias)
