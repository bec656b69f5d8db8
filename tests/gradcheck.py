"""Check an op's backward against central finite differences (float64).

For ``out = fn(*tensors)`` we send a fixed random upstream gradient R back (``out.backward(R)``), so
every output element is checked, and compare each input's ``.grad`` with
    d/dx_i sum(fn(x) * R)  ~=  (f(x + eps e_i) - f(x - eps e_i)) / (2 eps).
"""
import numpy as np

from minidist.autograd import Tensor


def numerical_grad(f, arrays, k, eps=1e-6):
    """Central differences of the scalar ``f(arrays)`` with respect to every element of ``arrays[k]``."""
    x = arrays[k]
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        saved = x[i]
        x[i] = saved + eps
        up = f(arrays)
        x[i] = saved - eps
        down = f(arrays)
        x[i] = saved
        grad[i] = (up - down) / (2 * eps)
    return grad


def check_gradients(fn, *arrays, wrt=None, seed=0, atol=1e-7, rtol=1e-6):
    """Assert that autograd's gradients of ``fn`` match finite differences for the inputs ``wrt``
    (indices into ``arrays``; all of them by default). ``fn`` takes and returns Tensors."""
    arrays = [np.array(a, dtype=np.float64) for a in arrays]
    wrt = range(len(arrays)) if wrt is None else wrt
    tensors = [Tensor(a.copy(), requires_grad=(k in wrt)) for k, a in enumerate(arrays)]
    out = fn(*tensors)
    upstream = np.asarray(np.random.default_rng(seed).standard_normal(out.shape))
    out.backward(upstream)

    def f(xs):
        return float(np.sum(fn(*[Tensor(x) for x in xs]).data * upstream))

    for k in wrt:
        expected = numerical_grad(f, arrays, k)
        np.testing.assert_allclose(tensors[k].grad, expected, atol=atol, rtol=rtol,
                                   err_msg=f"gradient of input {k} (shape {arrays[k].shape})")
