"""The tiling check and C-order runs: against brute force on small cases, and in near-linear time on hostile ones."""

from __future__ import annotations

import itertools
import random
import re

import numpy as np
import pytest

import tensorcanon
from tensorcanon.sharded import tiling
from tensorcanon.sharded.tiling import Box

from support import within

# The old check took 52 s for the staircase at N=4000 and minutes at N=8000; the new one well under a second.
LIMIT_S = 60  # support.within fails a check still running after this: a bound on work, not a timing


def _coverage(shape, boxes):
    """How many boxes hold each element, or None where a box has the wrong rank or leaves the tensor."""
    count = np.zeros(shape, dtype=np.int64)
    for b in boxes:
        if len(b.offsets) != len(shape) or len(b.sizes) != len(shape):
            return None
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(b.offsets, b.sizes, shape, strict=True)):
            return None
        count[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes, strict=True))] += 1
    return count


def _guillotine(rng, offsets, sizes, out):
    """A random tiling of the box by recursive cuts (not a grid: slices are cut independently)."""
    cuttable = [d for d, s in enumerate(sizes) if s >= 2]
    if not cuttable or rng.random() < 0.3:
        out.append(Box(tuple(offsets), tuple(sizes)))
        return
    d = rng.choice(cuttable)
    k = rng.randint(1, sizes[d] - 1)
    _guillotine(rng, offsets, [*sizes[:d], k, *sizes[d + 1:]], out)
    _guillotine(rng, [*offsets[:d], offsets[d] + k, *offsets[d + 1:]], [*sizes[:d], sizes[d] - k, *sizes[d + 1:]], out)


def _pinwheel(shape):
    """A 3x3 pinwheel (no cut crosses the whole tensor) in the last two dimensions, stacked along the others."""
    wheel = [((0, 0), (1, 2)), ((0, 2), (2, 1)), ((2, 1), (1, 2)), ((1, 0), (2, 1)), ((1, 1), (1, 1))]
    lead = shape[:-2]
    return [Box(tuple(0 for _ in lead) + o, tuple(lead) + s) for o, s in wheel]


def _tiling(rng, shape):
    if len(shape) >= 2 and shape[-2:] == (3, 3) and rng.random() < 0.5:
        return _pinwheel(shape)
    boxes = []
    _guillotine(rng, [0] * len(shape), list(shape), boxes)
    return boxes


def _mutate(rng, shape, boxes):
    boxes = list(boxes)
    ndim = len(shape)
    kind = rng.choices(range(7), weights=(1, 1, 4, 1, 1, 4, 1))[0]  # favour same volume: moves and trades
    j = rng.randrange(len(boxes)) if boxes else None
    if kind == 0 and boxes:  # a gap
        boxes.pop(j)
    elif kind == 1 and boxes:  # a box twice
        boxes.append(boxes[j])
    elif kind in (2, 3) and boxes and ndim:  # moved or resized by one: overlap and gap, or out of bounds
        d, delta = rng.randrange(ndim), rng.choice((-1, 1))
        o, s = list(boxes[j].offsets), list(boxes[j].sizes)
        (o if kind == 2 else s)[d] += delta
        boxes[j] = Box(tuple(o), tuple(s))
    elif kind == 4 and ndim:  # an empty box, maybe outside
        d = rng.randrange(ndim)
        boxes.append(Box(tuple(rng.randint(0, n + 1) for n in shape), tuple(0 if k == d else 1 for k in range(ndim))))
    elif kind == 5 and len(boxes) >= 2 and ndim:  # two boxes trade places: same volume, overlap where shapes differ
        i, k = rng.sample(range(len(boxes)), 2)
        boxes[i], boxes[k] = Box(boxes[k].offsets, boxes[i].sizes), Box(boxes[i].offsets, boxes[k].sizes)
    elif kind == 6:  # a box of the wrong rank
        boxes.append(Box((0,) * (ndim + 1), (1,) * (ndim + 1)))
    rng.shuffle(boxes)
    return boxes


