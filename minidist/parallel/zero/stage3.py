"""ZeRO stage 3: parameters sharded too, gathered just before each use and freed right after.

Between uses a rank holds only its flat shard of every unit (1/N of the parameters). Each module
call of the model (the embedding, every block, the head; or a pipeline stage's chunks) runs through
:func:`sharded`, FSDP's pattern:

    forward:   all-gather the shards of the units it uses -> full parameters (bound to .data),
               and queue the next call's all-gathers (prefetch, on the communication thread)
               run the module WITH its graph, under saved-tensor hooks that pack every saved
               full weight as a small reference (the activations are kept as they are)
               free the full parameters (reshard after forward)
    backward:  a pre-backward node on the call's outputs all-gathers the units again (and prefetches
               the call before it); the hooks unpack each reference into the gathered weight
               when the grad-ready hooks see a unit's gradients complete, ZeRO reduce-scatters
               them (zero/optimizer.py) and frees the full parameters again

Nothing is recomputed: a Linear that saved its weight gets it back, gathered, from ``unpack``
(minidist/autograd/saved_tensors.py). So ZeRO-3 costs ZeRO-2's compute and keeps the activations
that no ZeRO keeps; ``--recompute`` is a separate choice. Communication per step: two all-gathers
(forward, backward) and one reduce-scatter of every unit, 3 (N-1)/N bytes per parameter byte
against data parallelism's 2 (N-1)/N: 1.5x. (The tied embedding is gathered by the embedding and
again by the head in forward; in backward it stays gathered from the head's use to the embedding's.)

With ``reshard_after_forward=False`` (pipeline parallelism, as torchtitan sets it) the units stay
gathered from their first forward of a step to their last backward: one all-gather per step
instead of two per micro-batch, at the price of holding the stage's full parameters while its
micro-batches are in flight. A call made without a graph (evaluation, generation) always frees.
"""
from __future__ import annotations

from minidist.autograd import Function, Tensor, is_grad_enabled, saved_tensors_hooks


class Gatherer:
    """Which units are gathered now, and the all-gathers that bring them. ``calls[i]`` lists the
    Shards the i-th module call uses (in forward order); ``prefetch`` queues the next call's
    all-gathers while the current one computes."""

    def __init__(self, calls: list, prefetch: bool = True, reshard_after_forward: bool = True, offload=None):
        self.calls, self.prefetch = calls, prefetch
        self.reshard_after_forward = reshard_after_forward
        self.offload = offload if offload is not None and offload.params else None  # parameter shards off the device
        self._full = {}  # id(shard) -> its full flat array (numel,) while gathered
        self._queued = {}  # id(shard) -> (full flat array, Work) of an all-gather in flight
        self._by_array = {}  # id(a gathered parameter's array) -> (shard, parameter index): what pack recognises

    def gather(self, index: int, direction: int) -> None:
        """Bind the full parameters of call ``index``'s units (waiting for a prefetch, or
        all-gathering now) and queue those of call ``index + direction``. Each all-gather sends
        this rank's shard to every rank of the shard's group and receives theirs. With the parameter
        shards offloaded, those of call ``index + 2 direction`` start coming in from disk."""
        nxt = index + direction
        if self.offload is not None and 0 <= nxt + direction < len(self.calls):
            self.offload.read_ahead([s.compute for s in self.calls[nxt + direction]])
        if self.prefetch and 0 <= nxt < len(self.calls):
            self._queue(self.calls[nxt])
        self.ensure(self.calls[index])

    def ensure(self, shards) -> None:
        """Make every unit of ``shards`` gathered (the all-gathers queued if they are not yet)."""
        self._queue(shards)
        for s in shards:
            if id(s) in self._queued:
                full, work = self._queued.pop(id(s))
                work.wait()
                s.unit.bind(full)
                self._full[id(s)] = full
                self._by_array.update({id(p.data): (s, i) for i, (_, p) in enumerate(s.unit.params)})

    def held_bytes(self) -> int:
        """Bytes of full parameters this rank holds now: the units gathered and bound, and the
        buffers of the all-gathers in flight (the prefetch). ZeRO-3's working memory on top of
        the resting shards."""
        return sum(full.nbytes for full in self._full.values()) + sum(full.nbytes for full, _ in self._queued.values())

    def prefetching(self, shards) -> list:
        """Those of ``shards`` whose all-gather is in flight now."""
        return [s for s in shards if id(s) in self._queued]

    def _queue(self, shards) -> None:
        for s in shards:
            if id(s) not in self._full and id(s) not in self._queued:
                full = s.unit.xp.empty(s.unit.numel, dtype=s.unit.dtype)  # (numel,)
                shard = s.compute if self.offload is None else self.offload.fetch(s.compute, s.unit.xp)  # up first
                gather = s.group.all_gather(shard, count=s.unit.numel, out=full, async_op=True,
                                            label=f"parameter: ZeRO-3 gathers {s.unit.name} for its use")
                self._queued[id(s)] = (full, gather)

    def free(self, shards) -> None:
        """Drop the full parameters of every unit of ``shards`` (only the shards remain)."""
        for s in shards:
            if self._full.pop(id(s), None) is not None:
                for _, p in s.unit.params:
                    self._by_array.pop(id(p.data), None)
                s.unit.release()

    def free_all(self) -> None:
        """Drop every gathered unit and wait out any prefetch (the end of a step)."""
        for full, work in self._queued.values():
            work.wait()
        self._queued.clear()
        self.free([s for call in self.calls for s in call])

    def pack(self, array):
        """Saved-tensor pack hook: a gathered parameter's full array (a Linear's or a LayerNorm's
        weight) becomes (shard, parameter index); any other array (an activation) is kept as it is."""
        return self._by_array.get(id(array), array)

    def unpack(self, ref):
        """Saved-tensor unpack hook: the parameter ``pack`` named, its unit gathered again."""
        s, i = ref
        self.ensure([s])
        return s.unit.params[i][1].data


