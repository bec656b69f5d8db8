"""Ring attention: causal attention over a sequence cut into context-parallel slices.

Each of the n ranks of a cp group holds the queries, keys and values of its own tokens (its chunks
of the sequence: :func:`sequence_chunks`). Its queries stay put; the key/value blocks travel around
the ring, one hop per step, so after n - 1 hops every query has met every key:

    step s:  rank r attends with its queries over the K/V block of rank (r - s) mod n,
             while it already sends that block on to rank r + 1 and receives the next from r - 1

A block's result is merged into the running output with the online-softmax rule (flash attention's
log-sum-exp): for two partial results (o_a, lse_a), (o_b, lse_b) over disjoint key sets,

    lse = log(exp(lse_a) + exp(lse_b)),   o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b

which is exactly softmax over the union. The causal mask skips every (query chunk, key chunk) pair
whose keys all come after its queries, and needs no mask at all where they all come before; only a
chunk against itself is cut by the triangle.

Attention dropout (minidist/nn/dropout.py) multiplies a block's probabilities by its mask after
their normaliser is summed, so each block contributes exactly its part of (P * D) @ v; backward
multiplies dP by the same mask, drawn again for the block's global query and key positions.

Backward is a ring too (flash attention's backward, block by block, from the saved output and
log-sum-exp): the K/V blocks travel around again, and beside each one travels the running sum of
its gradient dK, dV; after the last hop that sum arrives back at the block's owner, complete.

What one call sends, per rank: forward n - 1 K/V blocks (2 x B x nh x L x hs values, in the inputs'
dtype: half the bytes in float16) to the next rank; backward n - 1 K/V blocks and n dK/dV sums of
the same size, the sums in float32 (float64 for float64 inputs), as they accumulate. Each K/V hop is posted before
the step's compute and waited after it, so the exchange overlaps the attention math (the trace's
"ring sendrecv kv" events, kind p2p, span from posting to arrival).

Contiguous layout (rank r holds tokens [rL, (r+1)L)): rank r computes r + 1 of the n blocks, so the
last rank works n times as long as the first. Zig-zag (Megatron-LM's load balancing) cuts the
sequence into 2n chunks and gives rank r chunks r and 2n - 1 - r: every rank then computes the same
amount (half of each block it meets, plus its two diagonal triangles).
"""
from __future__ import annotations

import math
import time

from minidist.autograd import Function, get_array_module
from minidist.autograd.backend import matmul
from minidist.comm.trace import Event

TAG_KV, TAG_DKV = 1, 2  # point-to-point tags on the cp group: the K/V blocks, the dK/dV sums
KV = ("ring sendrecv kv", "activation: ring attention K/V")  # a hop's trace event, its messages' label
DKV = ("ring sendrecv dkv", "activation: ring attention dK/dV sums")


