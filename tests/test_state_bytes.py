"""One table of optimizer bytes per parameter (minidist/optim/state_bytes.py), read by the planner and
the accounting: the ZeRO paper's K for every optimizer, dtype and precision."""
from types import SimpleNamespace

import numpy as np
import pytest

from minidist.autograd import Tensor
from minidist.inspect import zero_memory
from minidist.optim import OPTIMIZERS, optimizer_bytes_per_parameter, state_bytes_per_parameter
from minidist.plan import ModelSpec, RunSpec, parameter_count
from minidist.plan.memory import model_state_bytes


@pytest.mark.parametrize("optimizer, dtype, mixed, master, states", [
    ("adamw", "bfloat16", True, 4, 8),  # the ZeRO paper's K = 12: float32 master, two float32 moments
    ("adamw", "float16", True, 4, 8),
    ("sgd", "float16", True, 4, 4),
    ("adamw", "float32", False, 0, 8),  # full precision: the moments in the parameter's dtype, no master
    ("sgd", "float32", False, 0, 4),
    ("adamw", "float64", False, 0, 16),
    ("sgd", np.dtype("float64"), None, 0, 8),  # a NumPy dtype, and ZeRO's "no mixed precision" (None)
    ("adamw", np.dtype("float32"), "bfloat16", 4, 8),  # bfloat16 emulated in float32 storage
])
def test_the_table_gives_the_zero_papers_k(optimizer, dtype, mixed, master, states):
    assert state_bytes_per_parameter(optimizer, dtype, mixed) == {"master_weights": master, "optimizer_states": states}
    assert optimizer_bytes_per_parameter(optimizer, dtype, mixed) == master + states


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_slots_are_the_state_the_optimizers_keep(name):
    p = Tensor(np.zeros((3, 2), dtype=np.float64), requires_grad=True)
    optimizer = OPTIMIZERS[name]([("w", p)], lr=0.1)
    assert optimizer_bytes_per_parameter(optimizer, "float64", False) == 8 * len(optimizer.state)
    assert optimizer_bytes_per_parameter(name, "float64", False) == optimizer_bytes_per_parameter(optimizer, "float64", False)


def test_an_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="optimizer must be one of sgd, adamw, got 'lion'"):
        optimizer_bytes_per_parameter("lion", "float32", False)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
def test_the_planner_holds_the_tables_bytes_per_parameter(optimizer, dtype):
    model = ModelSpec("tiny", n_layer=2, n_embd=16, n_head=2, vocab_size=64, block_size=16)
    run = RunSpec(seq=16, dtype=dtype, optimizer=optimizer)
    held, n = model_state_bytes(model, run), parameter_count(model)
    mixed = dtype in ("bfloat16", "float16")
    assert {k: held[k] / n for k in ("master_weights", "optimizer_states")} == state_bytes_per_parameter(
        optimizer, dtype, mixed)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("storage, mixed", [("float64", None), ("float32", None), ("float16", "float16"),
                                            ("float32", "bfloat16")])
def test_zeros_accounting_reads_the_table(optimizer, storage, mixed):
    zero = SimpleNamespace(shards=[SimpleNamespace(unit=SimpleNamespace(dtype=np.dtype(storage)))],
                           optimizer=OPTIMIZERS[optimizer], mixed_precision=mixed)
    assert zero_memory.optimizer_bytes_per_parameter(zero) == optimizer_bytes_per_parameter(optimizer, storage, mixed)
