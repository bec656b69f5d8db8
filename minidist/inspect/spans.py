"""Per-module compute spans: which part of the model a rank computed, forward and backward, and
what it held meanwhile.

Inside a training step's "forward" span, :meth:`ModuleSpans.forward` records one span per module
it runs: ``embedding``, ``h.0`` ... ``h.{L-1}``, ``head``; inside "backward", :meth:`ModuleSpans.backward`
records them again in reverse. A timeline then shows which block's collective overlaps which block's
compute, and ``--explain`` says which block a call belongs to. Sends nothing.

How, for the length of one forward: each block's ``forward`` is wrapped (a per-instance attribute,
as recompute.py and zero/stage3.py do; restored on exit), the wrapper times the block and routes its input
and output through :class:`Boundary`, an identity Function whose backward notes when the gradient
crossed it. A block's backward runs from its output's crossing to its input's; the head's from the
start of backward to the last block's output; the embedding's from the first block's input to the end
of backward. In forward, the embedding is what ran before the first block, the head what ran after
the last. The boundaries pass gradients through untouched and in the same order (an identity node
on a tensor with one consumer runs exactly where that consumer's producer would have): the numbers
are bitwise those of the unwrapped model. Only a watched trace gets them (``--trace DIR`` streams it,
``--explain`` captures it); otherwise, the trainer's always-on ring of recent events included,
nothing is wrapped or recorded: the bookkeeping costs ~3% of a small model's step.

Each span is a trace event: kind "compute", group :data:`MODULE`, op the module ("h.3"), algorithm the
pass ("forward" / "backward"), seq the micro-batch, and ``nbytes`` the bytes this rank held when
the span ended: its parameters and gradients, and the activations its live graphs (every micro-batch
between its forward and its backward) keep for backward, counted once per buffer. The largest is
the step's peak (``peak_held_bytes``; temporaries that live inside one op are not seen).
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from minidist.autograd import Function, Tensor, is_grad_enabled
from minidist.comm.trace import Event
from minidist.inspect.accounting import buffer_ids, saved_buffers, unique_nbytes

MODULE = "module"  # the group of a module span's event


def is_module_span(e) -> bool:
    """Whether trace event ``e`` is a module span (not a pass: forward, backward, optimizer ...)."""
    return e.kind == "compute" and e.group == MODULE


def peak_held_bytes(events) -> int:
    """The most bytes a rank held at the end of any module span in ``events`` (0 if none)."""
    return max((e.nbytes for e in events if is_module_span(e)), default=0)


def _blocks(model) -> list[tuple[str, object]]:
    """(``h.<i>``, block) for the transformer blocks ``model`` holds: a GPT's or a pipeline stage's."""
    h = getattr(getattr(model, "transformer", None), "h", None)
    return [] if h is None else [(f"h.{name}", b) for name, b in h.named_modules() if name and "." not in name]


class Boundary(Function):
    """Identity, forward and backward; its backward tells ``tape`` the gradient crossed ``side``
    ("enter" or "leave") of module ``name``."""

    @staticmethod
    def forward(ctx, x, tape, name, side):
        ctx.tape, ctx.name, ctx.side = tape, name, side
        return x

    @staticmethod
    def backward(ctx, grad):
        ctx.tape.crossed(ctx.name, ctx.side)
        return grad, None, None, None


class Tape:
    """One forward of one micro-batch: its module spans so far, the activations its graph keeps per
    module, and in its backward the module being back-propagated."""

    def __init__(self, spans, model, seq: int, first: bool, last: bool):
        self.spans, self.seq, self.first, self.last = spans, seq, first, last
        self.params = list(model.parameters())
        self.excluded = buffer_ids(p.data for p in self.params)  # weights
        self.saved: dict[str, dict[int, int]] = {}  # module -> {buffer id: bytes} kept for backward
        self.seen: set[int] = set()  # graph nodes already counted
        self.blocks: list[str] = []  # in forward order
        self.edge = None  # forward: when the last block ended; backward: when the last crossing was
        self.open = None  # backward: (module, start) being back-propagated
        self.crossings = 0  # backward: block outputs the gradient has crossed

    def count(self, name: str, t) -> None:
        """Attribute to ``name`` the arrays saved by the graph nodes behind tensor ``t`` not yet counted
        (a Boundary is an earlier module's edge: counted already)."""
        if isinstance(t, Tensor):
            self.saved.setdefault(name, {}).update(
                saved_buffers(t, self.excluded, self.seen, stop=lambda node: isinstance(node, Boundary)))

    def output(self, out) -> None:
        """The forward's output (the loss, or the activation a stage sends): the head's saved arrays
        are counted from it."""
        if self.spans.on and is_grad_enabled():
            self.count("head" if self.last else self.blocks[-1] if self.blocks else "embedding", out)

    def crossed(self, name: str, side: str) -> None:
        """Backward reached ``side`` of block ``name``: a span ends (head or the block), another starts."""
        now = time.perf_counter()
        if side == "leave":
            if not self.crossings and self.last:  # the first crossing: the head's backward is done
                self.spans.emit("head", "backward", self.edge, now, self.seq, release=(self, "head"))
            self.crossings += 1
            self.open = (name, now)
        else:
            block, start = self.open if self.open is not None else (name, self.edge)
            self.spans.emit(block, "backward", start, now, self.seq, release=(self, block))
            self.open, self.edge = None, now


class _NoTape:
    """What a forward yields when spans are off: records nothing."""

    def output(self, out) -> None:
        pass


_NO_TAPE = _NoTape()


class ModuleSpans:
    """The module spans of one step's forwards and backwards into ``trace`` (none unless it is
    enabled and watched). One object per step: it knows which micro-batches' graphs are alive."""

    def __init__(self, trace):
        self.trace = trace
        self.on = trace is not None and trace.enabled and trace.watched
        self.live: list[Tape] = []

    def emit(self, name, pass_, start, end, seq, release=None) -> None:
        """Record module ``name``'s span of ``pass_``; ``release`` (tape, module): its activations are
        freed first (that module's backward has run)."""
        if release is not None:
            release[0].saved.pop(release[1], None)
        self.trace.add(Event(name, MODULE, pass_, self.held(), start, end, seq, self.trace.rank, kind="compute",
                             thread=threading.get_ident()))

    def held(self) -> int:
        """Bytes held now: parameters, gradients, and the live graphs' saved activations."""
        params = self.live[-1].params if self.live else []
        saved = {}
        for tape in self.live:
            for found in tape.saved.values():
                saved.update(found)
        return unique_nbytes([p.data for p in params] + [p.grad for p in params]) + sum(saved.values())

    @contextmanager
    def forward(self, model, seq: int = 0, first: bool = True, last: bool = True):
        """Inside the block ``model``'s blocks record their forward spans and plant the boundaries
        of their backward ones; ``first`` / ``last``: this forward runs the embedding / the head.
        Yields the :class:`Tape` (``tape.output(out)`` counts the head's activations)."""
        if not self.on:
            yield _NO_TAPE
            return
        tape = Tape(self, model, seq, first, last)
        self.live.append(tape)
        start = time.perf_counter()
        wrapped = []
        for name, block in _blocks(model):
            own = block.__dict__.get("forward")  # an instance attribute (recompute, ZeRO-3) or None
            wrapped.append((block, own))
            object.__setattr__(block, "forward", self._timed(tape, name, own or block.forward, start))
        try:
            yield tape
        finally:
            for block, own in wrapped:
                if own is None:
                    del block.__dict__["forward"]
                else:
                    object.__setattr__(block, "forward", own)
            end = time.perf_counter()
            if last and tape.edge is not None:
                self.emit("head", "forward", tape.edge, end, seq)
            if not is_grad_enabled() or not tape.blocks:
                self.live.remove(tape)  # no backward will come

    def _timed(self, tape, name, forward, pass_start):
        """``forward`` of block ``name``, timed, between two boundaries when a graph is built."""
        def call(x, *rest):  # rest: the block's other arguments (its dropout)
            begin = time.perf_counter()
            graph = is_grad_enabled()
            if not tape.blocks and tape.first:  # what ran before the first block: the embedding
                if graph:
                    tape.count("embedding", x)
                self.emit("embedding", "forward", pass_start, begin, tape.seq)
            tape.blocks.append(name)
            if graph and isinstance(x, Tensor) and x.requires_grad:
                x = Boundary.apply(x, tape, name, "enter")
            y = forward(x, *rest)
            if graph:
                tape.count(name, y)
                if isinstance(y, Tensor) and y.requires_grad:
                    y = Boundary.apply(y, tape, name, "leave")
            tape.edge = time.perf_counter()
            self.emit(name, "forward", begin, tape.edge, tape.seq)
            return y
        return call

    @contextmanager
    def backward(self, tape):
        """Inside the block the backward of ``tape``'s forward runs: its module spans are recorded
        as the gradient crosses the boundaries (the embedding's when the block ends)."""
        if not self.on or tape not in self.live:
            yield
            return
        tape.edge, tape.open, tape.crossings = time.perf_counter(), None, 0
        try:
            yield
        finally:
            if tape.first:
                self.emit("embedding", "backward", tape.edge, time.perf_counter(), tape.seq, release=(tape, "embedding"))
            tape.saved.clear()  # the graph is freed
            self.live.remove(tape)
