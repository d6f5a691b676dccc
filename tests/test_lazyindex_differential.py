"""lazyindex against the full check: what tensorcanon.open proves about one tensor before it checks
the whole file must be what the full check says.

QuickIndex (io/lazyindex.py) finds a tensor's table row in the manifest and its member in the
header by searching their bytes, not by parsing them whole. For every golden, attack and
conformance file and for headers mutated at random:

- where the full check (reader.CheckedFile and the tree: what load checks) accepts the file, every
  answer QuickIndex gives, for a path, a stored name or a key the file lacks, is the full check's:
  the same table index and the same row (dtype, shape, kind, requires_grad, digest, device,
  offsets, memory format). Where it gives none, it defers: the caller checks the whole file.
- where the full check refuses the file, QuickIndex may still answer for one tensor, proving that
  tensor alone (lazyindex.py lists what it proves and what it leaves to the full check). Each such
  answer is checked against independent parses of what it relies on: the header parsed as JSON
  (container.parse_raw, where the header gets that far), the manifest decoded whole (msgpack) and
  its tree's uses (tree.Decoder); and a header length QuickIndex refuses is refused by the full
  check with the same error.
- end to end, tensorcanon.open never returns a tensor but what was saved: for an accepted file,
  the full check's tensor; for a refused one, the full check's error (it deferred), or a tensor
  whose bytes are those of the row QuickIndex proved and hash to its digest, which for a mutated
  golden file whose manifest is unchanged is the golden file's own tensor.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import pathlib
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import tensorcanon
from tensorcanon.format import container, digest, dtypes, fastparse, manifest, paths
from tensorcanon.format.errors import LimitError, TensorCanonError
from tensorcanon.format.limits import DEFAULT, Limits
from tensorcanon.format.manifest import TensorInfo
from tensorcanon.format.tree import Decoder
from tensorcanon.io import lazyindex, reader, source

import hostile_lib as h

ROOT = pathlib.Path(__file__).parent
FILES = sorted([*ROOT.glob("golden/*.safetensors"), *ROOT.glob("golden/v1/*.safetensors"),
                *ROOT.glob("attacks/*.bin"), *ROOT.glob("conformance/*/*.safetensors"),
                *ROOT.glob("conformance/*/*.bin")])
GOLDEN = [p.read_bytes() for p in sorted(ROOT.glob("golden/*.safetensors"))]
ABSENT = ['$["__absent__"]', "__absent__", "$[0]", '$["model"][7]', "$", '$["a"', "model.__absent__"]
KEYS = 256  # keys compared per file at most, spread over all of them (a corpus file has 5,000 tensors)


@dataclass
class Full:
    """The full check's verdict: the checked file and its keys (path, then stored name, as
    LazyFile resolves them), or the error it raised."""

    cf: reader.CheckedFile | None
    keys: dict[str, int]
    error: TensorCanonError | None


def _full(data: bytes, limits: Limits = DEFAULT) -> Full:
    try:
        cf = reader.open_file(data, limits)
        cf.check_tree()
        cf.check_values(verify=False)  # (sparse indices, jagged offsets: open's full check reads them too)
    except TensorCanonError as e:
        return Full(None, {}, e)
    keys: dict[str, int] = {}
    for trail, i in cf.uses():
        keys.setdefault(paths.join(trail), i)
    for row in cf.rows:
        keys.setdefault(row.name, row.index)
    return Full(cf, keys, None)


def _answer(q: lazyindex.QuickIndex, key: Any) -> TensorInfo | None:
    """The row QuickIndex proves for ``key``, or None where it defers to the full check."""
    try:
        i = q.index_of(key)
        return None if i is None else q.info(i)
    except lazyindex.NotQuick:
        return None


@dataclass
class Parts:
    """Independent parses of what QuickIndex relies on; each None where that part does not parse."""

    header: container.Header | None    # the header parsed as JSON, every number checked
    table: tuple | None                # the manifest's table, decoded whole
    uses: dict[str, int] | None        # the tree's tensor uses by path text (first use of each)


def _parts(data: bytes, q: lazyindex.QuickIndex, limits: Limits) -> Parts:
    try:
        header = container.parse_raw(q.prefix, q.raw, len(data), limits)
    except (TensorCanonError, RecursionError):
        header = None
    table = uses = None
    try:
        obj = msgpack.unpackb(q.manifest, **manifest.UNPACK_OPTIONS)
        table = obj["tensors"] if type(obj) is dict and type(obj.get("tensors")) is tuple else None
        if table is not None:
            decoder = Decoder([None] * len(table), limits.max_depth, build_objects=False)
            decoder.uses = []
            decoder.decode(obj["root"])
            uses = {}
            for trail, i in decoder.uses:
                uses.setdefault(paths.join(trail), i)
    except Exception:  # noqa: BLE001 - a part that does not parse is not compared
        pass
    return Parts(header, table, uses)


def _members(raw: bytes) -> list | None:
    """The header's top-level ``(key, value)`` pairs as JSON gives them (repeated keys kept, each
    object a list of pairs), or None where the header is not JSON."""
    try:
        pairs = json.loads(raw, object_pairs_hook=lambda p: p)
    except (ValueError, RecursionError):
        return None
    return pairs if type(pairs) is list else None


def _proven(q: lazyindex.QuickIndex, row: TensorInfo, key: str, data: bytes, parts: Parts, limits: Limits) -> None:
    """Assert what QuickIndex proves about the tensor it answers with, against ``parts``."""
    # the manifest: the one the recorded file digest was computed from
    meta = fastparse.find_metadata(q.raw)
    assert meta is not None and digest.parse_text(meta[manifest.KEY_DIGEST]) == (q.algorithm, q.digest)
    assert digest.manifest_digest(q.manifest, q.algorithm) == q.digest
    # the key: the first use of that path in the tree, or the one row of that name
    trail = lazyindex._parse_path(key) if key.startswith(paths.ROOT + "[") else None
    if trail is not None:
        if parts.uses is not None:
            assert parts.uses.get(key) == row.index, (key, row.index)
    elif parts.table is not None:
        named = [i for i, r in enumerate(parts.table) if type(r) is dict and r.get("name") == key]
        assert named == [row.index], (key, named)
    # the row: decoded alone from the manifest decoded whole, every check of §5.3
    if parts.table is not None:
        alone = manifest.check_row(row.index, parts.table[row.index], q.algorithm)
        assert (alone.index, alone.name, alone.dtype, alone.shape, alone.kind, alone.requires_grad, alone.digest) \
            == (row.index, row.name, row.dtype, row.shape, row.kind, row.requires_grad, row.digest)
    assert row.name != container.META and row.memory_format is None
    devices = manifest.devices_of(meta[manifest.KEY_DEVICES], q.count, str) if manifest.KEY_DEVICES in meta else {}
    assert row.device == devices.get(row.index, "cpu") and not (row.kind == "ndarray" and row.device != "cpu")
    # its header member: the header's own entry for it, within the limits and the file
    shape = dtypes.header_shape(row.dtype, row.shape)
    assert len(shape) <= limits.max_ndim
    assert row.end - row.begin == math.prod(row.shape) * row.dtype.itemsize
    assert q.data_start == container.LENGTH_SIZE + len(q.raw) and q.data_start + row.end <= len(data)
    members = _members(q.raw)
    if members is not None:  # the one member of that name, exactly the row's
        assert [v for k, v in members if k == row.name] \
            == [[("data_offsets", [row.begin, row.end]), ("dtype", row.dtype.st), ("shape", list(shape))]]
    if parts.header is not None:
        assert parts.header.metadata == meta  # the metadata QuickIndex found is the header's
        entry = {e.name: e for e in parts.header.entries}[row.name]
        assert (entry.dtype, entry.shape, entry.begin, entry.end) == (row.dtype.st, shape, row.begin, row.end)


def _bytes(value: Any) -> bytes:
    if isinstance(value, np.ndarray):
        return value.tobytes()
    t = value.detach().cpu()
    same = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.dtype.itemsize)
    t = t if same is None else t.view(same)  # (sub-byte dtypes have no copy kernel)
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _same(a: Any, b: Any) -> bool:
    """The same value: type, dtype, shape, device, requires_grad and bytes."""
    return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
            and getattr(a, "device", None) == getattr(b, "device", None)
            and getattr(a, "requires_grad", None) == getattr(b, "requires_grad", None) and _bytes(a) == _bytes(b))


def _read(cf: reader.CheckedFile, index: int) -> Any:
    """The full check's tensor ``index`` (its bytes hashed), or the exception reading it raised."""
    try:
        return cf.read(index)
    except TensorCanonError as e:
        return e


