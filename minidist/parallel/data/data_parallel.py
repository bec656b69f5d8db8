"""Data parallelism: every dp rank holds the whole model, computes gradients on its own rows of the
batch, and the ranks AVERAGE their gradients before the optimizer step (PyTorch's
DistributedDataParallel, written out).

Three ideas, each visible in the trace:

1. **Same start.** At construction every parameter is broadcast from dp rank 0, so the replicas
   agree even if they were initialised differently; identical averaged gradients keep them equal.
2. **Buckets.** Gradients live in a few flat, contiguous buffers (``bucket_bytes`` each, filled in
   REVERSE parameter order: the order backward finishes them). Each ``p.grad`` is a view into its
   bucket, so backward accumulates straight into the buffer and the all-reduce needs no copy. One
   all-reduce per bucket instead of one per parameter: fewer, larger messages.
3. **Overlap.** A grad-ready hook on each parameter counts down its bucket; when a bucket's last
   gradient is final, its all-reduce is queued (``async_op=True``) on the dp group's communication
   thread while backward goes on computing the earlier layers. :meth:`DataParallel.finish` waits.

Gradient accumulation: inside ``with dp.no_sync():`` backward only accumulates into the buckets;
the next backward outside it launches the all-reduces of the SUM of all micro-batches. A popular
naive version all-reduces only the gradient computed by the last backward (hooks that see the
incoming gradient, not the accumulated one): earlier micro-batches then stay un-averaged. The tests
check exactly that case.
"""
from __future__ import annotations

from contextlib import contextmanager

from minidist.device import get_array_module
from minidist.parallel.compose.grad_ownership import average_over_replicas, replica_group

DEFAULT_BUCKET_BYTES = 1 << 20  # 1 MiB; PyTorch DDP uses 25 MiB for models a thousand times larger


class Bucket:
    """A flat gradient buffer, the parameters whose ``.grad`` are views into it (in the
    parameters' memory: host or GPU), and the group it is averaged over."""

    def __init__(self, index: int, named_params: list, dtype, group):
        self.index, self.group = index, group
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        xp = get_array_module(self.params[0].data)
        self.buffer = xp.zeros(sum(p.data.size for p in self.params), dtype=dtype)  # (N,)
        self.views, self.offsets, offset = [], [], 0
        for p in self.params:
            self.views.append(self.buffer[offset:offset + p.data.size].reshape(p.data.shape))
            self.offsets.append(offset)
            offset += p.data.size
        self.pending = len(self.params)  # gradients not yet final in this backward
        self.work = None  # the in-flight all-reduce

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes


class DataParallel:
    """Wraps the parameters of ``model`` (anything with ``named_parameters()``) for data parallelism
    over ``dp_group``.

    Construction broadcasts every parameter from dp rank 0 (collective). Per optimizer step:
    ``zero_grad()``; then backward passes (all but the last inside ``no_sync()``); then ``finish()``,
    after which every ``p.grad`` holds the gradient averaged over the dp ranks. Sends: one
    ``all_reduce(op="avg")`` of each bucket's flat buffer per step, in bucket order.

    ``replicas`` (default: every rank of the group) is how many of the group's ranks are data
    replicas; under context parallelism the group is dp x cp and the cp ranks' gradients are parts
    of one replica's gradient, so they are summed and only the dp replicas averaged
    (:func:`~minidist.parallel.compose.grad_ownership.average_over_replicas`).

    ``expert_group`` (expert parallelism): the group the expert parameters (``p.expert``) are
    broadcast from and averaged over instead, the ranks holding the same experts
    (:func:`~minidist.parallel.compose.grad_ownership.replica_group`); their buckets hold experts only.
    """

    def __init__(self, model, dp_group, bucket_bytes: int = DEFAULT_BUCKET_BYTES, replicas: int | None = None,
                 expert_group=None):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        named = list(model.named_parameters())
        dtypes = {p.data.dtype for _, p in named}
        if len(dtypes) != 1:
            raise ValueError(f"one dtype for all parameters, please (buckets are flat): got {sorted(map(str, dtypes))}")
        self.group, self.replicas = dp_group, replicas
        self.bucket_bytes = bucket_bytes
        group_of = lambda p: replica_group(p, dp_group, expert_group)  # noqa: E731
        for _, p in named:
            group_of(p).broadcast(p.data, src=0, label="parameter: the same start on every replica")
        self.buckets = _fill_buckets(named[::-1], bucket_bytes, dtypes.pop(), group_of)
        self._sync = True
        self._next_launch = 0  # buckets launch strictly in index order, identical on every rank
        self._hooks = [p.register_grad_ready_hook(self._make_hook(bucket, view))
                       for bucket in self.buckets for p, view in zip(bucket.params, bucket.views)]
        self.zero_grad()

    def close(self) -> None:
        """Unhook from the model, so that a new DataParallel can take it over (e.g. on the survivors of a lost replica)."""
        for hook in self._hooks:
            hook.remove()

    def zero_grad(self) -> None:
        """Zero the buckets and point every ``p.grad`` at its view (use this, not
        ``optimizer.zero_grad()``, which drops the views)."""
        for bucket in self.buckets:
            bucket.buffer[...] = 0
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view
            bucket.pending = len(bucket.params)
            bucket.work = None
        self._next_launch = 0

    @contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate gradients locally (no communication)."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def finish(self) -> None:
        """Launch the all-reduce of any bucket not launched yet (parameters that got no gradient
        this step), wait for every bucket, and reset the countdowns. Afterwards each ``p.grad`` is
        the average over the dp group."""
        self._launch_ready(force=True)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.pending = len(bucket.params)
            bucket.work = None
        self._next_launch = 0

    def _make_hook(self, bucket: Bucket, view):
        def hook(p):
            if p.grad is not view:
                raise RuntimeError("a parameter's .grad is no longer its bucket view: call "
                                   "DataParallel.zero_grad(), not optimizer.zero_grad()")
            if not self._sync:
                return
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch_ready()
        return hook

    def _launch_ready(self, force: bool = False) -> None:
        """Queue the all-reduce of each bucket, in index order, as long as the next one is complete
        (or all remaining ones, with ``force``)."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.pending > 0 and not force:
                return
            op = average_over_replicas(bucket.buffer, bucket.group, self.replicas)
            bucket.work = bucket.group.all_reduce(bucket.buffer, op=op, async_op=True,
                                                  label=f"gradient: DDP bucket {bucket.index} average")
            self._next_launch += 1


def _fill_buckets(named_params: list, bucket_bytes: int, dtype, group_of) -> list[Bucket]:
    """Cut ``named_params`` (in the order given) into consecutive buckets of about ``bucket_bytes``:
    a bucket closes once it holds at least that many bytes (so one large parameter is one bucket),
    or before a parameter averaged over another group (``group_of(p)``)."""
    buckets, current, size, group = [], [], 0, None  # group: the current bucket's
    for name, p in named_params:
        if current and group_of(p) is not group:
            buckets.append(Bucket(len(buckets), current, dtype, group))
            current, size = [], 0
        current.append((name, p))
        size, group = size + p.data.nbytes, group_of(p)
        if size >= bucket_bytes:
            buckets.append(Bucket(len(buckets), current, dtype, group))
            current, size = [], 0
    if current:
        buckets.append(Bucket(len(buckets), current, dtype, group))
    return buckets
