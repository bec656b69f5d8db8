"""Module bookkeeping: attributes register parameters and children in order, names are dotted,
tied parameters appear once in parameters() but under every name in state_dict(), and loading a
state_dict is strict and explains what is wrong."""
import numpy as np
import pytest

from minidist import nn
from minidist.autograd import Tensor


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.blocks = nn.ModuleList([nn.LayerNorm(4), nn.LayerNorm(4, bias=False)])
        self.scale = nn.Parameter(np.ones(1, dtype=np.float32))
        self.out = nn.Linear(4, 3, bias=False)
        self.not_a_parameter = Tensor(np.zeros(2))

    def forward(self, x):
        x = self.fc(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x * self.scale)


def test_named_parameters_are_dotted_and_in_registration_order():
    m = TwoLayer()
    assert [name for name, _ in m.named_parameters()] == [
        "scale", "fc.weight", "fc.bias", "blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "out.weight"]
    assert m.fc.weight.shape == (4, 3) and m.out.weight.shape == (3, 4)  # (out_features, in_features)
    assert len(list(m.parameters())) == 7


def test_tied_parameter_listed_once_but_saved_under_each_name():
    m = TwoLayer()
    m.out.weight = nn.Parameter(np.zeros((3, 4), dtype=np.float32))
    m.fc.weight = m.out.weight  # shapes differ in real models; here only identity matters
    names = [name for name, _ in m.named_parameters()]
    assert "out.weight" not in names and "fc.weight" in names
    assert {"fc.weight", "out.weight"} <= set(m.state_dict())


def test_reassigning_an_attribute_replaces_its_registration():
    m = TwoLayer()
    m.scale = None
    assert "scale" not in dict(m.named_parameters())


def test_state_dict_is_a_copy_and_round_trips():
    m, other = TwoLayer(), TwoLayer()
    m.fc.weight.data[...] = np.arange(12).reshape(4, 3)
    sd = m.state_dict()
    assert all(type(v) is np.ndarray for v in sd.values())
    m.fc.weight.data[...] = 0  # the saved copy must not change
    assert sd["fc.weight"][3, 2] == 11
    weight_array = other.fc.weight.data
    other.load_state_dict(sd)
    assert other.fc.weight.data is weight_array  # loaded in place: optimizers keep their references
    for name, value in other.state_dict().items():
        np.testing.assert_array_equal(value, sd[name])


def test_load_state_dict_errors_name_the_problem():
    m = TwoLayer()
    sd = m.state_dict()
    with pytest.raises(KeyError, match="missing keys \\['fc.bias'\\]"):
        m.load_state_dict({k: v for k, v in sd.items() if k != "fc.bias"})
    with pytest.raises(KeyError, match="unexpected keys \\['extra'\\]"):
        m.load_state_dict({**sd, "extra": np.zeros(1)})
    with pytest.raises(ValueError, match="fc.weight: checkpoint \\(3, 4\\) vs model \\(4, 3\\)"):
        m.load_state_dict({**sd, "fc.weight": np.zeros((3, 4))})
    missing, unexpected = m.load_state_dict({"fc.bias": np.ones(4), "extra": np.zeros(1)}, strict=False)
    assert "fc.weight" in missing and unexpected == ["extra"]
    np.testing.assert_array_equal(m.fc.bias.data, np.ones(4))


def test_train_eval_and_zero_grad_reach_every_descendant():
    m = TwoLayer()
    assert m.eval() is m and not any(mod.training for _, mod in m.named_modules())
    m.train()
    assert all(mod.training for _, mod in m.named_modules())

    m.fc.weight.data[...] = 1.0
    m(Tensor(np.ones((2, 3), dtype=np.float32))).sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    m.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in m.parameters())
    m.zero_grad()
    assert all(p.grad is None for p in m.parameters())


def test_module_list_indexing_and_module_dict_attributes():
    layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)])
    assert len(layers) == 3 and layers[-1] is list(layers)[2]
    assert len(layers[1:]) == 2 and layers[1:][0] is layers[1]
    d = nn.ModuleDict(dict(wte=nn.Embedding(5, 2), ln_f=nn.LayerNorm(2)))
    assert d.wte is d["wte"]
    assert [name for name, _ in d.named_parameters()] == ["wte.weight", "ln_f.weight", "ln_f.bias"]
