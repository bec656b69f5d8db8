"""The backward pass: walk the graph from one tensor to the leaves, iteratively.

Two passes, no recursion (a 10 000-op chain must not overflow Python's stack):
1. From the root's node, visit every node it depends on and count, per node, how many consumer edges
   will deliver a gradient to it, and per leaf, how many contributions it will receive.
2. Kahn's topological order: a node runs its backward only once all its consumers have delivered.
   Each gradient delivered to a leaf decrements its pending count; at zero its ``.grad`` is final for
   this pass and its grad-ready hooks fire (overlapped data parallelism launches all-reduces there).

Backward can also be split in two, as zero-bubble pipelines need (Qi et al. 2023). Inside
``with weight_grads_later() as w:`` a backward computes only what flows to the activations ("B"):
the gradient of each op's non-parameter inputs. Every edge into a Parameter is recorded instead, with
the node and the gradients of its outputs (for a Linear: x, kept by forward, and dy). ``w.run()``
later runs the recorded work ("W"): each node's backward once more, asked for its parameters only
(``needs_input_grad``), in the order the nodes were met. Every parameter therefore receives the same
contributions in the same order as in one backward: B + W equals backward, bitwise.
"""
import threading

from minidist.autograd.backend import get_array_module
from minidist.autograd.saved_tensors import unpack_saved

_state = threading.local()  # per thread, as grad mode: ranks simulated as threads split independently


def run_backward(root, grad, retain_graph: bool = False):
    """Propagate ``grad`` (shaped like ``root``) to every leaf that requires grad, accumulating into
    their ``.grad`` (PyTorch rules: a second backward adds). Frees saved arrays unless ``retain_graph``.
    Inside :class:`weight_grads_later`, the parameters' share is recorded for ``run()`` instead."""
    later = getattr(_state, "later", None)
    if root._node is None:
        _accumulate_leaf(root, grad)
        _fire_hooks(root)
        return
    walk = _Walk(root._node, retain_graph)
    walk.grads[root._node] = [None] * root._node.n_outputs  # node -> gradient of each of its outputs
    walk.grads[root._node][root._out_index] = grad
    ready = [root._node]
    while ready:
        node = ready.pop()
        inputs, output_grads = node.inputs, walk.grads.pop(node)
        weights = later.weights_of(node) if later is not None else None
        if weights is None:  # nothing to defer: the ordinary backward of this node
            input_grads = walk.compute(node, output_grads, node.needs_input_grad, free=not retain_graph)
        else:  # B: the activations' share now; W, the parameters' share, recorded for later
            later.records.append((walk, node, output_grads, weights))
            now = tuple(n and not w for n, w in zip(node.needs_input_grad, weights))
            input_grads = walk.compute(node, output_grads, now, free=False)
        for t, g, w in zip(inputs, input_grads, weights or (False,) * len(inputs)):
            if t is not None and not w:
                walk.deliver(t, g, ready)


class weight_grads_later:
    """Context manager for a split backward: backward calls inside compute the input (activation)
    gradients only, "B"; the weight gradients, "W", wait in this object until :meth:`run`. Parameter
    leaves are recognised by ``is_parameter`` (minidist.nn.Parameter). Nested backwards (activation
    recomputation re-runs a block and back-propagates through it) defer into the same object.

    >>> with weight_grads_later() as w:
    ...     out.backward(grad)          # B: x.grad is ready, the parameters' .grad are not yet
    >>> w.run()                         # W: the parameters' .grad, hooks firing as usual
    """

    def __init__(self):
        self.records = []  # (walk, node, output grads, which inputs are parameters), in the order met

    def __enter__(self):
        self._outer = getattr(_state, "later", None)
        _state.later = self
        return self

    def __exit__(self, *exc):
        _state.later = self._outer
        return False

    @staticmethod
    def weights_of(node):
        """Per input of ``node``, whether it is a Parameter that wants a gradient; None if none is."""
        weights = tuple(t is not None and t.is_parameter for t in node.inputs)
        return weights if any(weights) else None

    def run(self) -> None:
        """W: every recorded node's backward for its parameter inputs only, in recorded order,
        accumulating into their ``.grad`` and firing their grad-ready hooks when complete."""
        records, self.records = self.records, []
        for walk, node, output_grads, weights in records:
            inputs = node.inputs
            want = tuple(n and w for n, w in zip(node.needs_input_grad, weights))
            input_grads = walk.compute(node, output_grads, want, free=not walk.retain_graph)
            for t, g, w in zip(inputs, input_grads, weights):
                if w:
                    walk.deliver(t, g, None)


