"""Regions: which part of a GLOBAL tensor a rank holds, described so that any layout can read it back.

A checkpoint stores pieces of global tensors (the full GPT-2 parameters and their optimizer state),
never a layout's local arrays. Each piece says which part of the global tensor it is with a **box**:
one ``(start, stop)`` per axis, in global coordinates. Every layout's shard is a few boxes:

    tensor parallel, c_fc (3072, 768) on rank 1 of 2      ((1536, 3072), (0, 768))           one box
    tensor parallel, c_proj (768, 3072), row-parallel     ((0, 768), (1536, 3072))           one box
    c_attn (2304, 768) = [q; k; v], heads split           q_r, k_r and v_r rows              three boxes
    wte (256, C) padded to 258 rows on tp=3, rank 2       ((172, 256), (0, C))               padding not stored
    ZeRO: elements lo:hi of a flattened tensor (or of     :func:`flat_boxes` cuts it into at most
          a tp shard's box), cut anywhere                 2 * ndim - 1 boxes, consecutive in C order

Because a ZeRO flat range is turned into boxes when written, the checkpoint format knows only boxes,
and resharding is box intersection: a new layout asks for ITS boxes and the reader copies from every
stored box that overlaps (:mod:`minidist.checkpoint.reader`).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

Box = tuple  # ((start, stop), ...) one pair per axis; () is the box of a 0-d tensor


class Flat(NamedTuple):
    """Elements ``lo:hi`` of ``box``'s C-order flattening (a ZeRO shard's piece of one parameter).
    The piece's array is 1-D, of length ``hi - lo``."""
    box: Box
    lo: int
    hi: int


class Piece(NamedTuple):
    """One part of global tensor ``name`` (GPT-2 name, or ``slot/name`` for optimizer state):
    ``data`` holds ``region`` (a box, or a :class:`Flat` range) of a tensor of ``global_shape``."""
    name: str
    data: object
    global_shape: tuple
    region: object


def box_shape(box: Box) -> tuple:
    """The shape of the array a box holds."""
    return tuple(stop - start for start, stop in box)


def full_box(shape) -> Box:
    """The box covering a whole tensor of ``shape``."""
    return tuple((0, int(n)) for n in shape)


def intersect(a: Box, b: Box) -> Box | None:
    """The box both ``a`` and ``b`` cover, or None when they do not overlap (or it is empty)."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return None if any(start >= stop for start, stop in out) else out


def slices(box: Box, within: Box) -> tuple:
    """Index of ``box`` inside an array that holds the box ``within`` (``box`` must lie in it)."""
    return tuple(slice(start - origin, stop - origin) for (start, stop), (origin, _) in zip(box, within))


def contains(outer: Box, inner: Box) -> bool:
    """Whether ``inner`` lies entirely inside ``outer``."""
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner))


def flat_boxes(box: Box, lo: int, hi: int) -> list:
    """Elements ``lo:hi`` of ``box``'s C-order flattening as boxes, in order: reading each box in C
    order and concatenating gives exactly those elements. At most 2 * ndim - 1 boxes: a partial
    first row, a block of whole rows, a partial last row (recursively along the inner axes).

        flat_boxes(((0, 3), (0, 4)), 2, 11) == [((0, 1), (2, 4)), ((1, 2), (0, 4)), ((2, 3), (0, 3))]
    """
    shape = box_shape(box)
    numel = math.prod(shape)
    if not 0 <= lo <= hi <= numel:
        raise ValueError(f"flat range {lo}:{hi} is outside a box of {numel} elements {box}")
    if lo == hi:
        return []
    if not box:  # a 0-d tensor: its one element
        return [()]
    (start, _), inner_box = box[0], box[1:]
    row = math.prod(shape[1:])  # elements per index of axis 0
    if lo % row:  # a partial first row: recurse into it, then go on from the next row boundary
        first = lo // row
        end = min(hi, (first + 1) * row)
        head = [((start + first, start + first + 1),) + b
                for b in flat_boxes(inner_box, lo - first * row, end - first * row)]
        return head + flat_boxes(box, end, hi)
    first, last = lo // row, hi // row
    out = [((start + first, start + last),) + inner_box] if last > first else []  # whole rows
    if hi % row:  # a partial last row
        out += [((start + last, start + last + 1),) + b for b in flat_boxes(inner_box, 0, hi % row)]
    return out


def coverage_problem(shape, boxes) -> str | None:
    """None when ``boxes`` (each inside a tensor of ``shape``) cover every element of the tensor exactly
    once, else what is wrong: too few or too many elements, or (when the counts add up) the elements no
    box holds and how many are held twice. The counts come first, so the mask (one byte per element)
    is only built for a tensor no larger than what the boxes hold."""
    numel = math.prod(shape)
    held = sum(math.prod(box_shape(box)) for box in boxes)
    if held < numel:
        return f"has only {held} elements in the rank files"
    if held > numel:
        return f"has {held} elements in the rank files for its {numel}: boxes overlap"
    covered, twice = np.zeros(tuple(shape), dtype=bool), 0
    for box in boxes:
        view = covered[slices(box, full_box(shape)) + (Ellipsis,)]  # a view, even of a 0-d tensor
        twice += int(np.count_nonzero(view))
        view[...] = True
    if not twice:
        return None
    first = np.argwhere(~covered)[0].tolist()
    return (f"has boxes that overlap ({twice} elements stored twice) and leave {numel - int(np.count_nonzero(covered))} "
            f"elements in no box, the first at {first}")
