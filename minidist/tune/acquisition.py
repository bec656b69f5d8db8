"""Expected improvement (Jones, Schonlau and Welch 1998), in closed form for a Gaussian posterior,
and where it is largest in the unit cube.

For a loss to minimize, with ``best`` the lowest loss seen and the posterior N(mu, sigma^2) at x:

    EI(x) = E[max(best - f(x), 0)] = (best - mu) Phi(z) + sigma phi(z),   z = (best - mu) / sigma

(and max(best - mu, 0) where sigma = 0). It is large where the mean is low (exploitation) or the
uncertainty high (exploration). :func:`maximize` searches for its maximum by evaluating it at
random points, then around the best few: every draw comes from the generator it is given.
"""
from __future__ import annotations

import math

import numpy as np

CANDIDATES = 2000  # random points EI is evaluated at
REFINED = 5  # of them, the best few searched around
LOCAL = 200  # points around each, at a distance of about LOCAL_SCALE
LOCAL_SCALE = 0.05

_erf = np.vectorize(math.erf, otypes=[np.float64])


def normal_cdf(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + _erf(np.asarray(z, dtype=np.float64) / math.sqrt(2.0)))


def normal_pdf(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64)
    return np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def expected_improvement(mean: np.ndarray, std: np.ndarray, best: float) -> np.ndarray:
    """EI of each posterior N(mean, std^2) below ``best`` (module docstring), elementwise."""
    mean, std = np.asarray(mean, dtype=np.float64), np.asarray(std, dtype=np.float64)
    gain = best - mean
    safe = np.where(std > 0, std, 1.0)
    z = gain / safe
    return np.where(std > 0, gain * normal_cdf(z) + std * normal_pdf(z), np.maximum(gain, 0.0))


def maximize(gp, best: float, dims: int, g: np.random.Generator) -> np.ndarray:
    """The point of the unit cube, (dims,), with the highest expected improvement under ``gp`` found
    among :data:`CANDIDATES` random points and :data:`LOCAL` points around each of the best
    :data:`REFINED` (ties: the first)."""
    points = g.random((CANDIDATES, dims))
    ei = expected_improvement(*gp.predict(points), best)
    top = points[np.argsort(-ei, kind="stable")[:REFINED]]
    near = np.clip(np.repeat(top, LOCAL, axis=0) + LOCAL_SCALE * g.standard_normal((REFINED * LOCAL, dims)), 0, 1)
    points = np.vstack([points, near])
    ei = np.concatenate([ei, expected_improvement(*gp.predict(near), best)])
    return points[int(np.argmax(ei))]
