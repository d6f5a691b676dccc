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

The chunk list comes from a file, so both functions take time near-linear in
the number of chunks whatever their layout: :func:`check` in O(n·d·log n) for
n chunks in d dimensions, :func:`runs` in O(n·log n) plus O(d·log n) per run.
"""

from __future__ import annotations

import itertools
import math
import secrets
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NoReturn

from ..format.errors import FormatError

# The modulus of check()'s polynomial identity test: the Mersenne prime 2^127 - 1.
_P = (1 << 127) - 1
# The most runs of one index that runs() keeps to replay for the next indices (it recomputes longer ones).
_PATTERN_CAP = 4096

Run = tuple[int, int, int]


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

    How coverage is checked: each dimension is cut at the tensor's and every
    box's two ends, so that which boxes hold an element depends only on its
    *cell* of that grid. With a variable ``z[d]`` per dimension, the cells of a
    box spanning cuts ``lo[d]`` to ``hi[d]`` are the monomials of
    ``prod((z[d]**hi[d] - z[d]**lo[d]) / (z[d] - 1))``, so the boxes tile the
    tensor exactly when ``sum over boxes of prod(z[d]**hi[d] - z[d]**lo[d])``
    equals ``prod(z[d]**m[d] - 1)`` (``m[d]`` cells per dimension) as
    polynomials. Both sides are evaluated at a secret random point modulo the
    prime ``2**127 - 1``: a tiling always passes, and anything else passes with
    probability at most (degree) / modulus <= 64 * (2n + 1) / 2**127
    (Schwartz-Zippel); the point is drawn per call from :mod:`secrets`, so no
    input can be made to pass. This takes O(n·d·log n) for
    any layout: an exact check of disjointness by sweeps or slab recursion is
    exponential in d for some layouts (2d + 1 chunks, one in the middle and two
    slabs per dimension around it). A failure is then located exactly
    (:func:`_locate`) and named with an element's index.
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
    if not numel or not ndim:  # (a 0-d tensor's one element is covered once: the volumes say so)
        return
    live = [b for b in boxes if b.numel]
    cuts, lows, highs = _grid(shape, live)
    factors, whole = _factors(cuts, lows, highs)
    products = [1] * len(live)
    for f in factors:
        products = [x * y % _P for x, y in zip(products, f, strict=True)]
    if (sum(products) - math.prod(whole)) % _P:
        _locate(live, cuts, lows, highs, factors, whole, where)


def _grid(shape: Sequence[int], boxes: Sequence[Box]) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Per dimension: the sorted cuts (the tensor's and every box's ends), and each box's ends' ranks among them."""
    cuts, lows, highs = [], [], []
    for d, n in enumerate(shape):
        lo = [b.offsets[d] for b in boxes]
        hi = [o + b.sizes[d] for o, b in zip(lo, boxes, strict=True)]
        points = sorted({0, n, *lo, *hi})
        rank = {p: i for i, p in enumerate(points)}
        cuts.append(points)
        lows.append([rank[o] for o in lo])
        highs.append([rank[o] for o in hi])
    return cuts, lows, highs


