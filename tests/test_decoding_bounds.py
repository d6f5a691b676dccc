"""Decoding takes time and memory linear in the file, whatever the keys and containers in it.

- Hash flooding: Python builds a dict or set in time quadratic in the number of keys with equal
  hashes, and an int's hash is not randomized (``n % (2**61 - 1)``): 100,000 keys that are
  multiples of 2**61 - 1 (1.5 MB) took 4 minutes to load. A container may hold at most
  ``ordering.MAX_SAME_HASH`` keys of one hash (str and bytes, whose hash is random per process,
  not counted); the writer refuses more, the reader rejects them before building the container.
- Memory amplification: msgpack builds a dict for every map before any check, 80 bytes for a
  map of one byte. The manifest has two kinds of map (the top level, the table's rows); any
  other is refused as it is decoded.
- Tensor-table shapes that share one hash (in the table and in the tensor hashers' cache), a lazy
  lookup's search for a name, and the paths recorded for every tensor use are bounded the same way.
- Tensor names: many paths with one base name (keys ``1`` and ``"1"`` at every level) took
  quadratic time to name, saving and loading alike.
- Shapes with no elements but non-zero dimensions whose product times the element size reaches
  2**63 have no tensor (docs/FORMAT.md §5.3): torch's own errors came out of ``loads``.
- Refusals that touch nothing: an object that raises on any attribute access, a key that is not
  valid UTF-8.
"""

from __future__ import annotations

import collections
import random
import struct
import tracemalloc

import msgpack
import pytest
import torch

import tensorcanon
from tensorcanon.format import container, digest, fastparse, manifest, names
from tensorcanon.format.errors import FormatError, IntegrityError, TensorCanonError, UnsupportedTypeError
from tensorcanon.format.ordering import MAX_SAME_HASH
from tensorcanon.io import reader

import hostile_lib as h
from hostile_lib import P, colliding_keys, colliding_shapes, empty_maps

DEADLINE = 60  # seconds: generous (shared CI cores); each check takes well under 1 s, quadratic ones took minutes


# ----------------------------------------------------------------- hostile files (the builders are in hostile_lib)

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
        # (the header's copies: its bytes, the base64 text, the decoded manifest: 4.8x on Python 3.11
        # with msgpack 1.2.4, 9.8x on the floors, Python 3.10 with msgpack 1.2.0; 64x before the fix;
        # since issue 38, telling a damaged file from a malformed one checks the digest of the
        # manifest's bytes once more, after the failed decoding is freed: 10.8x to 12.3x on the floors)
        assert peak < 13 * len(data), f"{peak / len(data):.1f} times the file"


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


def test_tensor_hashers_cache_at_most_max_same_hash_keys_of_one_hash(tmp_path):
    """digest.Hashers caches each (dtype, shape) prefix: keys of one hash beyond MAX_SAME_HASH are
    hashed without being cached, so 20,000 shapes of one hash cost linear time (verify of 10,000
    took 6 s before, 20,000 took 39 s; both under 1 s now)."""
    shapes = h.colliding_shape_list(20_000)
    hashers = digest.Hashers("xxh3-128")
    for s in shapes + shapes[:100]:  # (the first ones a second time: cached, or built again)
        assert hashers("float32", s).digest() == digest.tensor_hasher("float32", s).digest()
        per_hash = collections.Counter(hash(k) for k in hashers._prefixes)
        assert per_hash.most_common(1)[0][1] <= MAX_SAME_HASH
    assert len(hashers._prefixes) == MAX_SAME_HASH and len({hash(k) for k in hashers._prefixes}) == 1
    data = colliding_shapes(20_000, damaged=True)
    path = tmp_path / "shapes.safetensors"
    path.write_bytes(data)
    for read in (lambda: tensorcanon.verify(data), lambda: tensorcanon.loads(data),
                 lambda: tensorcanon.load(path, mmap=True)):
        with h.deadline(DEADLINE), pytest.raises(IntegrityError, match="does not match its digest"):
            read()


# ----------------------------------------------------------------------------- tensor names

def reference_tensor_names(first_paths: list[tuple], version: int = 2) -> list[str]:
    """names.tensor_names as it was before issue 19 (quadratic in paths of one base name): the
    reference the linear one must equal."""
    used: set[str] = {names.RESERVED}
    out = []
    for path in first_paths:
        base = names.base_name(path, version)
        name, n = base, 0
        while name in used:
            n += 1
            name = f"{base}~{n}"
        used.add(name)
        out.append(name)
    return out


def _colliding_paths(depth: int) -> list[tuple]:
    """Every path of ``depth`` components, each the key ``1`` or ``"1"``: one base name for all."""
    paths: list[tuple] = [()]
    for _ in range(depth):
        paths = [p + (k,) for p in paths for k in (1, "1")]
    return paths


