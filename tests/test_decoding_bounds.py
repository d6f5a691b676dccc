"""Decoding takes time and memory linear in the file, whatever the keys and containers in it.

- Hash flooding: Python builds a dict or set in time quadratic in the number of keys with equal
  hashes, and an int's hash is not randomized (``n % (2**61 - 1)``): 100,000 keys that are
  multiples of 2**61 - 1 (1.5 MB) took 4 minutes to load. A container may hold at most
  ``ordering.MAX_SAME_HASH`` keys of one hash (str and bytes, whose hash is random per process,
  not counted); the writer refuses more, the reader rejects them before building the container.
- Memory amplification: msgpack builds a dict for every map before any check, 80 bytes for a
  map of one byte. The manifest has two kinds of map (the top level, the table's rows); any
  other is refused as it is decoded.
- Tensor-table shapes that share one hash, a lazy lookup's search for a name, and the paths
  recorded for every tensor use are bounded the same way.
"""

from __future__ import annotations

import collections
import os
import sys
import tracemalloc

import msgpack
import pytest
import torch

import tensorcanon
from tensorcanon import digest, manifest, reader
from tensorcanon.errors import FormatError, TensorCanonError, UnsupportedTypeError
from tensorcanon.ordering import MAX_SAME_HASH
from tensorcanon.tree import bigint_bytes

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz"))

import hostile_lib as h

P = 2**61 - 1  # Python hashes an int n to n % P (keeping its sign): every multiple of P hashes to 0
DEADLINE = 60  # seconds: generous (shared CI cores); each check takes well under 1 s, quadratic ones took minutes


# ----------------------------------------------------------------------------- hostile files

def _with_root(root: bytes) -> bytes:
    """A file without tensors whose manifest has ``root`` (msgpack bytes) as its tree, its digest matching."""
    p = msgpack.Packer(use_bin_type=True)
    raw = b"".join([p.pack_map_header(5), p.pack("algorithm"), p.pack("xxh3-128"), p.pack("meta"), p.pack(None),
                    p.pack("root"), root, p.pack("tensors"), p.pack([]), p.pack("version"), p.pack(2)])
    return h.rebuild(tensorcanon.dumps({"x": 0}), raw)


def colliding_keys(n: int, tag: str = "dict") -> bytes:
    """A ``dict`` (or ``odict``, ``set``, ``frozenset``, or ``tuple_keys``: a dict of 1-tuples) of
    ``n`` big-int keys that all hash to 0, in canonical order: 1.5 MB for 100,000 keys."""
    keys = [msgpack.ExtType(1, bigint_bytes(k * P)) for k in range(9, 9 + n)]  # > 2**64: ext type 1
    if tag == "tuple_keys":
        keys = [["tuple", k] for k in keys]
    if tag in ("set", "frozenset"):
        node = [tag, *keys]
    else:
        node = ["odict", None] if tag == "odict" else ["dict"]
        for k in keys:
            node += [k, None]
    return _with_root(msgpack.packb(node, use_bin_type=True))


def empty_maps(size: int) -> bytes:
    """A tree that is an array of ``size`` empty maps (one byte each), where no map may be."""
    return _with_root(msgpack.Packer().pack_array_header(size) + b"\x80" * size)


def deep_tensor_uses(depth: int, count: int) -> bytes:
    """A valid file: ``count`` uses of one tensor in a list ``depth`` lists deep (9 bytes each)."""
    p = msgpack.Packer(use_bin_type=True)
    node = p.pack_array_header(count + 1) + p.pack("list") + p.pack(["tensor", 0]) * count
    for _ in range(depth):
        node = b"\x92" + p.pack("list") + node
    name = "w" + ".0" * (depth + 1)
    data = tensorcanon.dumps({name: torch.zeros(2)})
    m, header, body = h.manifest_of(data)
    raw = b"".join([p.pack_map_header(5), p.pack("algorithm"), p.pack(m["algorithm"]), p.pack("meta"), p.pack(None),
                    p.pack("root"), b"\x93" + p.pack("dict") + p.pack("w") + node, p.pack("tensors"),
                    p.pack(m["tensors"]), p.pack("version"), p.pack(m["version"])])
    return h.rebuild(data, raw, header, body)


