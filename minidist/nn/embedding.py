"""Embedding table: row i of weight (num_embeddings, embedding_dim) is the vector of token i."""
import numpy as np

from minidist.autograd import embedding
from minidist.nn.module import Module
from minidist.nn.parameter import Parameter


class Embedding(Module):
    """Looks up rows of ``weight`` at an integer array. The table starts at zero: the owning model
    initialises it by parameter name (see :mod:`minidist.nn.init`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype="float32"):
        super().__init__()
        self.weight = Parameter(np.zeros((num_embeddings, embedding_dim), dtype=dtype))

    def forward(self, idx):  # (B, T) ints -> (B, T, C)
        return embedding(idx, self.weight)
