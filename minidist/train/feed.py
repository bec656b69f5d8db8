"""How a rank's batches reach its step: which positions of each window it reads, read one step ahead,
and the time the step waited for them, recorded in the trace.

Which positions a rank reads (:func:`rank_spans`) follows from the layout: a context-parallel rank
holds only its chunks of every sequence (parallel/context/ring_attention.py: ``sequence_chunks``), so
it reads their ids and the next tokens as targets; a pipeline's first stage needs the ids, its last
stage the targets, a stage between them neither (with the zbv schedule rank 0 holds both ends).
Tensor-parallel ranks all read the same tokens. Its bytes per step are :meth:`DistributedSampler.bytes_per_step`.
Beside its batch a step gets the DropoutKey of its rows (:func:`dropout_key`): which global rows of
the step's batch they are, so every layout drops the same elements (minidist/nn/dropout.py).
"""
from __future__ import annotations

import threading

from minidist.comm.trace import Event
from minidist.device import to_device
from minidist.nn.dropout import DropoutKey
from minidist.parallel.context.ring_attention import sequence_chunks
from minidist.parallel.data.sampler import window_spans
from minidist.parallel.pipeline import placement_of, rank_stages


def rank_spans(cfg, mesh) -> list[tuple[int, int]]:
    """The (start, stop) positions of each (T+1)-token window this rank of ``mesh`` reads for ``cfg``."""
    chunks = (sequence_chunks(cfg.block_size, cfg.cp, mesh.cp_rank, cfg.cp_algorithm == "zigzag")
              if cfg.cp > 1 else None)
    stages = rank_stages(mesh.pp_rank, cfg.pp, cfg.virtual_stages, placement_of(cfg.schedule))
    return window_spans(cfg.block_size, chunks, inputs=0 in stages,
                        targets=cfg.pp * cfg.virtual_stages - 1 in stages)


def dropout_key(cfg, step: int, sampler):
    """The DropoutKey of ``step`` for ``sampler``'s rows of the global batch, or None without
    ``--dropout``: the masks depend on (seed, step, the rows, the element's place), not on the layout."""
    if not cfg.dropout:
        return None
    return DropoutKey(cfg.dropout, cfg.seed, step, tuple(int(r) for r in sampler.rows), cfg.block_size)


def read_batch(sampler, step: int, device):
    """(``step``'s batch on ``device``, the bytes read for it): counted by the reader (data/tokens.py),
    or the formula for tokens held in memory. What the Prefetcher's thread runs."""
    before = getattr(sampler.tokens, "bytes_read", None)
    batch = to_device(sampler.batch(step), device)  # (B/dp, T+1): this rank's rows of the global batch
    return batch, sampler.tokens.bytes_read - before if before is not None else sampler.bytes_per_step()


def next_batch(reads, step: int, trace):
    """(batch, seconds waited) of ``step`` from the Prefetcher ``reads`` of :func:`read_batch`.
    Records two events of kind ``data`` in ``trace``: ``read`` (when the reader thread read the
    batch, and its bytes) and ``wait`` (how long this step waited for it). Sends nothing."""
    got = reads.get(step)
    (batch, nbytes) = got.batch
    if trace.enabled:
        trace.add(Event("read", "data", "pread", nbytes, got.read_start, got.read_end, step,
                        trace.rank, None, "data", reads.reader_thread, "data: this rank's rows of the step's batch"))
        trace.add(Event("wait", "data", "", 0, got.asked, got.got, step, trace.rank, None, "data",
                        threading.get_ident(), "data: the step waited for its batch"))
    return batch, got.wait_s
