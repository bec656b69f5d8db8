"""Every reserved message tag, in one place.

Point-to-point messages match by (peer, tag), so each collective algorithm sends on a tag of its own
and two of them in flight between the same ranks can never take each other's messages::

    tag                   used by                   what it carries
    TAG_REDUCE_SCATTER    ring.reduce_scatter       segments of the chunk being reduced
    TAG_ALL_GATHER        ring.all_gather           segments of the chunk being passed on
    TAG_DOUBLING          doubling.all_reduce       whole-buffer swaps (and the fold-in and fold-out)
    TAG_DOUBLING_GATHER   doubling.all_gather       the growing blocks of the doubling all-gather
    TAG_HALVING           halving.reduce_scatter    the halves being reduced (and the fold-in and -out)
    TAG_BROADCAST         rooted.broadcast          the buffer, parent to child (the barrier's way down)
    TAG_REDUCE            rooted.reduce             partial reductions, child to parent (its way up)
    TAG_GATHER_BYTES      group.gather_bytes        a length (one int64), then the bytes (uint8)
    TAG_FINGERPRINT       fingerprint.check_*       7-int64 call descriptions, before every collective
    TAG_CENSUS            census.take               (seq, collective) after a collective timed out
    TAG_ALL_TO_ALL        alltoall.all_to_all       one chunk to each peer, from each peer
    TAG_ALL_TO_ALL_COUNTS alltoall.exchange_counts  the counts before the chunks: (sent, expected), 2 int64

So ``all_reduce`` sends on the ring's two tags, on ``TAG_DOUBLING``, or on ``TAG_HALVING`` then
``TAG_DOUBLING_GATHER`` (Rabenseifner's), and ``barrier`` on ``TAG_REDUCE`` then
``TAG_BROADCAST``. Backends "mpi" and "nccl" run their collectives without these tags, but the
fingerprint and census messages go over the transport on theirs whatever the backend.

All of them are at or above :data:`COLLECTIVE_TAG_BASE`, and a user's point-to-point tag must stay
below it (``ProcessGroup.send`` and friends refuse others): otherwise a user's ``send`` could be
received by a collective's ``recv`` from the same peer, or the other way round, and both would
finish with the wrong data. MPI guarantees tags up to at least 32767, so all fit.
"""

COLLECTIVE_TAG_BASE = 32000
"""Tags at or above this belong to collectives; user point-to-point tags stay below it, so a
user's message can never match a collective's (MPI guarantees tags up to at least 32767)."""

TAG_REDUCE_SCATTER = COLLECTIVE_TAG_BASE + 1  # ring.reduce_scatter
TAG_ALL_GATHER = COLLECTIVE_TAG_BASE + 2      # ring.all_gather
TAG_DOUBLING = COLLECTIVE_TAG_BASE + 3        # doubling.all_reduce
TAG_BROADCAST = COLLECTIVE_TAG_BASE + 4       # rooted.broadcast
TAG_REDUCE = COLLECTIVE_TAG_BASE + 5          # rooted.reduce
TAG_GATHER_BYTES = COLLECTIVE_TAG_BASE + 6    # ProcessGroup.gather_bytes
TAG_FINGERPRINT = COLLECTIVE_TAG_BASE + 7     # fingerprint.check_neighbours, before every collective
TAG_CENSUS = COLLECTIVE_TAG_BASE + 8          # census.take, after a collective timed out
TAG_ALL_TO_ALL = COLLECTIVE_TAG_BASE + 9      # alltoall.all_to_all
TAG_ALL_TO_ALL_COUNTS = COLLECTIVE_TAG_BASE + 10  # alltoall.exchange_counts, before the chunks
TAG_HALVING = COLLECTIVE_TAG_BASE + 11       # halving.reduce_scatter and halving.all_reduce's fold
TAG_DOUBLING_GATHER = COLLECTIVE_TAG_BASE + 12  # doubling.all_gather