def _tuple_hash_inverse(target: int, tail: tuple[int, ...]) -> int:
    """The hash a tuple's first int must have for ``(first, *tail)`` to hash like a tuple
    whose state before ``tail`` was ``target`` (CPython's xxHash-based tuple hash, 64-bit)."""
    m, p1, p2, p5 = (1 << 64) - 1, 11400714785074694791, 14029467366897019727, 2870177450012600261
    inv1, inv2 = pow(p1, -1, 1 << 64), pow(p2, -1, 1 << 64)

    def rotr(x: int) -> int:
        return ((x >> 31) | (x << 33)) & m

    acc = target
    for lane in reversed(tail):
        acc = (rotr(acc * inv1 & m) - lane * p2) & m
    return ((rotr(acc * inv1 & m) - p5) * inv2) & m


def _tuple_state(items: tuple[int, ...]) -> int:
    m, p1, p2, p5 = (1 << 64) - 1, 11400714785074694791, 14029467366897019727, 2870177450012600261
    acc = p5
    for lane in items:
        acc = (acc + lane * p2) & m
        acc = (((acc << 31) | (acc >> 33)) & m) * p1 & m
    return acc


def colliding_shapes(n: int) -> bytes:
    """A file of ``n`` empty float32 tensors whose shapes ``(x, a, 0)`` all have one Python hash
    (no data: each has a zero dimension). 2.4 MB for 10,000 tensors."""
    target = _tuple_state((5, 1, 0))
    shapes = [(5, 1, 0)]
    a = 2
    while len(shapes) < n:
        x = _tuple_hash_inverse(target, (a, 0))
        if x < P:  # an int below P hashes to itself
            shapes.append((x, a, 0))
        a += 1
    data = tensorcanon.dumps({f"t{i}": torch.empty(5, i + 1, 0) for i in range(n)})
    m, header, body = h.manifest_of(data)
    for row, shape in zip(m["tensors"], shapes, strict=True):
        row["shape"] = list(shape)
        row["digest"] = digest.Hashers("xxh3-128")("float32", shape).digest()
        header[row["name"]]["shape"] = list(shape)
    return h.rebuild(data, h.repack(m), header, body)


def name_in_every_row(copies: int) -> bytes:
    """A file whose first row's digest holds ``copies`` times the bytes by which a lazy lookup
    finds the row named ``"w"``: each copy sent it to decode that whole row again."""
    data = tensorcanon.dumps({"a": torch.zeros(2), "w": torch.ones(2)})
    m, header, body = h.manifest_of(data)
    m["tensors"][0]["digest"] = (b"\xa4name" + msgpack.packb("w")) * copies
    return h.rebuild(data, h.repack(m), header, body)


# ----------------------------------------------------------------------------- hash flooding

@pytest.mark.parametrize("tag", ["dict", "odict", "set", "frozenset", "tuple_keys"])
def test_colliding_keys_are_refused_in_linear_time(tag, tmp_path):
    data = colliding_keys(20_000, tag)
    path = tmp_path / "flood.safetensors"
    path.write_bytes(data)
    for read in (tensorcanon.loads, tensorcanon.verify, lambda d: tensorcanon.open(path).keys()):
        with h.deadline(DEADLINE), pytest.raises(FormatError, match="share one Python hash") as info:
            read(data)
        assert "at $" in str(info.value) and "docs/FORMAT.md §6.3" in str(info.value)


@pytest.mark.parametrize("tag", ["dict", "odict", "set", "frozenset", "tuple_keys"])
def test_as_many_colliding_keys_as_allowed_load(tag):
    data = colliding_keys(MAX_SAME_HASH, tag)
    value = tensorcanon.loads(data)
    assert tensorcanon.dumps(value) == data  # and the writer writes exactly that