def _cases(seed, count):
    rng = random.Random(seed)
    for _ in range(count):
        shape = tuple(rng.choice((0, 1, 2, 3, 3, 4, 5)) for _ in range(rng.choice((0, 1, 1, 2, 2, 2, 3, 3))))
        boxes = _tiling(rng, shape) if rng.random() < 0.9 else []
        if shape and rng.random() < 0.2:  # empty boxes may sit anywhere inside
            boxes.append(Box(tuple(rng.randint(0, n) for n in shape), (0,) * len(shape)))
        rng.shuffle(boxes)
        yield shape, boxes
        for _ in range(3):
            yield shape, _mutate(rng, shape, boxes)


def _check_runs(shape, boxes):
    full = np.arange(int(np.prod(shape, dtype=np.int64))).reshape(shape)
    pieces = [full[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes, strict=True))].reshape(-1)
              for b in boxes]
    runs = list(tiling.runs(shape, boxes))
    got = np.concatenate([pieces[j][start:start + n] for j, start, n in runs]) if runs else np.empty(0, np.int64)
    assert np.array_equal(got, full.reshape(-1)), (shape, boxes, runs)
    for (j1, s1, n1), (j2, s2, _) in itertools.pairwise(runs):
        assert not (j1 == j2 and s1 + n1 == s2)  # adjacent runs of one chunk are merged


_BOX = r"offsets \[([\d, ]*)\] sizes \[([\d, ]*)\]"


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def _holds(offsets, sizes, index):
    return all(o <= i < o + s for o, s, i in zip(offsets, sizes, index, strict=True))


def _check_message(message, shape, count):
    """A refusal of chunks that hold the right number of elements names an element covered 0 or 2+ times."""
    if "chunks overlap or are missing" in message or "outside" in message or "wrong number" in message:
        return
    index = tuple(_ints(re.search(r"at index \[([\d, ]*)\]", message).group(1)))
    assert len(index) == len(shape)
    if "no chunk covers" in message:
        assert count[index] == 0, message
    else:
        m = re.search(f"chunks {_BOX} and {_BOX} overlap", message)
        assert m and count[index] >= 2, message
        assert _holds(_ints(m.group(1)), _ints(m.group(2)), index)
        assert _holds(_ints(m.group(3)), _ints(m.group(4)), index)


@pytest.mark.parametrize("seed", range(4))
def test_check_agrees_with_brute_force(seed):
    seen = {True: 0, False: 0}
    for shape, boxes in _cases(seed, 300):
        count = _coverage(shape, boxes)
        expected = count is not None and bool((count == 1).all())
        seen[expected] += 1
        if expected:
            tiling.check(shape, boxes, "t")
            _check_runs(shape, boxes)
        else:
            with pytest.raises(tensorcanon.FormatError) as info:
                tiling.check(shape, boxes, "t")
            if count is not None:
                _check_message(str(info.value), shape, count)
    assert min(seen.values()) > 100  # both verdicts were exercised


def test_same_volume_but_overlapping_is_located():
    # Right element count, in bounds: only the cover check can tell.
    shape = (4, 4)
    boxes = [Box((0, 0), (2, 4)), Box((1, 0), (2, 4))]  # row 1 twice, row 3 missing
    with pytest.raises(tensorcanon.FormatError, match=r"chunks offsets \[0, 0\] sizes \[2, 4\] and offsets \[1, 0\] "
                                                      r"sizes \[2, 4\] overlap at index \[1, 0\]"):
        tiling.check(shape, boxes, "t")
    boxes = [Box((0, 0), (1, 4)), Box((2, 0), (1, 4)), Box((2, 0), (2, 4))]  # row 1 missing, row 2 twice
    with pytest.raises(tensorcanon.FormatError, match=r"no chunk covers the element at index \[1, 0\]"):
        tiling.check(shape, boxes, "t")


def test_big_shapes_and_offsets():
    big = 2**63 - 1
    shape = (big, 3, big)
    cut = 2**62 + 12345
    boxes = [Box((0, 0, 0), (cut, 3, big)), Box((cut, 0, 0), (big - cut, 2, big)),
             Box((cut, 2, 0), (big - cut, 1, 7)), Box((cut, 2, 7), (big - cut, 1, big - 7))]
    tiling.check(shape, boxes, "t")  # 3 * (2^63 - 1)^2 elements: nothing per element
    runs = list(itertools.islice(tiling.runs(shape, boxes), 4))
    assert runs[0] == (0, 0, cut * 3 * big) and runs[1] == (1, 0, 2 * big) and runs[2] == (2, 0, 7)
    moved = [*boxes[:2], Box((cut - 1, 2, 0), (big - cut, 1, 7)), boxes[3]]  # a row up: the same volume
    with pytest.raises(tensorcanon.FormatError, match=rf"overlap at index \[{cut - 1}, 2, 0\]"):
        tiling.check(shape, moved, "t")


