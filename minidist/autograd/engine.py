"""The backward pass: walk the graph from one tensor to the leaves, iteratively.

Two passes, no recursion (a 10 000-op chain must not overflow Python's stack):
1. From the root's node, visit every node it depends on and count, per node, how many consumer edges
   will deliver a gradient to it, and per leaf, how many contributions it will receive.
2. Kahn's topological order: a node runs its backward only once all its consumers have delivered.
   Each gradient delivered to a leaf decrements its pending count; at zero its ``.grad`` is final for
   this pass and its grad-ready hooks fire (overlapped data parallelism launches all-reduces there).
"""
from minidist.autograd.backend import get_array_module
from minidist.autograd.saved_tensors import unpack_saved


def run_backward(root, grad, retain_graph: bool = False):
    """Propagate ``grad`` (shaped like ``root``) to every leaf that requires grad, accumulating into
    their ``.grad`` (PyTorch rules: a second backward adds). Frees saved arrays unless ``retain_graph``."""
    if root._node is None:
        _accumulate_leaf(root, grad)
        _fire_hooks(root)
        return
    consumers, pending = _count_dependencies(root._node)

    grads = {root._node: [None] * root._node.n_outputs}  # node -> gradient of each of its outputs
    grads[root._node][root._out_index] = grad
    ready = [root._node]
    while ready:
        node = ready.pop()
        inputs = node.inputs
        output_grads = grads.pop(node)
        if all(g is None for g in output_grads):  # nothing flows through this node
            input_grads = (None,) * len(inputs)
        else:
            unpack_saved(node)  # what saved_tensors_hooks packed (ZeRO-3: the weights, gathered again)
            input_grads = type(node).backward(node, *output_grads)
            if type(input_grads) is not tuple:
                input_grads = (input_grads,)
        if not retain_graph:
            node.inputs = None
            node.__dict__.clear()  # the arrays forward saved for backward
        for t, g in zip(inputs, input_grads):
            if t is None:
                continue
            if t._node is None:  # a leaf
                if g is not None:
                    _accumulate_leaf(t, g)
                pending[t] -= 1
                if pending[t] == 0:
                    _fire_hooks(t)
                continue
            producer = t._node
            if g is not None:
                buffer = grads.get(producer)
                if buffer is None:
                    buffer = grads[producer] = [None] * producer.n_outputs
                i = t._out_index
                buffer[i] = g if buffer[i] is None else buffer[i] + g
            consumers[producer] -= 1
            if consumers[producer] == 0:
                if producer not in grads:  # every path into it carried no gradient
                    grads[producer] = [None] * producer.n_outputs
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
