"""Parameter: a leaf Tensor that a Module owns and an optimizer updates."""
from minidist.autograd import Tensor


class Parameter(Tensor):
    """A Tensor with ``requires_grad=True`` that Modules register when assigned as an attribute.

    Parallel code tags a parameter with who owns which element of its gradient. The tags are
    declared here, False by default (a plain parameter: the same on every rank that holds it, and
    seeing all of the batch it is given); parallel code sets them to True on its instances:

    - ``tensor_parallel``: a distinct shard on each tensor-parallel rank (which part: the table in
      minidist.parallel.tensor.layout), so its gradient is this rank's alone;
    - ``sequence_parallel``: replicated over the tensor-parallel ranks but sees only this rank's
      tokens, so its gradient is a partial sum that must be all-reduced over tp;
    - ``tied_copy``: a pipeline stage's copy of a parameter another stage holds too (the last
      stage's lm_head tied to the first stage's wte): its gradient is summed over the embedding
      group and it is counted once, by the stage holding the original;
    - ``expert``: experts stacked along axis 0 (minidist/moe.py): under expert parallelism each ep
      rank holds a distinct block of them, its gradient reduced only over the ranks holding the
      same experts (minidist/parallel/compose/grad_ownership.py).

    Unlike a plain Tensor it has a ``__dict__``, so the tags are set per instance.
    """

    is_parameter = True  # a weight: its gradient is "W" in a split backward (autograd/engine.py)
    tensor_parallel: bool = False
    sequence_parallel: bool = False
    tied_copy: bool = False
    expert: bool = False

    def __init__(self, data):
        super().__init__(data, requires_grad=True)

    def __repr__(self):
        return f"Parameter(shape={self.shape}, dtype={self.dtype})"
