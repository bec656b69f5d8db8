"""Hyper-parameter search's pure parts (minidist/tune/): the space, the Gaussian process against
scikit-learn's, expected improvement against its integral, the samplers as functions of the seed
and the results, ASHA's rungs, and the state file read back and checked."""
import json
import math

import numpy as np
import pytest

from minidist.tune.acquisition import expected_improvement, maximize
from minidist.tune.asha import goes_on, rungs, segment
from minidist.tune.gp import GaussianProcess, fit_theta, log_marginal_likelihood, theta_bounds
from minidist.tune.samplers import startup, suggest
from minidist.tune.space import Dimension, space_of, space_problems
from minidist.tune.state import SearchState, Trial, read_state


class Refused(ValueError):
    pass


def data(n=9, d=2, seed=0):
    g = np.random.default_rng(seed)
    x = g.random((n, d))
    y = np.sin(6 * x[:, 0]) + (x[:, 1] - 0.3) ** 2 + 0.01 * g.standard_normal(n)
    return x, y


# --- the space

def test_a_dimension_maps_the_unit_interval_onto_its_range_log_or_linear():
    lr = Dimension("lr", 1e-4, 1e-2, log=True)
    assert lr.value(0) == pytest.approx(1e-4) and lr.value(1) == pytest.approx(1e-2) and lr.value(0.5) == pytest.approx(1e-3)
    assert lr.unit(lr.value(0.3)) == pytest.approx(0.3)
    warmup = Dimension("warmup", 0, 10, log=False)
    assert warmup.value(0.26) == 3 and isinstance(warmup.value(0.26), int) and warmup.unit(5) == 0.5
    space = space_of({"lr": (1e-4, 1e-2), "warmup": (0, 10), "grad_clip": None}, ["lr"])
    assert space.names == ["lr", "warmup"] and space.values([0.5, 1.0]) == {"lr": pytest.approx(1e-3), "warmup": 10}


@pytest.mark.parametrize("ranges, log, words", [
    ({"lr": (1e-2, 1e-3)}, ["lr"], "--lr-range 0.01 0.001 is inverted: give A < B"),
    ({"lr": (1e-3, 1e-3)}, ["lr"], "--lr-range 0.001 0.001 is empty"),
    ({"weight_decay": (0, 0.1)}, ["weight_decay"], "is on a log scale (--log-scale), which needs A > 0"),
    ({"grad_clip": (-1, 1)}, [], "the flag is never negative"),
    ({"warmup": (2.2, 2.8)}, [], "holds no integer"),
    ({"lr": (1e-3, math.inf)}, [], "the range must be finite"),
    ({}, [], "--mode search needs at least one range to search"),
    ({"lr": (1e-3, 1e-2)}, ["momentum"], "--log-scale: momentum is not a hyper-parameter"),
])
def test_a_bad_range_is_one_line_naming_its_flag(ranges, log, words):
    found = space_problems(ranges, log)
    assert len(found) == 1 and words in found[0], found


# --- the Gaussian process, against scikit-learn's

def sklearn_gp(theta, x, y):
    gaussian_process = pytest.importorskip("sklearn.gaussian_process")
    kernels = pytest.importorskip("sklearn.gaussian_process.kernels")
    a, scales, noise = math.exp(theta[0]), np.exp(theta[1:-1]), math.exp(theta[-1])
    kernel = kernels.ConstantKernel(a) * kernels.Matern(length_scale=scales, nu=2.5) + kernels.WhiteKernel(noise)
    return gaussian_process.GaussianProcessRegressor(kernel, alpha=1e-10, optimizer=None, normalize_y=True).fit(x, y)


@pytest.mark.parametrize("theta", [[0.0, math.log(0.3), math.log(0.7), math.log(1e-3)],
                                   [math.log(2.0), math.log(0.1), math.log(2.0), math.log(0.05)]])