class PreBackward(Function):
    """Identity on a call's outputs; its backward (run before any backward inside the call) gathers
    the call's units again and prefetches the call before it."""

    @staticmethod
    def forward(ctx, gatherer, index, *outputs):
        ctx.gatherer, ctx.index = gatherer, index
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.gatherer.gather(ctx.index, direction=-1)  # backward runs the calls in reverse
        return (None, None, *grads)


def sharded(fn, gatherer, index):
    """``fn`` made to run as call ``index`` of ``gatherer``: its units gathered around it, its saved
    weights packed, a :class:`PreBackward` on its tensor outputs."""
    def call(*args):
        gatherer.gather(index, direction=+1)
        shards = gatherer.calls[index]
        if not is_grad_enabled():  # no backward will come: free at once
            out = fn(*args)
            gatherer.free(shards)
            return out
        if gatherer.reshard_after_forward:
            with saved_tensors_hooks(gatherer.pack, gatherer.unpack):
                out = fn(*args)
            gatherer.free(shards)
        else:
            out = fn(*args)
        return _pre_backward(out, gatherer, index)
    return call


def _pre_backward(out, gatherer, index):
    """``out`` (a Tensor, or a tuple holding Tensors and Nones) with its graph tensors routed
    through one :class:`PreBackward` node."""
    outs = out if isinstance(out, tuple) else (out,)
    slots = [i for i, o in enumerate(outs) if isinstance(o, Tensor) and o.requires_grad]
    if not slots:
        return out
    routed = PreBackward.apply(gatherer, index, *(outs[i] for i in slots))
    routed = routed if isinstance(routed, tuple) else (routed,)
    result = list(outs)
    for i, r in zip(slots, routed):
        result[i] = r
    return tuple(result) if isinstance(out, tuple) else result[0]


def _used_by(shards, *modules):
    ids = {id(p) for m in modules for p in m.parameters()}
    return [s for s in shards if any(id(p) in ids for _, p in s.unit.params)]


def fully_shard(model, shards, reshard_after_forward: bool = True, offload=None) -> Gatherer:
    """Route every module call of ``model`` through :func:`sharded` (the name is FSDP2's): a GPT's
    ``embed``, each block's ``forward`` and ``head``; a pipeline stage's ``forward`` per chunk.
    ``shards`` are the model's units' Shard records; their full parameters are freed here, so from
    now on the model holds only shards between uses; each is gathered over its own ``group``, and
    with ``offload`` (offload.py) moving the parameter shards, fetched from where they live first.
    Returns the :class:`Gatherer`."""
    owner = {id(p) for s in shards for _, p in s.unit.params}
    if len(owner) != sum(1 for _ in model.parameters()):
        raise ValueError("fully_shard: every parameter of the model must belong to one unit")
    t = model.transformer
    if hasattr(model, "stages"):  # a PipelineStage: one call per chunk, gathered for the whole step
        chunks = [([t.wte, t.wpe] if model.stages[c] == 0 else []) + [t.h[str(i)] for i in model.layers[c]]
                  + ([t.ln_f, model.lm_head] if model.stages[c] == model.n_stages - 1 else [])
                  for c in range(len(model.stages))]
        gatherer = Gatherer([_used_by(shards, *m) for m in chunks], prefetch=False,
                            reshard_after_forward=reshard_after_forward, offload=offload)
        forward = model.forward
        calls = [sharded(lambda x, targets=None, dropout=None, c=c: forward(c, x, targets, dropout), gatherer, c)
                 for c in range(len(chunks))]
        object.__setattr__(model, "forward",
                           lambda chunk, x, targets=None, dropout=None: calls[chunk](x, targets, dropout))
    else:
        gatherer = Gatherer([_used_by(shards, t.wte, t.wpe), *(_used_by(shards, b) for b in t.h),
                                    _used_by(shards, t.ln_f, model.lm_head)],
                            reshard_after_forward=reshard_after_forward, offload=offload)
        object.__setattr__(model, "embed", sharded(model.embed, gatherer, 0))
        for i, block in enumerate(t.h, start=1):
            object.__setattr__(block, "forward", sharded(block.forward, gatherer, i))
        object.__setattr__(model, "head", sharded(model.head, gatherer, len(t.h) + 1))
    for s in shards:
        s.unit.release()
    return gatherer