@pytest.mark.parametrize("make", [
    lambda n: {k * P: 0 for k in range(1, n + 1)},
    lambda n: collections.OrderedDict((k * P, 0) for k in range(n, 0, -1)),
    lambda n: {k * P for k in range(1, n + 1)},
    lambda n: frozenset(k * P for k in range(1, n + 1)),
    lambda n: {(k * P, "a"): 0 for k in range(1, n + 1)},
    lambda n: {"opt": [{frozenset({k * P}) for k in range(1, n + 1)}]},
], ids=["dict", "odict", "set", "frozenset", "tuple_keys", "nested"])
def test_writer_refuses_what_the_reader_rejects(make):
    tensorcanon.dumps(make(MAX_SAME_HASH))
    with pytest.raises(UnsupportedTypeError, match=r"more than 64 (keys|members) of this .* share one Python hash"):
        tensorcanon.dumps(make(MAX_SAME_HASH + 1))


def test_writer_refuses_ordered_dict_keys_that_tie():
    # Two NaN keys with the same bits are one canonical key; the reader rejects the repeat.
    od = collections.OrderedDict([(float("nan"), 1), (float("nan"), 2)])
    with pytest.raises(UnsupportedTypeError, match="same canonical position"):
        tensorcanon.dumps(od)


def test_many_int_keys_still_round_trip():
    state = {"state": {i: {"step": float(i), "m": i} for i in range(100_000)},
             "param_groups": [{"lr": 0.1, "params": list(range(100_000))}],
             "ids": set(range(-50_000, 50_000)),
             "mixed": {**{i: i for i in range(1000)}, **{i + 0.5: 0 for i in range(1000)}}}
    assert tensorcanon.loads(tensorcanon.dumps(state)) == state


# ----------------------------------------------------------------------------- memory

def _peak(read) -> tuple[int, BaseException | None]:
    """The peak of memory allocated by Python while ``read()`` runs, and what it raised."""
    tracemalloc.start()
    try:
        with h.deadline(DEADLINE):
            read()
        raised = None
    except TensorCanonError as e:
        raised = e
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, raised


def test_maps_where_none_may_be_are_refused_before_they_are_built(tmp_path):
    data = empty_maps(6_000_000)  # an 8 MB file; its maps took 64 times that before the fix
    path = tmp_path / "maps.safetensors"
    path.write_bytes(data)
    for read in (lambda: tensorcanon.loads(data), lambda: tensorcanon.verify(path),
                 lambda: tensorcanon.load(path, mmap=True), lambda: tensorcanon.open(path).keys()):
        peak, raised = _peak(read)
        assert isinstance(raised, FormatError) and "holds a map" in str(raised), raised
        assert peak < 8 * len(data), f"{peak / len(data):.1f} times the file"


def test_verify_records_no_path_per_tensor_use():
    data = deep_tensor_uses(200, 100_000)  # valid: 1.2 MB; a path per use took 190 times that
    peak, raised = _peak(lambda: tensorcanon.verify(data))
    assert raised is None
    assert peak < 24 * len(data), f"{peak / len(data):.1f} times the file"


# ----------------------------------------------------------------------------- the table, lazy lookups

def test_shapes_that_share_a_hash_are_checked_in_linear_time():
    data = colliding_shapes(10_000)  # 8 s to open before the fix, and 4 times that for twice as many
    with h.deadline(DEADLINE):
        f = reader.open_file(data)
        f.check_tree()
    assert len({r.shape for r in f.rows}) == 10_000 and len({hash(r.shape) for r in f.rows}) == 1
    # what made it quadratic: a dict holding every shape, most of them with one hash
    shapes: dict = {}
    for r in f.rows:
        assert manifest._shared(shapes, r.shape) == r.shape
    assert sum(type(k) is tuple for k in shapes) == MAX_SAME_HASH


def test_lazy_lookup_decodes_each_row_once(tmp_path):
    path = tmp_path / "rows.safetensors"
    path.write_bytes(name_in_every_row(400_000))  # a 2.8 MB row matched 400,000 times: 2 minutes before
    with h.deadline(DEADLINE):
        f = tensorcanon.open(path)
        assert torch.equal(f["w"], torch.ones(2))  # proven by itself; the other row is damaged
        with pytest.raises(FormatError, match="digest must be 16 bytes"):
            f.check()