def _opened(data: bytes, keys: list[str], limits: Limits) -> dict[str, Any]:
    """What tensorcanon.open gives for each key: the value, or the exception it raised."""
    out: dict[str, Any] = {}
    try:
        f = tensorcanon.open(data, limits=limits)
    except TensorCanonError as e:
        return dict.fromkeys(keys, e)
    with f:
        for key in keys:
            try:
                out[key] = f[key]
            except (KeyError, TensorCanonError) as e:
                out[key] = e
    return out


def _agree(data: bytes, golden: bytes | None = None, limits: Limits = DEFAULT) -> str:
    """Compare QuickIndex, tensorcanon.open and the full check on ``data`` (a golden file's
    ``golden`` when it is that file mutated); return what QuickIndex did."""
    full = _full(data, limits)
    try:
        q = lazyindex.QuickIndex(source.Source(data=data), limits)
    except lazyindex.NotQuick:
        q = None
    except TensorCanonError as e:  # the header length: the full check reads it the same way
        assert full.error is not None and type(full.error) is type(e), (e, full.error)
        return "no header"
    keys = set(ABSENT) | set(full.keys)
    parts = None
    if q is not None:
        parts = _parts(data, q, limits)
        if parts.table is not None:
            keys |= {r["name"] for r in parts.table if type(r) is dict and type(r.get("name")) is str}
        keys |= set(parts.uses or ())
    ref = _full(golden) if golden is not None else None
    if ref is not None:
        keys |= set(ref.keys)
    order = sorted(keys - set(ABSENT))
    order = [*order[:: max(1, math.ceil(len(order) / KEYS))], *ABSENT]
    answers = {k: _answer(q, k) for k in order} if q is not None else dict.fromkeys(order)
    for key, row in answers.items():
        if row is None:
            continue  # deferred to the full check
        if full.cf is not None:
            assert key in full.keys, f"QuickIndex found {key!r}, which the file lacks"
            assert row.index == full.keys[key], key
            assert row == full.cf.rows[row.index], (row, full.cf.rows[row.index])
        else:
            assert q is not None and parts is not None
            _proven(q, row, key, data, parts, limits)
    opened = _opened(data, order, limits)
    for key, got in opened.items():
        row = answers[key]
        if full.cf is not None:
            if key in full.keys:
                want = _read(full.cf, full.keys[key])
                if isinstance(want, Exception):  # a tensor's own bytes refused (its digest, bool bytes...)
                    assert type(got) is type(want), (key, got, want)
                else:
                    assert not isinstance(got, Exception), (key, got)
                    assert _same(got, want), key
            else:
                assert isinstance(got, KeyError), (key, got)
        elif isinstance(got, Exception):  # deferred: the full check's refusal
            assert full.error is not None and type(got) is type(full.error), (key, got, full.error)
        else:  # proven alone: the bytes of the row QuickIndex proved, which hash to its digest
            assert row is not None and q is not None, key
            stored = data[q.data_start + row.begin : q.data_start + row.end]
            hasher = digest.tensor_hasher(row.dtype.name, row.shape, q.algorithm)
            hasher.update(stored)
            assert hasher.digest() == row.digest and _bytes(got) == stored, key
            if ref is not None and ref.cf is not None and q.manifest == ref.cf.manifest.raw and key in ref.keys:
                assert _same(got, _read(ref.cf, ref.keys[key])), key  # the golden file's own tensor
    if q is None:
        return "declined"
    return "answered" if any(r is not None for r in answers.values()) else "deferred"


