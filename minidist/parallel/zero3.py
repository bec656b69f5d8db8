"""ZeRO stage 3: parameters sharded too, gathered just before each use and freed right after.

Between uses a rank holds only its flat shard of every unit (1/N of the parameters). Each module of
the GPT (the embedding, every block, the head) runs through :class:`ShardedCall`:

    forward:   all-gather the shards of the units it uses  -> full parameters (bound to .data);
               queue the next module's all-gathers (prefetch, on the communication thread)
               run the module WITHOUT a graph, keep only its input
               free the full parameters
    backward:  all-gather again (and prefetch the module before it)
               re-run the module with a graph and back-propagate through it (recomputation)
               reduce-scatter the full gradients -> this rank's gradient shard (op "avg" over dp)
               free the full parameters and full gradients

Why recompute? A graph recorded in forward would hold the full weight arrays until backward (a
Linear saves its weight), so freeing them would free nothing. PyTorch's FSDP shrinks the weight's
storage to 0 bytes and regrows it before backward; a NumPy array cannot be regrown in place, so
here the module's forward is re-run in backward instead: no weight and no internal activation of a
unit outlives its call (see recompute.py). Communication per step: two all-gathers and one
reduce-scatter of every unit each time it is used, 3 (N-1)/N bytes per parameter byte against plain
data parallelism's 2 (N-1)/N all-reduce: 1.5x (the tied embedding is used twice, by the embedding and
by the head, and pays twice).

Its Function's inputs are the module's inputs AND the shard tensors of its units, so the autograd
engine accumulates each reduce-scattered gradient into the shard tensor's ``.grad``: the gradient the
optimizer of this rank updates its shard with.
"""
from __future__ import annotations

from minidist.autograd import Function, Tensor
from minidist.parallel.recompute import rerun_backward, run_without_graph


class ShardedCall(Function):
    """``fn(*args)``, the ``index``-th module call of the model, with the units it uses gathered
    around it in forward and in backward.

    Apply as ``ShardedCall.apply(fn, is_tensor, gatherer, index, *args, *shard_tensors)``; the shard
    tensors of the call's units come last so that their gradients reach the engine."""

    @staticmethod
    def forward(ctx, fn, is_tensor, gatherer, index, *inputs):
        args = inputs[:len(is_tensor)]
        shards = gatherer.gather(index, direction=+1)  # the next call's units start arriving too
        out = run_without_graph(fn, args, is_tensor)
        free(shards)
        ctx.fn, ctx.is_tensor, ctx.gatherer, ctx.index, ctx.args = fn, is_tensor, gatherer, index, args
        return out

    @staticmethod
    def backward(ctx, *grads):
        n = len(ctx.is_tensor)
        shards = ctx.gatherer.gather(ctx.index, direction=-1)  # backward runs the calls in reverse
        arg_grads = rerun_backward(ctx.fn, ctx.args, ctx.is_tensor, ctx.needs_input_grad[4:4 + n], grads)
        shard_grads = tuple(reduce_scatter_grads(s, ctx.gatherer.group) for s in shards)
        free(shards)
        return (None, None, None, None, *arg_grads, *shard_grads)


class Gatherer:
    """The all-gathers of ZeRO-3 with prefetch. ``calls[i]`` lists the Shards the i-th module call
    (embedding, blocks, head, in forward order) uses. Gathering call i waits for its units (queued
    earlier as a prefetch, or now) and queues the all-gathers of call ``i + direction``, so they run
    on the group's communication thread while call i computes."""

    def __init__(self, group, calls: list):
        self.group, self.calls = group, calls
        self._queued = {}  # call index -> [(shard, full flat array, Work)]

    def gather(self, index: int, direction: int) -> list:
        """Bind the full parameters of call ``index``'s units and prefetch the next call's. Each
        all-gather sends this rank's shard to every dp rank and receives theirs. Returns the Shards."""
        queued = self._queued.pop(index, None) or self._queue(index)
        nxt = index + direction
        if 0 <= nxt < len(self.calls) and nxt not in self._queued:
            self._queued[nxt] = self._queue(nxt)
        for s, full, work in queued:
            work.wait()
            s.unit.bind(full)
        return self.calls[index]

    def _queue(self, index: int) -> list:
        queued = []
        for s in self.calls[index]:
            full = s.unit.xp.empty(s.unit.numel, dtype=s.unit.dtype)  # (numel,)
            queued.append((s, full, self.group.all_gather(s.param.data, count=s.unit.numel, out=full, async_op=True)))
        return queued


def gather(shards, group) -> None:
    """All-gather every unit's flat shard into a new full flat array (numel,) and bind the unit's
    parameters to it (blocking; no prefetch). Sends this rank's shard to, and receives every other
    shard from, all dp ranks."""
    for s in shards:
        full = s.unit.xp.empty(s.unit.numel, dtype=s.unit.dtype)  # (numel,)
        group.all_gather(s.param.data, count=s.unit.numel, out=full)
        s.unit.bind(full)


def free(shards) -> None:
    """Drop the full parameters of every unit (only the shards remain)."""
    for s in shards:
        s.unit.release()


def reduce_scatter_grads(shard, group, async_op: bool = False):
    """Flatten the unit's full parameter gradients, drop them, and reduce-scatter the flat vector
    (op "avg" over the dp group): returns this rank's averaged gradient shard (hi - lo,), or with
    ``async_op`` the Work whose ``wait()`` returns it."""
    unit = shard.unit
    flat = unit.flatten([p.grad for _, p in unit.params])  # (numel,)
    for _, p in unit.params:
        p.grad = None
    return group.reduce_scatter(flat, op="avg", async_op=async_op)  # (hi - lo,)


def sharded(fn, gatherer, index):
    """``fn`` made to run through :class:`ShardedCall` as call ``index`` of ``gatherer``."""
    def call(*args):
        is_tensor = tuple(isinstance(a, Tensor) for a in args)
        shard_tensors = (s.param for s in gatherer.calls[index])
        return ShardedCall.apply(fn, is_tensor, gatherer, index, *args, *shard_tensors)
    return call


def fully_shard(model, shards, group) -> None:
    """Route every module of GPT ``model`` through :class:`ShardedCall` (the name is FSDP2's):
    ``model.embed``, each block's ``forward`` and ``model.head`` now gather the units whose
    parameters they use. ``shards`` are the model's units' Shard records; their full parameters
    are freed here, so from now on the model holds only shards between uses."""
    owner = {id(p): s for s in shards for _, p in s.unit.params}

    def used_by(*modules):
        ids = {id(p) for m in modules for p in m.parameters()}
        return [s for s in shards if any(id(p) in ids for _, p in s.unit.params)]

    if len(owner) != sum(1 for _ in model.parameters()):
        raise ValueError("fully_shard: every parameter of the model must belong to one unit")
    t = model.transformer
    gatherer = Gatherer(group, [used_by(t.wte, t.wpe), *(used_by(b) for b in t.h), used_by(t.ln_f, model.lm_head)])
    embed, head, last = model.embed, model.head, len(t.h) + 1
    object.__setattr__(model, "embed", sharded(embed, gatherer, 0))
    for i, block in enumerate(t.h, start=1):
        object.__setattr__(block, "forward", sharded(block.forward, gatherer, i))
    head_call = sharded(head, gatherer, last)
    logits_call = sharded(lambda x: head(x)[0], gatherer, last)  # no targets: logits only
    object.__setattr__(model, "head", lambda x, targets=None: (
        head_call(x, targets) if targets is not None else (logits_call(x), None)))
    free(shards)
