"""SGD and AdamW: the update rules, checked by hand, against PyTorch's formulas written out, and
(when torch is installed) against torch.optim itself."""
from types import SimpleNamespace

import numpy as np
import pytest

from minidist.optim import SGD, AdamW, adamw_update, decays, sgd_update


def param(values, grad=None):
    """A stand-in for a model Parameter: .data (updated in place) and .grad."""
    data = np.array(values, dtype=np.float64)
    return SimpleNamespace(data=data, grad=None if grad is None else np.array(grad, dtype=np.float64))


# --- SGD ---------------------------------------------------------------------------------------

def test_sgd_momentum_by_hand():
    p, g, buf = np.array([1.0]), np.array([0.5]), np.zeros(1)
    sgd_update(p, g, buf, lr=0.1, momentum=0.9)          # buf = 0.5,             p = 1 - 0.05
    assert buf[0] == 0.5 and p[0] == pytest.approx(0.95, abs=1e-15)
    sgd_update(p, g, buf, lr=0.1, momentum=0.9)          # buf = 0.9*0.5 + 0.5,   p = 0.95 - 0.095
    assert buf[0] == pytest.approx(0.95) and p[0] == pytest.approx(0.855, abs=1e-15)


def test_sgd_without_momentum_is_plain_gradient_descent():
    p = np.array([1.0, -2.0])
    sgd_update(p, np.array([0.5, 1.0]), None, lr=0.1)
    np.testing.assert_allclose(p, [0.95, -2.1], rtol=0, atol=1e-15)


def test_sgd_weight_decay_is_added_to_the_gradient():
    p = np.array([2.0])
    sgd_update(p, np.array([0.0]), None, lr=0.5, weight_decay=0.1)   # g = 0 + 0.1 * 2
    assert p[0] == pytest.approx(1.9, abs=1e-15)


# --- AdamW -------------------------------------------------------------------------------------

def adamw_reference(p, grads, lr, beta1, beta2, eps, wd):
    """The AdamW algorithm as written in PyTorch's documentation, one step per gradient."""
    m, v = np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        p = p - lr * wd * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g ** 2
        m_hat, v_hat = m / (1 - beta1 ** t), v / (1 - beta2 ** t)
        p = p - lr * m_hat / (np.sqrt(v_hat) + eps)
    return p


def test_adamw_first_step_by_hand():
    # Step 1: m_hat = g and v_hat = g**2, so the Adam step is lr * g / (|g| + eps) ~ lr * sign(g).
    p, g = np.array([1.0, 1.0]), np.array([0.3, -2.0])
    m, v = np.zeros(2), np.zeros(2)
    adamw_update(p, g, m, v, step=1, lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.5)
    expected = 1.0 * (1 - 0.01 * 0.5) - 0.01 * g / (np.abs(g) + 1e-8)
    np.testing.assert_allclose(p, expected, rtol=1e-15)
    np.testing.assert_allclose(m, 0.1 * g, rtol=1e-15)
    np.testing.assert_allclose(v, 0.01 * g * g, rtol=1e-15)