def test_tensor_names_are_those_of_the_reference():
    rng = random.Random(19)
    atoms = ["a", "b", "a~1", "a~2", "b~1", "a.b", "", "_", "__metadata__", "1", 1, 2, "~1", "1~1", "x~10"]
    cases = 0
    for _ in range(3000):
        paths = [tuple(rng.choice(atoms) for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(0, 30))]
        for version in (1, 2):
            assert names.tensor_names(paths, version) == reference_tensor_names(paths, version), paths
            cases += 1
    for depth in range(1, 11):  # colliding bases: 2 to 1,024 paths of one base name
        paths = _colliding_paths(depth)
        rng.shuffle(paths)
        paths += [("1",) * depth + (f"~{i}",) for i in range(0, 50, 3)]  # names that look like suffixes
        assert names.tensor_names(paths) == reference_tensor_names(paths)
        cases += 1
    assert cases > 6000


def test_tensor_names_are_linear_in_paths_of_one_base_name():
    paths = _colliding_paths(14)  # 16,384 paths of one base name: 32 s before, 0.1 s now
    with h.deadline(DEADLINE):
        out = names.tensor_names(paths)
    assert out[0] == ".".join(["1"] * 14) and out[-1] == out[0] + "~16383" and len(set(out)) == len(out)


def test_saving_and_loading_tensors_of_one_base_name_is_linear():
    value: dict = {}
    for path in _colliding_paths(14):  # {1: {1: ...}, "1": {...}}: 16,384 empty tensors, 14 levels deep
        node = value
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = torch.empty(0)
    with h.deadline(DEADLINE):
        data = tensorcanon.dumps(value)
        back = tensorcanon.loads(data)
    assert back[1]["1"][1] is not None and len(h.manifest_of(data)[0]["tensors"]) == 16_384


# ----------------------------------------------------------------------------- shapes too large for any tensor

TOO_LARGE = [([2**60, 11, 0], torch.float32), ([2**62, 4, 0], torch.float32), ([0, 2**63], torch.uint8),
             ([2**64 - 1, 0], torch.bool), ([2**59, 0, 1], torch.complex128), ([2**61, 0, 2**2], torch.bfloat16),
             ([2**62, 0, 2], torch.float8_e4m3fn if hasattr(torch, "float8_e4m3fn") else torch.int16),
             ([2**61, 0, 2], torch.complex32)]
LARGEST = [([2**63 - 1, 0], torch.uint8), ([0, 2**61 - 1], torch.float32), ([2**59 - 1, 0, 1], torch.complex128),
           ([2**60, 0, 3], torch.int16), ([2**61 - 1, 0], torch.complex32)]


@pytest.mark.parametrize("shape, dtype", TOO_LARGE, ids=lambda x: str(x))
def test_shapes_too_large_for_any_tensor_are_rejected_by_every_reader(shape, dtype, tmp_path):
    """docs/FORMAT.md §5.3: a shape whose non-zero dimensions times the element size reach 2**63
    has no tensor (torch raised its own RuntimeError or TypeError from loads)."""
    data = h.with_shape(shape, dtype)
    path = tmp_path / "shape.safetensors"
    path.write_bytes(data)
    reads = [lambda: tensorcanon.loads(data), lambda: tensorcanon.verify(data),
             lambda: tensorcanon.load(h.Stream(data)), lambda: tensorcanon.load(path, mmap=True),
             lambda: tensorcanon.read_metadata(data), lambda: tensorcanon.open(path)["t"],
             lambda: tensorcanon.open(path).check()]
    for read in reads:
        with pytest.raises(FormatError, match=r"tensor 't' has shape .* reach 2\^63 or more"):
            read()
    assert h.check(data) == "FormatError"
    # the table row alone (as lazy lookups and sharded indexes read it), and a plain safetensors file
    header, body = h.split(data)
    decoded = manifest.decode(header["__metadata__"])
    with pytest.raises(FormatError, match=r"manifest: tensor 't' has shape .* reach 2\^63"):
        manifest.read_table(decoded.obj["tensors"], decoded.algorithm, tensorcanon.Limits())
    del header["__metadata__"]
    with pytest.raises(FormatError, match=r"header: tensor 't' has shape .* reach 2\^63"):
        tensorcanon.loads(h.with_header(header, body))


@pytest.mark.parametrize("shape, dtype", LARGEST, ids=lambda x: str(x))
def test_the_largest_allowed_shapes_load_and_save_again(shape, dtype):
    data = h.with_shape(shape, dtype)
    assert h.check(data) == "ok"  # every reader, and dumps of what loads gives the same bytes
    assert tensorcanon.dumps({"t": torch.empty(shape, dtype=dtype)}) == data