class _Walk:
    """The state of one backward: per node, the consumers still to deliver and the gradients
    gathered so far; per leaf, the contributions still to come."""

    def __init__(self, root_node, retain_graph: bool):
        self.consumers, self.pending = _count_dependencies(root_node)
        self.grads, self.retain_graph = {}, retain_graph

    @staticmethod
    def compute(node, output_grads, needs, free: bool):
        """The gradient of each of ``node``'s inputs, asking only for those flagged in ``needs``."""
        inputs = node.inputs
        if all(g is None for g in output_grads) or not any(needs):  # nothing flows through this node
            input_grads = (None,) * len(inputs)
        else:
            unpack_saved(node)  # what saved_tensors_hooks packed (ZeRO-3: the weights, gathered again)
            full = node.needs_input_grad
            node.needs_input_grad = needs  # a split backward asks for part of the inputs
            input_grads = type(node).backward(node, *output_grads)
            node.needs_input_grad = full
            if type(input_grads) is not tuple:
                input_grads = (input_grads,)
            if needs is not full:  # an op may compute more than asked: B and W each keep their share
                input_grads = tuple(g if n else None for g, n in zip(input_grads, needs))
        if free:
            node.inputs = None
            node.__dict__.clear()  # the arrays forward saved for backward
        return input_grads

    def deliver(self, t, g, ready) -> None:
        """Hand gradient ``g`` (or None) to tensor ``t``: a leaf accumulates it (hooks fire on the
        last contribution); a node's output adds it up, and the node joins ``ready`` once every
        consumer has delivered."""
        if t._node is None:  # a leaf
            if g is not None:
                _accumulate_leaf(t, g)
            self.pending[t] -= 1
            if self.pending[t] == 0:
                _fire_hooks(t)
            return
        producer = t._node
        if g is not None:
            buffer = self.grads.get(producer)
            if buffer is None:
                buffer = self.grads[producer] = [None] * producer.n_outputs
            i = t._out_index
            buffer[i] = g if buffer[i] is None else buffer[i] + g
        self.consumers[producer] -= 1
        if self.consumers[producer] == 0:
            if producer not in self.grads:  # every path into it carried no gradient
                self.grads[producer] = [None] * producer.n_outputs
            ready.append(producer)


def _count_dependencies(root_node):
    """For every node reachable from ``root_node``: the number of edges from reachable nodes into it;
    for every leaf: the number of gradient contributions it will receive."""
    consumers = {root_node: 0}
    pending = {}
    stack = [root_node]
    while stack:
        node = stack.pop()
        if node.inputs is None:
            raise RuntimeError("backward through a graph whose saved arrays were already freed; "
                               "call the first backward with retain_graph=True to go through it twice")
        for t in node.inputs:
            if t is None:
                continue
            if t._node is None:
                pending[t] = pending.get(t, 0) + 1
            elif t._node in consumers:
                consumers[t._node] += 1
            else:
                consumers[t._node] = 1
                stack.append(t._node)
    return consumers, pending


def _accumulate_leaf(t, g):
    """Add ``g`` into leaf ``t.grad`` in place (allocating a fresh copy the first time)."""
    if g.shape != t.data.shape:
        raise RuntimeError(f"gradient of shape {g.shape} for a leaf of shape {t.data.shape}")
    if t.grad is None:
        t.grad = get_array_module(t.data).array(g, dtype=t.data.dtype)
    else:
        t.grad += g


def _fire_hooks(t):
    if t._grad_ready_hooks:
        for hook in list(t._grad_ready_hooks):
            hook(t)