def test_the_likelihood_its_gradient_and_the_posterior_are_scikit_learns(theta):
    x, y = data()
    theta = np.array(theta)
    theirs = sklearn_gp(theta, x, y)
    yn = (y - y.mean()) / y.std()
    value, grad = log_marginal_likelihood(theta, x, yn)
    their_value, their_grad = theirs.log_marginal_likelihood(theta, eval_gradient=True)
    assert value == pytest.approx(their_value, rel=1e-10)
    np.testing.assert_allclose(grad, their_grad, rtol=1e-8, atol=1e-10)
    points = np.random.default_rng(1).random((50, 2))
    mean, std = GaussianProcess(x, y, theta).predict(points)
    their_mean, their_std = theirs.predict(points, return_std=True)
    np.testing.assert_allclose(mean, their_mean, rtol=1e-10, atol=1e-12)
    # scikit-learn's standard deviation is of a new observation: the function's and the noise's
    noise = math.exp(theta[-1]) * y.std() ** 2
    np.testing.assert_allclose(np.sqrt(std ** 2 + noise), their_std, rtol=1e-8)


def test_the_gradient_is_the_likelihoods_slope():
    x, y = data(7, 3, seed=2)
    theta = np.log([1.3, 0.4, 0.9, 0.2, 1e-2])
    grad = log_marginal_likelihood(theta, x, y)[1]
    h = 1e-6
    for i in range(len(theta)):
        e = np.eye(len(theta))[i] * h
        slope = (log_marginal_likelihood(theta + e, x, y)[0] - log_marginal_likelihood(theta - e, x, y)[0]) / (2 * h)
        assert grad[i] == pytest.approx(slope, rel=1e-5, abs=1e-7)


def test_the_fitted_kernel_is_as_likely_as_scikit_learns_own_fit():
    gaussian_process = pytest.importorskip("sklearn.gaussian_process")
    kernels = pytest.importorskip("sklearn.gaussian_process.kernels")
    x, y = data(12)
    yn = (y - y.mean()) / y.std()
    ours = fit_theta(x, yn)
    box = np.exp(theta_bounds(2))
    kernel = (kernels.ConstantKernel(1.0, tuple(box[0])) * kernels.Matern([0.5, 0.5], tuple(box[1]), nu=2.5)
              + kernels.WhiteKernel(1e-2, tuple(box[-1])))
    theirs = gaussian_process.GaussianProcessRegressor(kernel, alpha=1e-10, normalize_y=True, n_restarts_optimizer=5,
                                                       random_state=0).fit(x, y)
    assert log_marginal_likelihood(ours, x, yn)[0] >= theirs.log_marginal_likelihood_value_ - 1e-3


# --- expected improvement

@pytest.mark.parametrize("mean, std, best", [(0.3, 0.2, 0.1), (-1.0, 0.5, 0.0), (2.0, 1e-3, 2.0), (0.0, 1.0, 0.0)])
def test_expected_improvement_is_its_integral(mean, std, best):
    """E[max(best - f, 0)] for f ~ N(mean, std^2), by the trapezoid rule over +-12 standard deviations."""
    f = np.linspace(mean - 12 * std, mean + 12 * std, 400_001)
    density = np.exp(-0.5 * ((f - mean) / std) ** 2) / (std * math.sqrt(2 * math.pi))
    integral = np.trapezoid(np.maximum(best - f, 0) * density, f)
    assert expected_improvement(np.array([mean]), np.array([std]), best)[0] == pytest.approx(integral, rel=1e-7, abs=1e-12)
    assert expected_improvement(np.array([mean]), np.array([0.0]), best)[0] == max(best - mean, 0)


def test_the_maximum_of_expected_improvement_is_near_the_minimum_of_a_well_known_function():
    x = np.linspace(0, 1, 9)[:, None]
    y = (x[:, 0] - 0.62) ** 2
    gp = GaussianProcess(x, y)
    point = maximize(gp, float(y.min()), 1, np.random.default_rng(0))
    assert abs(point[0] - 0.62) < 0.07


# --- the samplers

