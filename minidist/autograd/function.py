"""Function: one differentiable operation, with a forward and a hand-written backward.

Every op in minidist is a subclass. ``forward(ctx, *args)`` receives plain arrays (the ``.data`` of
Tensor arguments; other arguments pass through unchanged) and returns an array, or a tuple of arrays
for several outputs. Whatever backward needs is saved as attributes of ``ctx``. ``backward(ctx,
*grads)`` receives one gradient array per output (``None`` for an output that got no gradient) and
returns one gradient per positional argument of forward (``None`` for non-tensors or inputs that need
none; ``ctx.needs_input_grad[i]`` says which are wanted). Inside ``saved_tensors_hooks`` the saved
arrays are packed after forward and unpacked before backward (saved_tensors.py). Backward must not write into the gradients
it receives: the same array may be shared by several consumers.

Example, the pair tensor parallelism is built from (Megatron's "f": identity forward, all-reduce
backward)::

    class CopyToTensorParallel(Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x

        @staticmethod
        def backward(ctx, grad):
            return all_reduce(grad.copy(), group=ctx.group), None

    y = CopyToTensorParallel.apply(x, group)   # x is a Tensor, group any Python object
"""
from minidist.autograd.grad_mode import is_grad_enabled
from minidist.autograd.saved_tensors import pack_saved
from minidist.autograd.tensor import Tensor


class Function:
    """Base class of all differentiable operations; the instance is the ``ctx`` and the graph node.

    Graph fields (set by :meth:`apply`): ``inputs`` (per positional argument, the Tensor that wants a
    gradient or ``None``), ``needs_input_grad`` (bools, same order), ``n_outputs``.
    """

    __slots__ = ("inputs", "needs_input_grad", "n_outputs")  # subclasses keep saved state in __dict__

    @staticmethod
    def forward(ctx, *args, **kwargs):
        raise NotImplementedError

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError

    @classmethod
    def apply(cls, *args, **kwargs):
        """Run forward on the arrays of ``args`` and, in grad mode, link the outputs into the graph."""
        ctx = cls()
        inputs = tuple(a if isinstance(a, Tensor) and a.requires_grad else None for a in args)
        record = is_grad_enabled() and any(t is not None for t in inputs)
        ctx.needs_input_grad = tuple(t is not None for t in inputs) if record else (False,) * len(args)
        out = cls.forward(ctx, *[a.data if isinstance(a, Tensor) else a for a in args], **kwargs)
        if not record:
            return tuple(Tensor(o) for o in out) if type(out) is tuple else Tensor(out)
        ctx.inputs = inputs
        pack_saved(ctx)  # saved_tensors_hooks, if any: e.g. ZeRO-3 swaps a full weight for a reference
        if type(out) is tuple:
            ctx.n_outputs = len(out)
            return tuple(Tensor._from_op(o, ctx, i) for i, o in enumerate(out))
        ctx.n_outputs = 1
        return Tensor._from_op(out, ctx, 0)