@pytest.mark.parametrize("shape, dtype", TOO_LARGE + LARGEST, ids=lambda x: str(x))
def test_the_fast_header_parse_agrees_with_the_full_one_on_shape_sizes(shape, dtype):
    """fastparse (the one-pass check of a canonical header) must accept exactly what the full
    parse accepts: here it declines (None), and the full parse gives the verdict."""
    data = h.with_shape(shape, dtype)
    (n,) = struct.unpack("<Q", data[:8])
    prefix, raw, limits = data[:8], data[8 : 8 + n], tensorcanon.Limits()
    fast = fastparse.parse(prefix, raw, len(data), limits)
    try:
        header = container.parse_raw(prefix, raw, len(data), limits)
        full = manifest.parse(header, limits)
    except FormatError:
        assert fast is None and (shape, dtype) in TOO_LARGE
    else:
        assert fast is not None and (shape, dtype) in LARGEST
        assert fast[1].raw == full.raw and [i.shape for i in fast[1].tensors] == [i.shape for i in full.tensors]


def test_the_writer_refuses_shapes_too_large_for_any_tensor():
    with pytest.raises(UnsupportedTypeError, match=r"reach 2\^63 or more.*\(at \$\[\"w\"\]\)"):
        tensorcanon.dumps({"w": torch.empty(2**60, 11, 0)})  # torch makes it; numpy could not
    tensorcanon.dumps({"w": torch.empty(2**61 - 1, 0)})


# ----------------------------------------------------------------------------- refusals that touch nothing

class _Untouchable:
    """An object that raises on any attribute access, ``__class__`` included (a proxy, a ShardedTensor)."""

    def __getattribute__(self, name):
        raise RuntimeError(f"do not touch {name}")


def test_an_object_that_raises_when_touched_is_refused_naming_its_path():
    with pytest.raises(UnsupportedTypeError, match=r"_Untouchable .*touching it raised") as info:
        tensorcanon.dumps({"a": _Untouchable()})
    assert info.value.path == '$["a"]' and '(at $["a"])' in str(info.value)


@pytest.mark.parametrize("value", [{"\ud800": 1, 2: 3}, {("\udfff",), 1}, {frozenset({"a\ud800"}): 0, 0: 1}])
def test_a_key_with_a_lone_surrogate_is_refused_in_the_formats_words(value):
    with pytest.raises(UnsupportedTypeError, match="a key or set member holds a str with a lone surrogate, "
                                                   r"which is not valid UTF-8 \(docs/FORMAT.md §6.1\)"):
        tensorcanon.dumps(value)


# ---------------------------------------------------------------- seed sequences (FORMAT.md §6.7)


def _generator(entropy):
    import numpy as np

    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


def test_the_writer_refuses_seed_sequence_entropy_past_4096_words():
    """numpy turns entropy ints into 32-bit words in time quadratic in their size (a 1.6-million-bit
    int took 18 s to load): 4,096 words are accepted and round-trip, 4,097 are refused."""
    at_bound = (1 << (32 * 4096)) - 1
    back = tensorcanon.loads(tensorcanon.dumps({"g": _generator(at_bound)}))["g"]
    bg = back.bit_generator
    seed_seq = bg.seed_seq if hasattr(bg, "seed_seq") else bg._seed_seq  # (public from numpy 1.25)
    assert seed_seq.entropy == at_bound
    with pytest.raises(UnsupportedTypeError, match="4096 32-bit words"):
        tensorcanon.dumps({"g": _generator(at_bound + 1)})


def test_the_reader_rejects_seed_sequence_entropy_past_4096_words():
    """The same value written by hand: the reader's check (shared with the writer) refuses it before
    numpy sees it."""
    from tensorcanon.format.tree import bigint_bytes

    marker = 0x5EED_5EED_5EED
    data = tensorcanon.dumps({"g": _generator(marker)})
    m, _, _ = h.manifest_of(data)
    huge = msgpack.ExtType(1, bigint_bytes(1 << (32 * 4096)))

    def swap(node):
        if node == marker and type(node) is int:
            return huge
        if isinstance(node, list):
            return [swap(x) for x in node]
        if isinstance(node, dict):
            return {k: swap(v) for k, v in node.items()}
        return node

    forged = h.rebuild(data, h.repack(swap(m)))
    with pytest.raises(FormatError, match="4096 32-bit words"):
        tensorcanon.loads(forged)


def test_none_does_not_count_toward_the_hash_bound():
    """None's hash is a constant from Python 3.12 and an address before: counting it would make a
    verdict depend on the Python version."""
    from tensorcanon.format.ordering import NO_KEY, crowded

    class Same:
        def __hash__(self):
            return hash(None)

    keys = [Same() for _ in range(MAX_SAME_HASH)]
    assert crowded([*keys, None]) is NO_KEY
    assert crowded([*keys, Same()]) is not NO_KEY
