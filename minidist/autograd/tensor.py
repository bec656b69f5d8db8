"""Tensor: an array (NumPy or CuPy) plus what autograd needs to send gradients back through it.

A tensor made by an op remembers the Function node that made it (``_node``) and which of that node's
outputs it is (``_out_index``). A tensor you create yourself is a *leaf*; if it ``requires_grad``,
backward accumulates into its ``.grad`` (a plain array), as PyTorch does.
"""
import numpy as np

from minidist.autograd.backend import get_array_module, is_cupy, to_numpy
from minidist.autograd.engine import run_backward


class Tensor:
    """An n-dimensional array that records the operations applied to it.

    ``data`` is the array itself (updated in place by optimizers), ``grad`` the accumulated gradient
    array or ``None``. Arithmetic operators, ``@``, indexing and the shape methods below build the graph.
    """

    __slots__ = ("data", "grad", "requires_grad", "_node", "_out_index", "_grad_ready_hooks",
                 "__weakref__")
    __array_ufunc__ = None  # `ndarray + Tensor` must defer to Tensor.__radd__, not loop elementwise
    is_parameter = False  # True for minidist.nn.Parameter: a split backward defers its gradient (engine.py)

    def __init__(self, data, requires_grad: bool = False):
        if type(data) is not np.ndarray and not is_cupy(data):
            data = np.asarray(data)
        self.data = data
        self.grad = None
        self.requires_grad = requires_grad
        self._node = None
        self._out_index = 0
        self._grad_ready_hooks = None

    @staticmethod
    def _from_op(data, node, index):
        """The ``index``-th output of Function ``node``: part of the graph, so it requires grad."""
        t = Tensor(data, requires_grad=True)
        t._node = node
        t._out_index = index
        return t

    # ---- what it holds -------------------------------------------------------------------------
    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self):
        return self.data.ndim

    @property
    def size(self):
        return self.data.size

    @property
    def is_leaf(self) -> bool:
        """True for tensors not produced by a recorded op (parameters, inputs, detached tensors)."""
        return self._node is None

    def __len__(self):
        return len(self.data)

    def __repr__(self):
        return f"Tensor({self.data!r}, requires_grad={self.requires_grad})"

    def item(self):
        """The value of a one-element tensor as a Python number."""
        return self.data.item()

    def numpy(self) -> np.ndarray:
        """The data as a NumPy array (the same array on CPU, a copy from the GPU for CuPy)."""
        return to_numpy(self.data)

    def detach(self) -> "Tensor":
        """A new leaf sharing this tensor's data, cut from the graph (no gradient flows through it)."""
        return Tensor(self.data)

    # ---- autograd --------------------------------------------------------------------------------
    def backward(self, grad=None, retain_graph: bool = False):
        """Send ``grad`` (d something / d self; default 1 for a one-element tensor) back through the
        graph, adding into the ``.grad`` of every leaf that requires grad. The graph's saved arrays
        are freed unless ``retain_graph``."""
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad (no graph was built)")
        if grad is None:
            if self.data.size != 1:
                raise RuntimeError(f"backward() without a gradient needs a one-element tensor, got shape {self.shape}")
            grad = get_array_module(self.data).ones_like(self.data)
        else:
            grad = grad.data if isinstance(grad, Tensor) else grad
            if grad.shape != self.shape:
                raise ValueError(f"gradient shape {grad.shape} does not match tensor shape {self.shape}")
        run_backward(self, grad, retain_graph)

    def register_grad_ready_hook(self, fn):
        """Call ``fn(self)`` during every backward as soon as this leaf's ``.grad`` is final for that
        pass (no more gradient can flow into it). Data parallelism starts all-reduces from here.
        Returns a handle whose ``remove()`` unregisters the hook."""
        if not self.is_leaf or not self.requires_grad:
            raise RuntimeError("grad-ready hooks go on leaf tensors that require grad (parameters)")
        if self._grad_ready_hooks is None:
            self._grad_ready_hooks = []
        self._grad_ready_hooks.append(fn)
        return _HookHandle(self._grad_ready_hooks, fn)

    # ---- ops (defined in ops_*.py) ---------------------------------------------------------------
    def __add__(self, other):
        return ops_math.Add.apply(self, other)

    def __radd__(self, other):
        return ops_math.Add.apply(other, self)

    def __sub__(self, other):
        return ops_math.Sub.apply(self, other)

    def __rsub__(self, other):
        return ops_math.Sub.apply(other, self)

    def __mul__(self, other):
        return ops_math.Mul.apply(self, other)

    def __rmul__(self, other):
        return ops_math.Mul.apply(other, self)

    def __truediv__(self, other):
        return ops_math.Div.apply(self, other)

    def __rtruediv__(self, other):
        return ops_math.Div.apply(other, self)

    def __neg__(self):
        return ops_math.Neg.apply(self)

    def __pow__(self, exponent: float):
        return ops_math.Pow.apply(self, exponent)

    def __matmul__(self, other):
        return ops_math.MatMul.apply(self, other)

    def __rmatmul__(self, other):
        return ops_math.MatMul.apply(other, self)

    def __getitem__(self, index):
        return ops_shape.GetItem.apply(self, ops_shape.index_to_arrays(index))

    def sum(self, axis=None, keepdims: bool = False):
        return ops_math.Sum.apply(self, axis, keepdims)

    def mean(self, axis=None, keepdims: bool = False):
        return ops_math.mean(self, axis, keepdims)

    def reshape(self, *shape):
        return ops_shape.Reshape.apply(self, shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape)

    view = reshape  # NumPy reshape copies non-contiguous data where PyTorch's view would refuse

    def permute(self, *axes):
        return ops_shape.Permute.apply(self, axes[0] if len(axes) == 1 and isinstance(axes[0], tuple) else axes)

    def transpose(self, axis0: int, axis1: int):
        axes = list(range(self.ndim))
        axes[axis0], axes[axis1] = axes[axis1], axes[axis0]
        return ops_shape.Permute.apply(self, tuple(axes))

    def split(self, split_size_or_sections, axis: int = 0):
        return ops_shape.split(self, split_size_or_sections, axis)


class _HookHandle:
    """Returned by :meth:`Tensor.register_grad_ready_hook`; ``remove()`` unregisters the hook."""

    def __init__(self, hooks, fn):
        self._hooks, self._fn = hooks, fn

    def remove(self):
        if self._fn in self._hooks:
            self._hooks.remove(self._fn)


# Imported last: the ops modules build on Function, which needs the Tensor class defined above.
from minidist.autograd import ops_math, ops_shape  # noqa: E402
