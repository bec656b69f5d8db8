"""Parameter: a leaf Tensor that a Module owns and an optimizer updates."""
from minidist.autograd import Tensor


class Parameter(Tensor):
    """A Tensor with ``requires_grad=True`` that Modules register when assigned as an attribute.

    Unlike a plain Tensor it has a ``__dict__``, so parallel code may tag it (e.g. which axis tensor
    parallelism splits).
    """

    def __init__(self, data):
        super().__init__(data, requires_grad=True)

    def __repr__(self):
        return f"Parameter(shape={self.shape}, dtype={self.dtype})"