def test_the_corpora_exist():
    assert len(FILES) > 100


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_quickindex_agrees_with_the_full_check_on_every_committed_file(path):
    data = path.read_bytes()
    outcome = _agree(data)
    if path.parent.name in ("golden", "v1", "valid") and path.suffix == ".safetensors":
        meta = fastparse.find_metadata(data[8 : 8 + struct.unpack("<Q", data[:8])[0]]) or {}
        if manifest.claims(meta) and manifest.KEY_MEMORY_FORMATS not in meta:
            # the quick path is taken for every canonical tensorcanon file, and finds every stored name
            full = _full(data)
            assert full.cf is not None, full.error
            q = lazyindex.QuickIndex(source.Source(data=data), DEFAULT)
            assert all(_answer(q, r.name) == r for r in full.cf.rows), path
            assert outcome in ("answered", "deferred") and (outcome == "answered" or not full.cf.rows)


@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.integers(0, len(GOLDEN) - 1), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)),
                                                 min_size=1, max_size=3))
def test_quickindex_agrees_with_the_full_check_on_mutated_headers(i, edits):
    data = bytearray(GOLDEN[i])
    (n,) = struct.unpack("<Q", data[:8])
    for pos, value in edits:
        data[8 + pos % n] = value  # inside the header only: the data section is the golden file's
    _agree(bytes(data), GOLDEN[i])