def test_adamw_matches_the_documented_algorithm_over_many_steps():
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(50)
    grads = rng.standard_normal((20, 50))
    p, m, v = p0.copy(), np.zeros(50), np.zeros(50)
    for t, g in enumerate(grads, start=1):
        adamw_update(p, g, m, v, step=t, lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    np.testing.assert_allclose(p, adamw_reference(p0, grads, 3e-3, 0.9, 0.95, 1e-8, 0.1), rtol=1e-13)


def test_adamw_decays_only_matrices_and_embeddings():
    # A zero gradient gives a zero Adam step (m = 0), so any change is weight decay alone.
    w = param(np.ones((2, 3)), np.zeros((2, 3)))
    b = param(np.ones(3), np.zeros(3))
    opt = AdamW([("h.0.mlp.c_fc.weight", w), ("h.0.mlp.c_fc.bias", b)], lr=0.1, weight_decay=0.5)
    opt.step()
    np.testing.assert_allclose(w.data, 0.95)    # 1 * (1 - 0.1 * 0.5)
    np.testing.assert_array_equal(b.data, 1.0)
    assert decays((4, 4)) and decays((256, 8)) and not decays((8,))


def test_a_flat_shard_with_a_decay_mask_equals_per_parameter_updates():
    # How ZeRO will use the same function: two parameters packed into one flat buffer, a 0/1 decay mask.
    rng = np.random.default_rng(1)
    w, b = rng.standard_normal((3, 4)), rng.standard_normal(4)
    gw, gb = rng.standard_normal((3, 4)), rng.standard_normal(4)
    flat_p, flat_g = np.concatenate([w.ravel(), b]), np.concatenate([gw.ravel(), gb])
    mask = np.concatenate([np.ones(12), np.zeros(4)])
    flat_m, flat_v = np.zeros(16), np.zeros(16)
    adamw_update(flat_p, flat_g, flat_m, flat_v, step=1, lr=0.1, weight_decay=0.2 * mask)
    for arr, g, wd in [(w, gw, 0.2), (b, gb, 0.0)]:
        adamw_update(arr, g, np.zeros_like(arr), np.zeros_like(arr), step=1, lr=0.1, weight_decay=wd)
    np.testing.assert_array_equal(flat_p, np.concatenate([w.ravel(), b]))


def test_parameters_without_gradient_are_left_alone():
    p = param([1.0, 2.0])
    opt = SGD([("w", p)], lr=0.1, momentum=0.9)
    opt.step()
    np.testing.assert_array_equal(p.data, [1.0, 2.0])


def test_a_parameter_listed_twice_is_refused():
    p = param(np.ones((2, 2)))
    with pytest.raises(ValueError, match="two names"):
        AdamW([("transformer.wte.weight", p), ("lm_head.weight", p)], lr=0.1)


@pytest.mark.parametrize("make", [lambda ps: SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
                                  lambda ps: AdamW(ps, lr=0.01)])
def test_state_dict_round_trip_resumes_identically(make):
    rng = np.random.default_rng(2)
    init = {"w": rng.standard_normal((3, 2)), "b": rng.standard_normal(2)}
    grads = [{k: rng.standard_normal(v.shape) for k, v in init.items()} for _ in range(6)]

    def run(opt, params, steps):
        for gs in steps:
            for k, p in params.items():
                p.grad = gs[k]
            opt.step()

    a = {k: param(v) for k, v in init.items()}
    opt_a = make(list(a.items()))
    run(opt_a, a, grads)                             # 6 uninterrupted steps

    b = {k: param(v) for k, v in init.items()}
    opt_b = make(list(b.items()))
    run(opt_b, b, grads[:3])
    saved = {k: param(p.data) for k, p in b.items()}, opt_b.state_dict()
    assert all(isinstance(v, np.ndarray) for v in saved[1].values())
    c = saved[0]
    opt_c = make(list(c.items()))                   # a fresh optimizer, resumed from the checkpoint
    opt_c.load_state_dict(saved[1])
    run(opt_c, c, grads[3:])
    for k in init:
        np.testing.assert_array_equal(c[k].data, a[k].data)


# --- against torch.optim, when torch is installed ---------------------------------------------

@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_matches_torch_optim(name):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    init = {"w": rng.standard_normal((4, 3)), "b": rng.standard_normal(3)}
    grads = [{k: rng.standard_normal(v.shape) for k, v in init.items()} for _ in range(10)]
    ours = {k: param(v) for k, v in init.items()}
    theirs = {k: torch.tensor(v, requires_grad=True) for k, v in init.items()}
    # torch applies weight decay to every parameter in a group: two groups give our >= 2-D rule.
    groups = [{"params": [theirs["w"]], "weight_decay": 0.1}, {"params": [theirs["b"]], "weight_decay": 0.0}]
    if name == "sgd":
        opt = SGD(list(ours.items()), lr=0.05, momentum=0.9, weight_decay=0.1)
        ref = torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    else:
        opt = AdamW(list(ours.items()), lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        ref = torch.optim.AdamW(groups, lr=0.05, betas=(0.9, 0.95), eps=1e-8)
    for gs in grads:
        for k in init:
            ours[k].grad = gs[k]
            theirs[k].grad = torch.tensor(gs[k])
        opt.step()
        ref.step()
    for k in init:
        np.testing.assert_allclose(ours[k].data, theirs[k].detach().numpy(), rtol=1e-12, atol=1e-14)
