"""Layers for the GPT: Module, Parameter, containers, Linear, Embedding, LayerNorm, init by name."""
from minidist.nn import init
from minidist.nn.container import ModuleDict, ModuleList
from minidist.nn.embedding import Embedding
from minidist.nn.layernorm import LayerNorm
from minidist.nn.linear import Linear
from minidist.nn.module import Module
from minidist.nn.parameter import Parameter

__all__ = ["Module", "Parameter", "ModuleList", "ModuleDict", "Linear", "Embedding", "LayerNorm", "init"]