# Hostile layouts: each valid, and each with one chunk moved so that it overlaps another.

def _staircase(n):
    """[2n, n] in 2n chunks: column j cut at row j + 1, so every row of the top half meets all n columns."""
    boxes = []
    for j in range(n):
        boxes += [Box((0, j), (j + 1, 1)), Box((j + 1, j), (2 * n - j - 1, 1))]
    return (2 * n, n), boxes


def _thin_slabs(n):
    """[n, 2]: every row cut in two."""
    return (n, 2), [Box((i, c), (1, 1)) for i in range(n) for c in range(2)]


def _checkerboard(n):
    return (n, n), [Box((i, j), (1, 1)) for i in range(n) for j in range(n)]


def _onion(d):
    """[3]*d in 2d + 1 chunks: the middle element, and two slabs per dimension around what the later ones hold.

    Slab recursion or corner counting take 2^d steps here; the check takes O(n·d) = O(d^2).
    """
    boxes = [Box((1,) * d, (1,) * d)]
    for k in range(d):
        for o in (0, 2):
            boxes.append(Box((1,) * k + (o,) + (0,) * (d - k - 1), (1,) * k + (1,) + (3,) * (d - k - 1)))
    return (3,) * d, boxes


@pytest.mark.parametrize("layout, size", [(_staircase, 8000), (_thin_slabs, 20000), (_checkerboard, 200),
                                          (_onion, 60)])
def test_hostile_layouts_are_checked_in_near_linear_time(layout, size):
    shape, boxes = layout(size)
    within(LIMIT_S, tiling.check, shape, boxes, "t")
    b = boxes[-1]
    d = next(k for k, o in enumerate(b.offsets) if o > 0)  # the last chunk, moved back by one: the same volume
    moved = [*boxes[:-1], Box(tuple(o - (k == d) for k, o in enumerate(b.offsets)), b.sizes)]
    with pytest.raises(tensorcanon.FormatError, match="overlap|no chunk covers") as info:
        within(LIMIT_S, tiling.check, shape, moved, "t")
    assert "at index" in str(info.value)


def _counted_runs(monkeypatch, shape, boxes):
    """The runs, and the work: how many boxes every sweep of one slice of the tensor started with."""
    work = [0]
    sweep = tiling._Walk.runs

    def counted(self, d, first):
        work[0] += len(first)
        return sweep(self, d, first)

    monkeypatch.setattr(tiling._Walk, "runs", counted)
    return within(LIMIT_S, lambda: list(tiling.runs(shape, boxes))), work[0]


@pytest.mark.parametrize("layout, size", [(_staircase, 300), (_thin_slabs, 20000), (_checkerboard, 200),
                                          (_onion, 60)])
def test_runs_do_work_in_proportion_to_their_number(monkeypatch, layout, size):
    shape, boxes = layout(size)
    runs, work = _counted_runs(monkeypatch, shape, boxes)
    # O(d) per run or chunk (the old code also copied an entry per chunk for every slab: O(n) per run)
    assert work <= 2 * len(shape) * (len(boxes) + len(runs))
    if layout is _checkerboard:
        assert runs == [(i, 0, 1) for i in range(len(boxes))]
    if layout is _staircase:
        assert len(runs) == 2 * size * size


def test_long_patterns_are_recomputed_not_kept(monkeypatch):
    n = 3 * tiling._PATTERN_CAP
    shape, boxes = (3, n), [Box((0, j), (3, 1)) for j in range(n)]  # columns: each row meets every chunk
    runs, work = _counted_runs(monkeypatch, shape, boxes)
    assert runs == [(j, i, 1) for i in range(3) for j in range(n)]
    assert work <= 2 * (len(boxes) + len(runs))


@pytest.mark.parametrize("layout, size", [(_staircase, 7), (_thin_slabs, 5), (_checkerboard, 4), (_onion, 4)])
def test_hostile_layouts_small_runs_match(layout, size):
    shape, boxes = layout(size)
    tiling.check(shape, boxes, "t")
    _check_runs(shape, boxes)
