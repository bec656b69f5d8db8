"""A small reverse-mode autograd over NumPy/CuPy arrays: Tensor, Function, no_grad and the ops a
GPT needs. Read in this order: tensor.py, function.py, engine.py, ops_math.py, ops_shape.py,
ops_nn.py, attention.py, ops_moe.py, saved_tensors.py."""
# tensor first: it imports the ops modules at its end, and they import Function, which needs Tensor.
from minidist.autograd.tensor import Tensor  # noqa: I001
from minidist.autograd.attention import scaled_dot_product_attention, self_attention
from minidist.autograd.backend import get_array_module, to_numpy
from minidist.autograd.engine import weight_grads_later
from minidist.autograd.function import Function
from minidist.autograd.grad_mode import is_grad_enabled, no_grad
from minidist.autograd.ops_math import mean, unbroadcast
from minidist.autograd.ops_moe import combine, grouped_bias, grouped_linear, take_rows
from minidist.autograd.ops_nn import cross_entropy, embedding, gelu, layer_norm, linear, softmax
from minidist.autograd.ops_shape import cat, merge_heads, split, split_heads
from minidist.autograd.saved_tensors import saved_tensors_hooks

__all__ = [
    "Tensor", "Function", "no_grad", "is_grad_enabled", "get_array_module", "to_numpy", "unbroadcast",
    "mean", "cat", "split", "split_heads", "merge_heads", "linear", "gelu", "layer_norm", "embedding", "cross_entropy",
    "scaled_dot_product_attention", "self_attention", "saved_tensors_hooks", "softmax", "grouped_linear", "grouped_bias", "take_rows", "combine",
    "weight_grads_later",
]