def _outside_manifest(data: bytes) -> list[int]:
    """Offsets in the header of every byte outside the manifest's base64 text: the tensors' members,
    the ``__metadata__`` keys and the digest and devices text, which QuickIndex searches as bytes."""
    (n,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + n]
    key = b'"' + manifest.KEY_MANIFEST.encode() + b'":"'
    start = header.find(key) + len(key)
    end = header.find(b'"', start)
    return [p for p in range(n) if not start <= p < end]


OUTSIDE = [_outside_manifest(g) for g in GOLDEN]


@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.integers(0, len(GOLDEN) - 1), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)),
                                                 min_size=1, max_size=3))
def test_quickindex_agrees_with_the_full_check_on_mutated_members(i, edits):
    """As above, each edit outside the manifest (which a random edit mostly hits, and which its
    digest then refuses): the bytes QuickIndex searches rather than parses."""
    data = bytearray(GOLDEN[i])
    for pos, value in edits:
        data[8 + OUTSIDE[i][pos % len(OUTSIDE[i])]] = value
    _agree(bytes(data), GOLDEN[i])


# ----------------------------------------------------------------- files made to test one rule each

def _with_members(data: bytes, *texts: str) -> bytes:
    """``data`` with member texts added at the end of its header's JSON object (the header no
    longer canonical, or not valid JSON if they repeat a key)."""
    (n,) = struct.unpack("<Q", data[:8])
    text = data[8 : 8 + n].rstrip(b" ")
    assert text.endswith(b"}")
    text = text[:-1] + b"".join(b"," + t.encode() for t in texts) + b"}"
    return h.with_header_text(text + b" " * (-len(text) % 8), data[8 + n :])


def _with_metadata(data: bytes, **items: str) -> bytes:
    header, body = h.split(data)
    header["__metadata__"] = {**header["__metadata__"], **items}
    return h.with_header(header, body)


def _member(data: bytes, name: str) -> str:
    header, _ = h.split(data)
    return json.dumps({name: header[name]}, separators=(",", ":"))[1:-1]


def _renamed_row(data: bytes, index: int, name: str) -> bytes:
    """``data`` with table row ``index`` named ``name`` (the header as it was), the digest recomputed."""
    m, header, body = h.manifest_of(data)
    m["tensors"][index]["name"] = name
    return h.rebuild(data, h.repack(m), header, body)


def _retyped(data: bytes, name: str, st_from: str, st_to: str) -> bytes:
    header, body = h.split(data)
    assert header[name]["dtype"] == st_from
    header[name]["dtype"] = st_to
    return h.with_header(header, body)


def _in_a_name(data: bytes, name: str) -> bytes:
    """``data`` with the member for ``name`` made part of the key before it (``"z"a":{...}``: not
    JSON), so its text is there but starts no member."""
    (n,) = struct.unpack("<Q", data[:8])
    text = data[8 : 8 + n].rstrip(b" ")
    key = f'"{name}":{{"data_offsets":['.encode()
    assert text.count(key) == 1
    text = text.replace(key, b'"z' + key)
    return h.with_header_text(text + b" " * (-len(text) % 8), data[8 + n :])


@dataclass
class _Wrapped:
    """A registered type: its ``obj`` node is a level of the tree that adds no path component."""

    t: Any


def _wrapped(obj: Any) -> bytes:
    tensorcanon.register(_Wrapped, encode=lambda w: {"t": w.t}, decode=lambda s: _Wrapped(s["t"]),
                         name="tests.LazyWrapped")
    try:
        return tensorcanon.dumps(obj)
    finally:
        tensorcanon.unregister(_Wrapped)