def _factors(cuts: list[list[int]], lows: list[list[int]], highs: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Per dimension, each box's factor ``z**hi - z**lo`` and the tensor's ``z**m - 1``, for a secret random ``z``."""
    factors, whole = [], []
    for points, lo, hi in zip(cuts, lows, highs, strict=True):
        z, power = secrets.randbelow(_P), [1]
        for _ in range(len(points) - 1):
            power.append(power[-1] * z % _P)
        factors.append([power[h] - power[o] for o, h in zip(lo, hi, strict=True)])
        whole.append(power[-1] - 1)
    return factors, whole


def _suffixes(factors: list[list[int]], stop: int) -> list[list[int]]:
    """``out[d - stop][j]``: the product of box ``j``'s factors of dimensions ``>= d``, for ``d >= stop``."""
    out = [[1] * len(factors[0])]
    for f in reversed(factors[stop:]):
        out.append([x * y % _P for x, y in zip(out[-1], f, strict=True)])
    return out[::-1]


def _locate(boxes: Sequence[Box], cuts: list[list[int]], lows: list[list[int]], highs: list[list[int]],
            factors: list[list[int]], whole: list[int], where: str) -> NoReturn:
    """Raise the error for one cell covered by no box or by two: the boxes' sum differs from the tensor's.

    Dimension by dimension, the difference (boxes holding the cell's indices
    chosen so far, less the tensor) is nonzero at some index of the next
    dimension: its value at the cells of index ``t`` is the prefix sum, up to
    ``t``, of the steps at each cut (boxes opening there less boxes closing
    there, each weighted by the product of its factors of the later
    dimensions). The first index whose prefix sum is nonzero is chosen, and so
    on down to one cell, where the count of boxes that hold it is exact.
    O(n·d·log n).
    """
    later = _suffixes(factors, 1)
    tail = [math.prod(whole[d:]) % _P for d in range(1, len(whole) + 1)]
    inside = list(range(len(boxes)))
    cell = []
    for d, points in enumerate(cuts):
        step: defaultdict[int, int] = defaultdict(int, {0: -tail[d], len(points) - 1: tail[d]})
        for j in inside:
            step[lows[d][j]] += later[d][j]
            step[highs[d][j]] -= later[d][j]
        t = _first_nonzero_prefix(step)
        inside = [j for j in inside if lows[d][j] <= t < highs[d][j]]
        cell.append(t)
    index = [cuts[d][t] for d, t in enumerate(cell)]
    if not inside:
        raise FormatError(f"{where}: no chunk covers the element at index {index}: chunks are missing "
                          "(and so others overlap)")
    raise FormatError(f"{where}: chunks {_text(boxes[inside[0]])} and {_text(boxes[inside[1]])} overlap "
                      f"at index {index}")


def _first_nonzero_prefix(step: dict[int, int]) -> int:
    total = 0
    for t in sorted(step):
        total += step[t]
        if total % _P:
            return t
    raise AssertionError("tiling: a nonzero difference has no nonzero cell")  # (the algebra rules it out)


def runs(shape: Sequence[int], boxes: Sequence[Box]) -> Iterator[Run]:
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
    walk = _Walk(boxes, len(shape))
    pending = None
    for run in walk.runs(0, {j: 0 for j, b in enumerate(boxes) if b.numel}):
        if pending is not None and pending[0] == run[0] and pending[1] + pending[2] == run[1]:
            pending = (pending[0], pending[1], pending[2] + run[2])
            continue
        if pending is not None:
            yield pending
        pending = run
    if pending is not None:
        yield pending


class _Walk:
    """The C-order walk over boxes that tile a tensor of ``ndim`` dimensions."""

    def __init__(self, boxes: Sequence[Box], ndim: int) -> None:
        self.boxes = boxes
        self.strides = [b.strides() for b in boxes]
        self.ndim = ndim

    def runs(self, d: int, first: dict[int, int]) -> Iterator[Run]:
        """The runs of one index of dimensions ``< d``, across the boxes of ``first``, which tile the rest.

        ``first[j]`` is box ``j``'s element at that index and at its own lowest
        index of dimensions ``>= d``. A sweep along dimension ``d`` keeps the
        set of boxes open between consecutive ends: O(log n) per end, and O(k)
        for a slice where k >= 2 boxes meet, which then yield at least k runs.
        """
        boxes, strides = self.boxes, self.strides
        order = sorted(first, key=lambda j: boxes[j].offsets[d])
        end = 0
        for j in order:  # the common case, and always the last dimension: each box alone in its slice
            if boxes[j].offsets[d] != end:
                break
            end += boxes[j].sizes[d]
        else:
            for j in order:
                yield j, first[j], boxes[j].sizes[d] * strides[j][d]
            return
        opening: defaultdict[int, list[int]] = defaultdict(list)
        closing: defaultdict[int, list[int]] = defaultdict(list)
        for j in first:
            opening[boxes[j].offsets[d]].append(j)
            closing[boxes[j].offsets[d] + boxes[j].sizes[d]].append(j)
        open_: dict[int, None] = {}
        for a, b in itertools.pairwise(sorted(opening.keys() | closing.keys())):
            for j in closing.get(a, ()):
                del open_[j]
            open_.update(dict.fromkeys(opening.get(a, ())))
            at = {j: first[j] + (a - boxes[j].offsets[d]) * strides[j][d] for j in open_}
            if len(at) == 1:
                ((j, start),) = at.items()
                yield j, start, (b - a) * strides[j][d]
            elif not at or d == self.ndim - 1:
                raise FormatError(f"tensor: its chunks do not tile index {a} of dimension {d}")  # (check() first)
            else:
                yield from self.slab(d, at, b - a)

    def slab(self, d: int, at: dict[int, int], count: int) -> Iterator[Run]:
        """The runs of ``count`` consecutive indices of dimension ``d`` where the boxes of ``at`` meet.

        Each index repeats the runs of the first, each box's shifted by its
        stride: they are replayed, or computed again where too many to keep.
        """
        strides = self.strides
        if count == 1:
            yield from self.runs(d + 1, at)
            return
        pattern: list[Run] | None = []
        for run in self.runs(d + 1, at):
            if pattern is not None:
                pattern.append(run)
                if len(pattern) > _PATTERN_CAP:
                    pattern = None
            yield run
        for i in range(1, count):
            if pattern is None:
                yield from self.runs(d + 1, {j: s + i * strides[j][d] for j, s in at.items()})
            else:
                for j, start, n in pattern:
                    yield j, start + i * strides[j][d], n
