"""Initial values that depend only on (seed, parameter name, shape).

Every parallel layout draws the *full* tensor this way and keeps its own slice, so all layouts start
from exactly the weights a single process would have.
"""
import zlib

import numpy as np


def named_generator(seed: int, name: str) -> np.random.Generator:
    """A NumPy Generator seeded by ``seed`` and the CRC32 of ``name``: same inputs, same stream."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def normal(seed: int, name: str, shape, std: float) -> np.ndarray:
    """Float64 draws from N(0, std^2) of ``shape`` for parameter ``name`` (cast by the caller)."""
    return named_generator(seed, name).standard_normal(shape) * std