def _crafted() -> list[tuple[str, bytes, Limits]]:
    """``(what, file, limits)``: files that exercise one rule of QuickIndex each."""
    plain = tensorcanon.dumps({"a": torch.ones(2), "b": np.arange(3), "c": torch.zeros(1, dtype=torch.int32)})
    row_of = {r.name: r.index for r in reader.open_file(plain).rows}
    od: Any = collections.OrderedDict([("_metadata", torch.ones(1)), ("w", torch.ones(3))])
    od._metadata = torch.zeros(2)  # its metadata slot: the same path text as the key "_metadata"
    nested = tensorcanon.dumps({"deep": {"er": {"t": torch.ones(2)}}, "flat": torch.zeros(2, 2, 2)})
    wrapped = _wrapped({"o": _Wrapped(torch.ones(2))})  # the tensor node under a dict, an obj, a dict
    return [
        # devices: the row's device is the devices text's; an ndarray given one is refused
        ("devices", _with_metadata(plain, **{manifest.KEY_DEVICES: f"{row_of['a']}:cuda:0"}), DEFAULT),
        ("device of an ndarray", _with_metadata(plain, **{manifest.KEY_DEVICES: f"{row_of['b']}:cuda:0"}), DEFAULT),
        # two rows of one name: a lookup by that name defers
        ("name twice in the table", _renamed_row(plain, row_of["c"], "a"), DEFAULT),
        # a row named __metadata__, with a header member of that name after the real __metadata__
        ("row named __metadata__", _with_members(_renamed_row(plain, row_of["a"], "__metadata__"),
                                                 _member(plain, "a").replace('"a"', '"__metadata__"', 1)), DEFAULT),
        # a member twice (a repeated key), or of another dtype of the same size than the row's
        ("member twice", _with_members(plain, _member(plain, "a")), DEFAULT),
        ("member of another dtype", _retyped(plain, "c", "I32", "F32"), DEFAULT),
        ("member text inside a key", _in_a_name(plain, "a"), DEFAULT),
        # an OrderedDict's metadata slot and its key "_metadata" have one path text: the slot's first
        ("odict slot and key", tensorcanon.dumps({"od": od}), DEFAULT),
        # the limits, per tensor: max_depth (3 dicts above the tensor node), max_ndim (3 dimensions)
        ("within the limits", nested, Limits(max_depth=4, max_ndim=3)),
        ("beyond max_depth", nested, Limits(max_depth=3)),
        ("within max_depth, through an object", wrapped, Limits(max_depth=4)),
        ("beyond max_depth, through an object", wrapped, Limits(max_depth=3)),
        ("beyond max_ndim", nested, Limits(max_ndim=2)),
    ]


CRAFTED = _crafted()


@pytest.mark.parametrize("what, data, limits", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_quickindex_agrees_with_the_full_check_on_files_made_for_one_rule(what, data, limits):
    full = _full(data, limits)
    if what in ("devices", "odict slot and key", "within the limits", "within max_depth, through an object"):
        assert full.cf is not None, full.error  # valid files: every answer must be the full check's
        if what == "devices":
            assert any(r.device == "cuda:0" for r in full.cf.rows)
    else:
        assert full.error is not None
    assert _agree(data, limits=limits) in ("answered", "deferred")
    q = lazyindex.QuickIndex(source.Source(data=data), limits)
    deferred = {"name twice in the table": ["a"], "row named __metadata__": ['$["a"]'], "member twice": ["a", '$["a"]'],
                "member of another dtype": ["c", '$["c"]'], "member text inside a key": ["a", '$["a"]'],
                "odict slot and key": ['$["od"]["_metadata"]'],
                "beyond max_depth": ['$["deep"]["er"]["t"]'], "beyond max_ndim": ['$["flat"]'],
                "beyond max_depth, through an object": ['$["o"]["t"]'],
                "device of an ndarray": ["b", '$["b"]']}.get(what, [])
    for key in deferred:
        assert _answer(q, key) is None, (what, key)
    if what == "within the limits":
        assert _answer(q, '$["deep"]["er"]["t"]') is not None and _answer(q, '$["flat"]') is not None
    if what == "within max_depth, through an object":
        assert _answer(q, '$["o"]["t"]') is not None
    if what.startswith("beyond"):
        with tensorcanon.open(data, limits=limits) as f, pytest.raises(LimitError):
            f[deferred[0]]


def test_a_row_is_immutable_once_checked():
    """Every way a table row is made gives a row nothing can change (manifest.TensorInfo, frozen)."""
    from safetensors.torch import save as save_plain

    data = tensorcanon.dumps({"a": torch.ones(2), "b": [torch.zeros(3)]})
    decoded = manifest.decode(h.split(data)[0]["__metadata__"])
    q = lazyindex.QuickIndex(source.Source(data=data), DEFAULT)
    made = [*reader.open_file(data).rows, *reader.open_file(save_plain({"x": torch.ones(1)})).rows,
            *manifest.read_table(decoded.obj["tensors"], decoded.algorithm, DEFAULT), _answer(q, "a")]
    assert len(made) == 6 and all(type(row) is TensorInfo for row in made)
    for row in made:
        for field, value in [("begin", 0), ("device", "cuda:0"), ("memory_format", "channels_last")]:
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(row, field, value)
