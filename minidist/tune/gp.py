"""A Gaussian process over the unit cube, written out: the Matérn 5/2 kernel, its hyper-parameters
fitted by maximizing the log marginal likelihood, and the posterior at new points (Rasmussen and
Williams, *Gaussian Processes for Machine Learning*, 2006: algorithm 2.1 and eq. 5.9).

    k(x, x') = a (1 + sqrt5 r + 5/3 r^2) exp(-sqrt5 r),   r^2 = sum_i ((x_i - x'_i) / l_i)^2
    K        = k(X, X) + (s + JITTER) I                    s: the noise variance of each observation

The observations y are normalized (mean 0, standard deviation 1) before fitting, as scikit-learn's
``GaussianProcessRegressor(normalize_y=True)`` does; theta = log(a, l_1 .. l_d, s), in scikit-learn's
order for ``ConstantKernel(a) * Matern(l, nu=2.5) + WhiteKernel(s)``, so tests/test_tune.py checks
the likelihood, its gradient and the posterior against it.
"""
from __future__ import annotations

import math

import numpy as np

JITTER = 1e-10  # added to K's diagonal (scikit-learn's alpha)
SQRT5 = math.sqrt(5.0)
BOUNDS = {"amplitude": (1e-2, 1e2), "length_scale": (1e-2, 1e1), "noise": (1e-6, 1.0)}  # theta's box
ITERATIONS = 200  # gradient-ascent steps of each start when fitting


def matern52(a: np.ndarray, b: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The Matérn 5/2 correlation of every row of ``a`` (n, d) with every row of ``b`` (m, d): (n, m)."""
    diff = (a[:, None, :] - b[None, :, :]) / scales  # (n, m, d)
    r = np.sqrt(np.sum(diff * diff, axis=-1))  # (n, m)
    return (1.0 + SQRT5 * r + 5.0 / 3.0 * r * r) * np.exp(-SQRT5 * r)


def log_marginal_likelihood(theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """(log p(y | x, theta), its gradient in theta) for normalized ``y`` (n,) at ``x`` (n, d)."""
    amp, scales, noise = math.exp(theta[0]), np.exp(theta[1:-1]), math.exp(theta[-1])
    n = len(y)
    diff2 = ((x[:, None, :] - x[None, :, :]) / scales) ** 2  # (n, n, d)
    r = np.sqrt(diff2.sum(-1))  # (n, n)
    decay = np.exp(-SQRT5 * r)
    corr = (1.0 + SQRT5 * r + 5.0 / 3.0 * r * r) * decay
    k = amp * corr + (noise + JITTER) * np.eye(n)
    chol = np.linalg.cholesky(k)
    alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, y))  # K^-1 y
    value = -0.5 * y @ alpha - np.log(np.diag(chol)).sum() - 0.5 * n * math.log(2 * math.pi)
    k_inv = np.linalg.solve(chol.T, np.linalg.solve(chol, np.eye(n)))
    inner = np.outer(alpha, alpha) - k_inv  # d lml = 1/2 tr(inner dK)
    d_scales = amp * 5.0 / 3.0 * ((1.0 + SQRT5 * r) * decay)[..., None] * diff2  # dK / d log l_i, (n, n, d)
    grad = [0.5 * np.sum(inner * amp * corr)]
    grad += [0.5 * np.sum(inner * d_scales[..., i]) for i in range(x.shape[1])]
    grad += [0.5 * noise * np.trace(inner)]
    return float(value), np.array(grad)


def theta_bounds(d: int) -> np.ndarray:
    """The box theta is fitted in, (d + 2, 2) in log space: :data:`BOUNDS`."""
    rows = [BOUNDS["amplitude"]] + [BOUNDS["length_scale"]] * d + [BOUNDS["noise"]]
    return np.log(np.array(rows, dtype=np.float64))


def fit_theta(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The theta of the highest log marginal likelihood found by Rprop (each coordinate of theta
    moves by its own step, which grows by 1.2 while the slope keeps its sign and halves when it
    flips; Riedmiller and Braun 1993) inside :func:`theta_bounds`, from four fixed starts (length
    scales 0.1, 0.3, 1 and 3): deterministic, no line search to tune."""
    box = theta_bounds(x.shape[1])
    best, best_value = None, -math.inf
    for scale in (0.1, 0.3, 1.0, 3.0):
        theta = np.log(np.array([1.0] + [scale] * x.shape[1] + [1e-2]))
        steps, last = np.full(len(theta), 0.5), np.zeros(len(theta))
        for _ in range(ITERATIONS):
            value, grad = log_marginal_likelihood(theta, x, y)
            if value > best_value:
                best, best_value = theta, value
            turned = grad * last < 0
            steps = np.clip(np.where(turned, steps * 0.5, np.where(grad * last > 0, steps * 1.2, steps)), 1e-6, 1.0)
            grad = np.where(turned, 0.0, grad)  # after a flip, wait a step (iRprop-)
            theta, last = np.clip(theta + np.sign(grad) * steps, box[:, 0], box[:, 1]), grad
        value = log_marginal_likelihood(theta, x, y)[0]
        if value > best_value:
            best, best_value = theta, value
    return best


class GaussianProcess:
    """The posterior of a Gaussian process with kernel ``theta`` given observations ``y`` (n,) at
    ``x`` (n, d): :meth:`predict` gives the mean and standard deviation of the loss itself at new
    points (the noise-free function; ``y``'s own units)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, theta: np.ndarray | None = None):
        self.x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        self.y_mean, self.y_std = float(y.mean()), float(y.std()) or 1.0
        self.y = (y - self.y_mean) / self.y_std  # normalized
        self.theta = fit_theta(self.x, self.y) if theta is None else np.asarray(theta, dtype=np.float64)
        self.amplitude, self.scales = math.exp(self.theta[0]), np.exp(self.theta[1:-1])
        self.noise = math.exp(self.theta[-1])
        k = self.amplitude * matern52(self.x, self.x, self.scales) + (self.noise + JITTER) * np.eye(len(self.y))
        self.chol = np.linalg.cholesky(k)
        self.alpha = np.linalg.solve(self.chol.T, np.linalg.solve(self.chol, self.y))

    def predict(self, points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mean, standard deviation) of the function at ``points`` (m, d), each (m,)."""
        cross = self.amplitude * matern52(np.asarray(points, dtype=np.float64), self.x, self.scales)  # (m, n)
        mean = cross @ self.alpha
        v = np.linalg.solve(self.chol, cross.T)  # (n, m)
        var = np.maximum(self.amplitude - np.sum(v * v, axis=0), 0.0)
        return mean * self.y_std + self.y_mean, np.sqrt(var) * self.y_std

    def with_fantasy(self, point: np.ndarray, value: float) -> "GaussianProcess":
        """This process with one more observation (``value`` at ``point``), its kernel kept: a batch
        rule's lie (samplers.py)."""
        x = np.vstack([self.x, point[None, :]])
        y = np.append(self.y * self.y_std + self.y_mean, value)
        return GaussianProcess(x, y, self.theta)