def sequence_chunks(T: int, cp_size: int, cp_rank: int, zigzag: bool) -> list[tuple[int, int]]:
    """The (start, stop) token ranges of a T-token sequence that cp rank ``cp_rank`` of ``cp_size``
    holds, in its local order: one range of T/cp tokens, or with ``zigzag`` chunks r and 2cp-1-r of
    2cp equal chunks. T must divide evenly (the trainer checks it)."""
    if zigzag:
        c = T // (2 * cp_size)
        return [(cp_rank * c, (cp_rank + 1) * c), ((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c)]
    c = T // cp_size
    return [(cp_rank * c, (cp_rank + 1) * c)]


def token_ranges(chunks) -> str:
    """``0-7`` or ``0-3 + 28-31``: the token positions of ``chunks`` ((start, stop) ranges), for people."""
    return " + ".join(f"{a}-{b - 1}" for a, b in chunks)


def block_plan(q_chunks, kv_chunks) -> list[tuple[int, int, str]]:
    """Which (query chunk i, key chunk j) pairs to compute, as (i, j, "full" | "causal"): a pair
    whose keys all come after its queries is skipped (fully masked), one whose keys all come first
    needs no mask, any other is cut by the causal triangle."""
    plan = []
    for i, (qa, qb) in enumerate(q_chunks):
        for j, (ka, kb) in enumerate(kv_chunks):
            if ka >= qb:
                continue
            plan.append((i, j, "full" if kb - 1 <= qa else "causal"))
    return plan


def causal_work(T: int, cp_size: int, zigzag: bool) -> list[float]:
    """Useful attention work per cp rank in one forward, in (T/cp x T/cp)-block units: the
    unmasked area of the pairs :class:`RingAttention` computes (:func:`block_plan`), a pair without
    mask counting its full area, a causal pair half of it. Contiguous: rank r does r + 1/2; zig-zag:
    every rank cp / 2. (A causal pair is computed whole and then half masked, so the area actually
    computed is r + 1 blocks, and cp / 2 + 1/4 for zig-zag: balanced all the same.)"""
    area = (T / cp_size) ** 2
    work = []
    for r in range(cp_size):
        mine = sequence_chunks(T, cp_size, r, zigzag)
        pairs = [(mine[i], theirs[j], kind) for src in range(cp_size)
                 for theirs in [sequence_chunks(T, cp_size, src, zigzag)] for i, j, kind in block_plan(mine, theirs)]
        work.append(sum((q[1] - q[0]) * (k[1] - k[0]) * (1 if kind == "full" else 0.5) for q, k, kind in pairs) / area)
    return work


def _accumulator_dtype(dtype):
    """Scores, softmax and running sums in float64 for float64 inputs, else float32 (as flash
    attention accumulates half-precision inputs in float32)."""
    return "float64" if dtype == "float64" else "float32"


def _scores(q, k, scale, q_range, k_range, kind, xp):
    """Scaled scores q k^T (B, nh, Lq, Lk), with -inf where a key comes after its query ("causal")."""
    s = matmul(q, k.swapaxes(-1, -2))
    s *= scale
    if kind == "causal":
        qpos = xp.arange(*q_range)[:, None]
        kpos = xp.arange(*k_range)[None, :]
        s[..., kpos > qpos] = -xp.inf
    return s


def attention_block(q, k, v, scale, q_range, k_range, kind, dropout=None):
    """One block's partial attention: (o (B, nh, Lq, hs), lse (B, nh, Lq)) = softmax over these
    keys only, and the log of its normaliser. Every query row has at least one visible key.
    ``dropout`` (an AttentionDropout, or None) drops probabilities after the normaliser is summed."""
    xp = get_array_module(q)
    s = _scores(q, k, scale, q_range, k_range, kind, xp)
    m = s.max(axis=-1, keepdims=True)  # (B, nh, Lq, 1)
    xp.exp(s - m, out=s)
    total = s.sum(axis=-1, keepdims=True)
    if dropout is not None:
        s *= dropout.scaled_keep(range(*q_range), range(*k_range), s)
    return matmul(s, v) / total, (m + xp.log(total))[..., 0]


def merge_partial(out, lse, o, block_lse) -> None:
    """Fold a block's (``o``, ``block_lse``) into the running (``out``, ``lse``), in place: the
    online-softmax rule. ``lse`` starts at -inf and ``out`` at 0 (no keys seen yet)."""
    xp = get_array_module(out)
    new = xp.logaddexp(lse, block_lse)
    out *= xp.exp(lse - new)[..., None]
    out += xp.exp(block_lse - new)[..., None] * o
    lse[...] = new


def _chunk_slices(chunks):
    """Local slices of each chunk: chunk i of equal-length chunks sits at [i c, (i+1) c)."""
    c = chunks[0][1] - chunks[0][0]
    return [slice(i * c, (i + 1) * c) for i in range(len(chunks))]


class _Ring:
    """One rotation of a buffer around the cp ring: post the hop (send to r + 1, receive from
    r - 1) before the step's compute, wait for it after, and record the span as one trace event
    (``op``, e.g. "ring sendrecv kv"); ``label`` is the purpose of its messages."""

    def __init__(self, group, tag, op, label):
        self.group, self.tag, self.op, self.label = group, tag, op, label
        self.n, self.r = group.size, group.rank

    def start(self, send, recv):
        self._t0 = time.perf_counter()
        self._reqs = [self.group.irecv(recv, (self.r - 1) % self.n, self.tag, label=self.label),
                      self.group.isend(send, (self.r + 1) % self.n, self.tag, label=self.label)]
        self._nbytes = send.nbytes

    def wait(self):
        for req in self._reqs:
            req.wait()
        trace = self.group.trace
        if trace.enabled:
            trace.add(Event(self.op, self.group.name, "ring", self._nbytes, self._t0, time.perf_counter(), 0,
                            trace.rank, (self.r + 1) % self.n, "p2p", label=self.label))


class RingAttention(Function):
    """Causal attention of this rank's queries over the whole sequence, the K/V blocks passed
    around the cp ring (module docstring). Inputs q, k, v (B, nh, L, hs) hold this rank's L tokens,
    in the order of :func:`sequence_chunks`."""

    @staticmethod
    def forward(ctx, q, k, v, group, zigzag, dropout=None):
        xp = get_array_module(q)
        n, r = group.size, group.rank
        T = q.shape[2] * n
        acc = _accumulator_dtype(q.dtype)
        scale = 1.0 / math.sqrt(q.shape[-1])
        qa = q.astype(acc, copy=False)
        mine = sequence_chunks(T, n, r, zigzag)
        rows = _chunk_slices(mine)
        out = xp.zeros(q.shape, dtype=acc)  # (B, nh, L, hs)
        lse = xp.full(q.shape[:-1], -xp.inf, dtype=acc)  # (B, nh, L)
        kv = xp.ascontiguousarray(xp.stack([k, v]))  # (2, B, nh, L, hs) in k's dtype: one message per hop
        spare = xp.empty(kv.shape, kv.dtype)
        ring = _Ring(group, TAG_KV, *KV)
        for s in range(n):
            src = (r - s) % n
            if s < n - 1:
                ring.start(kv, spare)
            theirs = sequence_chunks(T, n, src, zigzag)
            for i, j, kind in block_plan(mine, theirs):
                kj, vj = (a[:, :, rows[j]].astype(acc, copy=False) for a in kv)
                o, block_lse = attention_block(qa[:, :, rows[i]], kj, vj, scale, mine[i], theirs[j], kind, dropout)
                merge_partial(out[:, :, rows[i]], lse[:, :, rows[i]], o, block_lse)
            if s < n - 1:
                ring.wait()
                kv, spare = spare, kv
        ctx.q, ctx.k, ctx.v, ctx.out, ctx.lse = q, k, v, out, lse
        ctx.group, ctx.zigzag, ctx.scale, ctx.dropout = group, zigzag, scale, dropout
        return out.astype(q.dtype)

    @staticmethod
    def backward(ctx, grad):  # grad (B, nh, L, hs)
        q, group, zigzag, scale, dropout = ctx.q, ctx.group, ctx.zigzag, ctx.scale, ctx.dropout
        xp = get_array_module(q)
        n, r = group.size, group.rank
        T = q.shape[2] * n
        acc = ctx.out.dtype
        qa, do = q.astype(acc, copy=False), grad.astype(acc)
        delta = (do * ctx.out).sum(axis=-1)  # (B, nh, L): rowsum(dO * O), the softmax Jacobian's term
        mine = sequence_chunks(T, n, r, zigzag)
        rows = _chunk_slices(mine)
        dq = xp.zeros(q.shape, dtype=acc)
        kv = xp.ascontiguousarray(xp.stack([ctx.k, ctx.v]))  # (2, B, nh, L, hs) in k's dtype
        spare = xp.empty(kv.shape, kv.dtype)
        kv_ring, dkv_ring = _Ring(group, TAG_KV, *KV), _Ring(group, TAG_DKV, *DKV)
        dkv = None  # the dK/dV sum this rank sends on, once its own share is added
        for s in range(n):
            src = (r - s) % n
            if s < n - 1:
                kv_ring.start(kv, spare)
            if s > 0:  # the sum so far for block src, from the ranks it visited before this one
                incoming = xp.empty(kv.shape, acc)
                dkv_ring.start(dkv, incoming)
            theirs = sequence_chunks(T, n, src, zigzag)
            mine_dkv = xp.zeros(kv.shape, acc)  # (2, B, nh, L, hs): this rank's share of dK, dV of block src
            for i, j, kind in block_plan(mine, theirs):
                ki, vi = (a[:, :, rows[j]].astype(acc, copy=False) for a in kv)
                qi, doi = qa[:, :, rows[i]], do[:, :, rows[i]]
                p = _scores(qi, ki, scale, mine[i], theirs[j], kind, xp)
                xp.exp(p - ctx.lse[:, :, rows[i], None], out=p)  # P: the block's final probabilities
                keep = None if dropout is None else dropout.scaled_keep(range(*mine[i]), range(*theirs[j]), p)
                mine_dkv[1][:, :, rows[j]] += matmul((p if keep is None else p * keep).swapaxes(-1, -2), doi)  # dV
                ds = matmul(doi, vi.swapaxes(-1, -2))  # dP
                if keep is not None:
                    ds *= keep
                ds -= delta[:, :, rows[i], None]
                ds *= p
                ds *= scale  # dS of the scaled scores
                dq[:, :, rows[i]] += matmul(ds, ki)
                mine_dkv[0][:, :, rows[j]] += matmul(ds.swapaxes(-1, -2), qi)
            if s > 0:
                dkv_ring.wait()
                mine_dkv += incoming
            dkv = mine_dkv
            if s < n - 1:
                kv_ring.wait()
                kv, spare = spare, kv
        if n > 1:  # the last hop: block r+1's sum goes home, and mine comes back complete
            home = xp.empty(dkv.shape, dkv.dtype)
            dkv_ring.start(dkv, home)
            dkv_ring.wait()
            dkv = home
        dtype = q.dtype
        return dq.astype(dtype), dkv[0].astype(dtype), dkv[1].astype(dtype), None, None, None


def ring_attention(q, k, v, group, zigzag: bool = False, dropout=None):
    """Causal attention for this rank's tokens (q, k, v: (B, nh, L, hs) Tensors, L = T / cp, in the
    order of :func:`sequence_chunks`) over the whole sequence held by ``group``'s ranks, its
    probabilities dropped by ``dropout`` (an AttentionDropout, or None). Returns (B, nh, L, hs).
    Collective over ``group``: see the module docstring for what it sends."""
    return RingAttention.apply(q, k, v, group, zigzag, dropout)
