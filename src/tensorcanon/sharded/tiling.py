"""Chunks of a sharded tensor: boxes that tile it, and its bytes in C order across them.

A sharded tensor is stored as *chunks*: hyper-rectangles (``offsets``,
``sizes``) of the global tensor, each stored on its own in C order. Together
they must tile the tensor exactly: every element in exactly one chunk.

The tensor's digest (docs/FORMAT.md §7.1) is a hash of its bytes in the
tensor's own C order, and XXH3 streams do not compose, so computing it means
visiting the chunks in that order. :func:`runs` gives that order as a list of
*runs*, each a contiguous piece of one chunk, without ever assembling the
tensor. A tensor split along dimension 0 (FSDP's layout) gives one run per
chunk; a split along dimension 1 gives one run per row and chunk.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..errors import FormatError


@dataclass(frozen=True)
class Box:
    """One chunk's place in the global tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def strides(self) -> list[int]:
        """C-order strides of the chunk as stored, in elements."""
        out, step = [], 1
        for s in reversed(self.sizes):
            out.append(step)
            step *= s
        return out[::-1]


def _text(box: Box) -> str:
    return f"offsets {list(box.offsets)} sizes {list(box.sizes)}"


def check(shape: Sequence[int], boxes: Sequence[Box], where: str) -> None:
    """Raise :class:`FormatError` unless ``boxes`` tile a tensor of ``shape`` exactly.

    Every box must lie inside the tensor, every element must be covered and the
    volumes must add up to the tensor's (so nothing is covered twice). Empty
    boxes (a rank that holds no rows) are allowed anywhere inside the bounds.
    ``where`` names the tensor in the message.
    """
    ndim = len(shape)
    total = 0
    for box in boxes:
        if len(box.offsets) != ndim or len(box.sizes) != ndim:
            raise FormatError(f"{where}: chunk {_text(box)} has the wrong number of dimensions "
                              f"for a tensor of shape {list(shape)}")
        for o, s, n in zip(box.offsets, box.sizes, shape, strict=True):
            if o < 0 or s < 0 or o + s > n:
                raise FormatError(f"{where}: chunk {_text(box)} lies outside the tensor's shape {list(shape)}")
        total += box.numel
    numel = math.prod(shape)
    if total != numel:
        raise FormatError(
            f"{where}: its chunks hold {total} elements but the tensor of shape {list(shape)} has "
            f"{numel}: chunks overlap or are missing"
        )
    if numel and ndim:  # (a 0-d tensor's one element is covered once: the volumes say so)
        _cover(shape, boxes, 0, [j for j, b in enumerate(boxes) if b.numel], where)


def _intervals(shape: Sequence[int], boxes: Sequence[Box], d: int, cand: list[int],
               where: str) -> Iterator[tuple[int, int, list[int]]]:
    """Split dimension ``d`` at every candidate box edge: ``(a, b, covering boxes)`` per piece."""
    points = sorted({0, shape[d], *(boxes[j].offsets[d] for j in cand),
                     *(boxes[j].offsets[d] + boxes[j].sizes[d] for j in cand)})
    covering: list[list[int]] = [[] for _ in range(len(points) - 1)]
    for j in cand:
        lo, hi = boxes[j].offsets[d], boxes[j].offsets[d] + boxes[j].sizes[d]
        if lo == hi:
            continue
        for k in range(bisect.bisect_left(points, lo), bisect.bisect_left(points, hi)):
            covering[k].append(j)
    for k in range(len(points) - 1):
        a, b = points[k], points[k + 1]
        if not covering[k]:
            raise FormatError(f"{where}: no chunk covers index {a} of dimension {d}: chunks are missing")
        yield a, b, covering[k]


def _spans_rest(box: Box, shape: Sequence[int], d: int) -> bool:
    return all(box.offsets[k] == 0 and box.sizes[k] == shape[k] for k in range(d + 1, len(shape)))


def _cover(shape: Sequence[int], boxes: Sequence[Box], d: int, cand: list[int], where: str) -> None:
    last = d == len(shape) - 1
    for _, _, cov in _intervals(shape, boxes, d, cand, where):
        if len(cov) == 1 and (last or _spans_rest(boxes[cov[0]], shape, d)):
            continue
        if last:
            raise FormatError(f"{where}: chunks {_text(boxes[cov[0]])} and {_text(boxes[cov[1]])} overlap")
        _cover(shape, boxes, d + 1, cov, where)  # the same for every index of the interval


def runs(shape: Sequence[int], boxes: Sequence[Box]) -> Iterator[tuple[int, int, int]]:
    """The tensor's elements in C order as runs ``(box index, first element in the box, count)``.

    Elements are counted in the box's own C order (as it is stored). Adjacent
    runs that continue each other in one box are merged. ``boxes`` must pass
    :func:`check` first.
    """
    if math.prod(shape) == 0:
        return
    if not shape:
        yield (next(j for j, b in enumerate(boxes) if b.numel), 0, 1)
        return
    strides = [b.strides() for b in boxes]
    pending = None
    for run in _runs(shape, boxes, strides, 0, [j for j, b in enumerate(boxes) if b.numel],
                     [0] * len(boxes)):
        if pending is not None and pending[0] == run[0] and pending[1] + pending[2] == run[1]:
            pending = (pending[0], pending[1], pending[2] + run[2])
            continue
        if pending is not None:
            yield pending
        pending = run
    if pending is not None:
        yield pending


def _runs(shape: Sequence[int], boxes: Sequence[Box], strides: list[list[int]], d: int, cand: list[int],
          base: list[int]) -> Iterator[tuple[int, int, int]]:
    last = d == len(shape) - 1
    for a, b, cov in _intervals(shape, boxes, d, cand, "tensor"):
        if len(cov) == 1 and (last or _spans_rest(boxes[cov[0]], shape, d)):
            j = cov[0]
            step = strides[j][d]
            yield (j, base[j] + (a - boxes[j].offsets[d]) * step, (b - a) * step)
            continue
        # Several chunks meet inside this slab: the run pattern of one index of
        # dimension d repeats for every index in [a, b), shifted by each chunk's stride.
        first = list(base)
        for j in cov:
            first[j] = base[j] + (a - boxes[j].offsets[d]) * strides[j][d]
        pattern = list(_runs(shape, boxes, strides, d + 1, cov, first))
        for i in range(b - a):
            for j, start, count in pattern:
                yield (j, start + i * strides[j][d], count)