def test_random_draws_are_a_function_of_the_seed_and_the_trial():
    a = suggest("random", 3, 7, 4, 2, [], [])
    assert all(np.array_equal(u, v) for u, v in zip(a, suggest("random", 3, 7, 4, 2, [(np.zeros(3), 1.0)], [])))
    assert not np.array_equal(a[0], suggest("random", 3, 8, 4, 1, [], [])[0])
    assert np.array_equal(a[1], suggest("random", 3, 7, 5, 1, [], [])[0])  # trial 5, however it was asked


@pytest.mark.parametrize("rule", ["believer", "liar"])
def test_gp_suggests_deterministically_and_spreads_a_batch(rule):
    x, y = data(8, 2)
    observed = list(zip(x, y))
    a = suggest("gp", 2, 0, 8, 3, observed, [x[0] + 0.01], rule)
    b = suggest("gp", 2, 0, 8, 3, observed, [x[0] + 0.01], rule)
    assert all(np.array_equal(u, v) for u, v in zip(a, b)) and len(a) == 3
    assert min(np.linalg.norm(a[i] - a[j]) for i in range(3) for j in range(i)) > 1e-3  # the lies push them apart
    assert startup(2) == 3 and np.array_equal(suggest("gp", 2, 0, 1, 1, observed[:1], [])[0],
                                              suggest("random", 2, 0, 1, 1, [], [])[0])


def test_a_failed_trial_counts_as_the_worst_loss():
    x, y = data(6, 2)
    observed = list(zip(x, y)) + [(np.array([0.5, 0.5]), math.nan)]
    assert len(suggest("gp", 2, 0, 7, 1, observed, [])) == 1


# --- ASHA

def test_rungs_are_grace_times_powers_of_the_reduction_below_the_budget():
    assert rungs(10, 3, 100) == [10, 30, 90] and rungs(10, 3, 90) == [10, 30] and rungs(5, 2, 5) == []
    assert segment([10, 30, 90], 100) == 10 and segment([4, 8], 12, 6) == 2 and segment([], 9) == 9


def test_a_trial_goes_on_only_in_the_top_one_over_reduction_of_its_rung():
    assert goes_on(0, {0: 3.0}, 3)  # the first to arrive always goes on
    assert not goes_on(1, {0: 3.0, 1: 4.0}, 2) and goes_on(1, {0: 5.0, 1: 4.0}, 2)
    recorded = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0, 5: 6.0}
    assert [goes_on(t, recorded, 3) for t in recorded] == [True, True, False, False, False, False]
    assert goes_on(0, {0: 1.0, 1: 1.0}, 2) and not goes_on(1, {0: 1.0, 1: 1.0}, 2)  # ties: the lower index
    assert not goes_on(0, {0: math.nan}, 2)


# --- the state

def test_the_state_is_written_and_read_back(tmp_path):
    state = SearchState([Trial(0, 1, {"lr": 1e-3}, 9, {3: 2.5, 9: 2.0}, "completed", 18),
                         Trial(1, 0, {"lr": 2e-3}, 3, {3: math.nan}, "failed", 12),
                         Trial(2, 0, {"lr": 3e-3}, 6, {3: 2.4}, started=12)], 21)
    (tmp_path / "state.json").write_text(json.dumps(state.to_json()))
    back = read_state(tmp_path / "state.json", ["lr"], 4, 2, Refused)
    assert back.spent == 21 and back.trials[0] == state.trials[0] and back.trials[2] == state.trials[2]
    assert math.isnan(back.trials[1].rungs[3]) and back.best().index == 0 and [t.index for t in back.running()] == [2]


@pytest.mark.parametrize("damage", ["[" * 100_000, "{", '{"spent": 0, "trials": [{"trial": 1}]}',
                                    '{"spent": "0", "trials": []}', '{"spent": 0, "trials": [1, 2, 3, 4, 5]}'])
def test_a_damaged_state_is_refused_with_one_line(tmp_path, damage):
    (tmp_path / "state.json").write_text(damage)
    with pytest.raises(Refused, match="state.json") as refused:
        read_state(tmp_path / "state.json", ["lr"], 4, 2, Refused)
    assert "\n" not in str(refused.value)
