"""Saved-tensor hooks (minidist/autograd/saved_tensors.py), PyTorch's ``saved_tensors_hooks``:

- inside the block, every array a Function keeps for backward goes through ``pack`` right after its
  forward, and through ``unpack`` just before its backward, outside the block or not;
- what ``pack`` returns unchanged is kept as it was; the gradients are those without hooks;
- pairs nest (the innermost packs), are per thread, and cost nothing outside every pair.
"""
import threading

import numpy as np

from minidist.autograd import Tensor, linear, saved_tensors_hooks
from minidist.autograd.saved_tensors import Packed


def grads(hooks=None):
    rng = np.random.default_rng(0)
    x = Tensor(rng.normal(size=(3, 4)), requires_grad=True)
    w = Tensor(rng.normal(size=(5, 4)), requires_grad=True)
    if hooks is None:
        y = linear(x, w)
    else:
        with saved_tensors_hooks(*hooks):
            y = linear(x, w)
    y.sum().backward()
    return x.grad, w.grad, y


def test_pack_runs_after_forward_and_unpack_before_backward_with_the_same_gradients():
    store, log = {}, []

    def pack(a):
        log.append(("pack", a.shape))
        store[id(a)] = a.copy()
        return id(a)

    def unpack(key):
        log.append(("unpack", store[key].shape))
        return store.pop(key)
    gx, gw, _ = grads((pack, unpack))
    assert [e for e in log if e[0] == "pack"] == [("pack", (3, 4)), ("pack", (5, 4))]  # Linear's x_2d, weight
    assert sorted(e for e in log if e[0] == "unpack") == sorted([("unpack", (3, 4)), ("unpack", (5, 4))])
    ref_x, ref_w, _ = grads()
    assert np.array_equal(gx, ref_x) and np.array_equal(gw, ref_w)


def test_what_pack_returns_unchanged_is_kept_as_it_is():
    unpacked = []
    grads((lambda a: a, lambda v: unpacked.append(v) or v))
    assert unpacked == []  # nothing was packed, so nothing is unpacked


def test_the_innermost_pair_packs_and_pairs_are_per_thread():
    seen = []
    x = Tensor(np.ones((2, 2)), requires_grad=True)
    w = Tensor(np.ones((2, 2)), requires_grad=True)
    with saved_tensors_hooks(lambda a: ("outer", a), lambda v: v[1]):
        with saved_tensors_hooks(lambda a: ("inner", a), lambda v: v[1]):
            y = linear(x, w)
            seen = [v.value[0] for v in vars(y._node).values() if type(v) is Packed]
            other = []
            t = threading.Thread(target=lambda: other.append(linear(x, w)._node))
            t.start()
            t.join()
    assert seen == ["inner", "inner"]
    assert not any(type(v) is Packed for v in vars(other[0]).values())  # another thread: no hooks
