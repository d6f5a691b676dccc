"""The manifest: everything in a file that is not tensor bytes.

It is one canonical msgpack map, base64-encoded into the header's
``__metadata__["tensorcanon.manifest"]``::

    {"algorithm": "xxh3-128", "meta": <tree>, "root": <tree>,
     "tensors": [<entry>, ...], "version": 1}

``"algorithm"`` is ``"xxh3-128"`` (the default) or ``"sha256"``; it fixes the
size of every tensor digest and the algorithm of the recorded file digest.

Each entry is ``{"digest", "dtype", "kind", "name", "requires_grad", "shape"}``
(keys in that order). Readers accept only the canonical encoding: the bytes are
decoded, packed again, and must come out identical.

Devices are placement, not content: they live outside the manifest, in
``__metadata__["tensorcanon.devices"]`` (present only when some tensor is not on
the CPU), so the same values on cpu and on cuda:0 have the same file digest.
"""

from __future__ import annotations

import base64
import binascii
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import msgpack
import torch

from . import container, digest, dtypes
from .errors import FormatError, IntegrityError, LimitError
from .limits import Limits

VERSION = 1
KEY_MANIFEST = "tensorcanon.manifest"
KEY_DIGEST = "tensorcanon.digest"
KEY_FORMAT = "format"
KINDS = ("tensor", "parameter", "ndarray")
_TOP_KEYS = ["algorithm", "meta", "root", "tensors", "version"]
_ENTRY_KEYS = ["digest", "dtype", "kind", "name", "requires_grad", "shape"]
KEY_DEVICES = "tensorcanon.devices"
_DEFAULT_ALGORITHM = digest.DEFAULT  # (inside Manifest, the name ``digest`` is a field)
_BY_NAME = dtypes.BY_NAME


@dataclass(slots=True)
class TensorInfo:
    """One row of the tensor table, validated and matched to its header entry."""

    index: int
    name: str
    dtype: dtypes.DType
    shape: tuple[int, ...]
    kind: str
    requires_grad: bool
    digest: bytes
    device: str = "cpu"
    begin: int = 0
    end: int = 0

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class Manifest:
    raw: bytes
    root: Any
    meta: Any
    tensors: list[TensorInfo]   # table order (indices used by the tree)
    digest: bytes
    algorithm: str = _DEFAULT_ALGORITHM

    def text(self, raw: bytes | None = None) -> str:
        """A digest of this file (the file digest if ``raw`` is None) as text."""
        return digest.to_text(self.digest if raw is None else raw, self.algorithm)


def pack(root: Any, meta: Any, table: list[dict], algorithm: str = digest.DEFAULT) -> bytes:
    """Canonical manifest bytes. ``table`` rows must already have sorted keys."""
    obj = {"algorithm": digest.check(algorithm), "meta": meta, "root": root, "tensors": table, "version": VERSION}
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (ValueError, TypeError, OverflowError) as e:  # depth beyond msgpack's own limit
        raise LimitError(
            f"the object cannot be encoded as msgpack ({e}); it is nested deeper than msgpack allows",
            limit="max_depth", path="$", hint="keep limits.max_depth at or below 256",
        ) from e


class Packed:
    """A manifest packed once, whose tensor digests can be filled in later without packing again.

    ``bytes(digests)`` gives exactly ``pack(root, meta, rows, algorithm)`` for
    the rows with those digests: msgpack encodes a map or an array as its
    header followed by its items, so the manifest is a fixed head, each row
    (a fixed start, the digest, the rest of the row) and a fixed tail. Each
    row is kept as bytes, not as a dict: saving many tensors leaves the
    garbage collector fewer objects to track.
    """

    def __init__(self, root: Any, meta: Any, rows: list[tuple], algorithm: str = digest.DEFAULT) -> None:
        size = digest.size(algorithm)
        zero = bytes(size)
        packer = msgpack.Packer(use_bin_type=True)
        try:
            self._head = b"".join([
                packer.pack_map_header(len(_TOP_KEYS)), packer.pack("algorithm"), packer.pack(algorithm),
                packer.pack("meta"), packer.pack(meta), packer.pack("root"), packer.pack(root),
                packer.pack("tensors"), packer.pack_array_header(len(rows))])
        except (ValueError, TypeError, OverflowError) as e:  # depth beyond msgpack's own limit
            raise LimitError(
                f"the object cannot be encoded as msgpack ({e}); it is nested deeper than msgpack allows",
                limit="max_depth", path="$", hint="keep limits.max_depth at or below 256",
            ) from e
        self._tail = packer.pack("version") + packer.pack(VERSION)
        self._start = packer.pack_map_header(len(_ENTRY_KEYS)) + packer.pack("digest") + packer.pack(zero)[:-size]
        self._rests = []
        for row in rows:
            packed = packer.pack(table_row(*row, zero))
            if not packed.startswith(self._start + zero):
                raise AssertionError("internal error: a table row does not start with its digest")
            self._rests.append(packed[len(self._start) + size :])

    def __call__(self, digests: list[bytes]) -> bytes:
        parts = [self._head]
        start = self._start
        for d, rest in zip(digests, self._rests):
            parts += (start, d, rest)
        parts.append(self._tail)
        return b"".join(parts)


def table_row(name, dtype_name, shape, kind, requires_grad, digest_raw) -> dict:
    return {
        "digest": digest_raw, "dtype": dtype_name, "kind": kind,
        "name": name, "requires_grad": requires_grad, "shape": list(shape),
    }


def devices_text(devices: list[str]) -> str:
    """``"3:cuda:0,7:cuda:1"``: table index and device of every tensor not on the CPU."""
    return ",".join(f"{i}:{d}" for i, d in enumerate(devices) if d != "cpu")


def header_metadata(manifest_raw: bytes, devices: list[str], algorithm: str = digest.DEFAULT) -> dict[str, str]:
    meta = {
        KEY_FORMAT: "pt",
        KEY_DIGEST: digest.to_text(digest.manifest_digest(manifest_raw, algorithm), algorithm),
        KEY_MANIFEST: base64.b64encode(manifest_raw).decode("ascii"),
    }
    text = devices_text(devices)
    if text:
        meta[KEY_DEVICES] = text
    return meta


def _parse_devices(text: str, infos: list["TensorInfo"]) -> None:
    """Apply ``__metadata__["tensorcanon.devices"]`` to the table, accepting only canonical text."""
    for index, device in devices_of(text, len(infos), lambda i: infos[i].name).items():
        info = infos[index]
        info.device = device
        if info.kind == "ndarray":
            raise _bad(f"tensor {info.name!r} is a numpy array but is given device {device!r}")


def devices_of(text: str, count: int, name_of: Callable[[int], str]) -> dict[int, str]:
    """``{table index: device}`` from ``__metadata__["tensorcanon.devices"]`` of a table of
    ``count`` rows, accepting only canonical text (``name_of(i)`` names row ``i`` in errors)."""
    if not text:
        raise _bad(f"__metadata__[{KEY_DEVICES!r}] is empty (omit it when every tensor is on the CPU)")
    out: dict[int, str] = {}
    for item in text.split(","):
        index, sep, device = item.partition(":")
        if not sep or not index.isdigit() or not index.isascii() or not 0 <= int(index) < count:
            raise _bad(f"__metadata__[{KEY_DEVICES!r}] has a malformed entry {item[:80]!r}")
        i = int(index)
        if len(device) > 64:
            raise _bad(f"tensor {name_of(i)!r} has an over-long device name")
        try:
            out[i] = str(torch.device(device))
        except (RuntimeError, ValueError):
            raise _bad(f"tensor {name_of(i)!r} has invalid device {device!r}") from None
    if ",".join(f"{i}:{d}" for i, d in sorted(out.items()) if d != "cpu") != text:
        raise _bad(f"__metadata__[{KEY_DEVICES!r}] is not in canonical form (ascending indices, "
                   "canonical device names, no 'cpu' entries)")
    return out


def _bad(message: str) -> FormatError:
    return FormatError(f"manifest: {message}")


def is_tensorcanon(header: container.Header) -> bool:
    """True if the header claims to be tensorcanon (else: plain safetensors).

    Any ``tensorcanon.*`` key in ``__metadata__`` makes the claim, so damage to
    one key's name (a flipped bit in "tensorcanon.manifest") is caught by
    :func:`parse` instead of the file silently loading as plain safetensors.
    """
    return claims(header.metadata)


def claims(metadata: dict[str, str] | None) -> bool:
    """True if a header's ``__metadata__`` makes the tensorcanon claim (see :func:`is_tensorcanon`)."""
    return metadata is not None and any(k.startswith("tensorcanon.") for k in metadata)


def parse(header: container.Header, limits: Limits) -> Manifest:
    """Decode, validate and cross-check the manifest of a tensorcanon file.

    Checks that the manifest is canonical, that its tensor table and the
    header describe the same tensors, that the header itself is byte-for-byte
    what a writer would produce, and that the recorded file digest matches.
    Every failure names what differs; fastparse.py makes the same checks in
    one pass for the common, valid case.
    """
    meta = header.metadata or {}
    decoded = decode(meta)
    by_name = {e.name: e for e in header.entries}

    def cross_check(info: TensorInfo) -> None:
        entry = by_name.get(info.name)
        if entry is None:
            raise _bad(f"tensor {info.name!r} is not in the header")
        want = dtypes.header_shape(info.dtype, info.shape)
        if entry.dtype != info.dtype.st or list(entry.shape) != want:
            raise _bad(
                f"tensor {info.name!r} is {info.dtype.name}{list(info.shape)} here but the header says "
                f"{entry.dtype}{list(entry.shape)}"
            )

    infos = table(decoded, meta, limits, cross_check)
    if len(infos) != len(by_name):
        extra = sorted(set(by_name) - {i.name for i in infos})[:3]
        raise _bad(f"the header holds tensors the manifest does not list: {extra}")
    if canonical_header(infos, header.metadata)[0] != header.raw:
        raise FormatError(
            "header is not in canonical form (tensor order, offsets, key order, spacing or "
            "__metadata__ keys differ from what tensorcanon writes)", offset=container.LENGTH_SIZE,
        )
    return decoded.manifest(infos)


@dataclass
class Decoded:
    """A manifest whose bytes passed every check (docs/FORMAT.md §9.2 items 1-5), before its table."""

    raw: bytes
    obj: dict
    algorithm: str
    digest: bytes

    def manifest(self, infos: list[TensorInfo]) -> Manifest:
        return Manifest(raw=self.raw, root=self.obj["root"], meta=self.obj["meta"], tensors=infos,
                        digest=self.digest, algorithm=self.algorithm)


def check_keys(meta: dict) -> None:
    """Raise unless ``__metadata__`` holds exactly the keys of a tensorcanon file (§9.2 item 1)."""
    if not {KEY_FORMAT, KEY_DIGEST, KEY_MANIFEST} <= set(meta) <= {KEY_FORMAT, KEY_DIGEST, KEY_MANIFEST, KEY_DEVICES} \
            or meta[KEY_FORMAT] != "pt":
        raise _bad(
            f"__metadata__ must hold {sorted([KEY_FORMAT, KEY_DIGEST, KEY_MANIFEST])} (and "
            f"{KEY_DEVICES!r} when a tensor is not on the CPU), with format 'pt'"
        )


def decode(meta: dict) -> Decoded:
    """Check ``__metadata__``'s keys and decode the manifest it holds: base64 and msgpack, both in
    canonical form, the top-level keys, version and algorithm, and the recorded file digest."""
    check_keys(meta)
    text = meta[KEY_MANIFEST]
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _bad("is not valid base64") from None
    if base64.b64encode(raw).decode("ascii") != text:  # e.g. "AS==" decodes like "AQ=="
        raise _bad("base64 is not in canonical form (non-zero padding bits)")
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises many types for bad input
        raise _bad(f"is not valid msgpack ({type(e).__name__}: {e})") from None
    try:
        canonical = msgpack.packb(obj, use_bin_type=True) == raw
    except Exception:
        canonical = False
    if not canonical:
        raise _bad("is not in canonical form (non-shortest numbers, repeated keys or float32)")
    if type(obj) is not dict or list(obj) != _TOP_KEYS:
        raise _bad(f"must be a map with exactly the keys {_TOP_KEYS} in that order")
    if type(obj["version"]) is not int or obj["version"] != VERSION:  # 1.0 and True equal 1
        raise _bad(
            f"format version {obj['version']!r} is not supported by this tensorcanon "
            f"(it reads version {VERSION}); upgrade tensorcanon to read this file"
        )
    algorithm = obj["algorithm"]
    if type(algorithm) is not str or algorithm not in digest.ALGORITHMS:
        raise _bad(
            f"digest algorithm {algorithm!r} is not supported (this tensorcanon knows "
            f"{sorted(digest.ALGORITHMS)}); upgrade tensorcanon if the file is newer"
        )

    recorded = meta.get(KEY_DIGEST)
    if not digest.is_text(recorded):
        raise _bad(f"__metadata__[{KEY_DIGEST!r}] is missing or malformed")
    recorded_algorithm, recorded_raw = digest.parse_text(recorded)
    if recorded_algorithm != algorithm:
        raise _bad(
            f"__metadata__[{KEY_DIGEST!r}] is a {recorded_algorithm} digest but the manifest "
            f"says the file uses {algorithm}"
        )
    actual = digest.manifest_digest(raw, algorithm)
    if recorded_raw != actual:
        raise IntegrityError(
            f"the manifest does not match the file digest: recorded {recorded}, "
            f"computed {digest.to_text(actual, algorithm)}; the file is damaged",
            expected=recorded, actual=digest.to_text(actual, algorithm),
        )
    return Decoded(raw, obj, algorithm, actual)


def table(decoded: Decoded, meta: dict, limits: Limits,
          each: Callable[[TensorInfo], None] | None = None) -> list[TensorInfo]:
    """The validated tensor table (§9.2 items 6-7): rows, unique names, devices.

    ``each(info)`` is called on every row as soon as it is valid (the full
    parse cross-checks it with the header there).
    """
    rows = decoded.obj["tensors"]
    if type(rows) is not list:
        raise _bad("'tensors' must be a list")
    if len(rows) > limits.max_tensors:
        raise LimitError(f"manifest lists {len(rows)} tensors, over max_tensors={limits.max_tensors}", limit="max_tensors")
    algorithm = decoded.algorithm
    size = digest.ALGORITHMS[algorithm]
    infos: list[TensorInfo] = []
    seen: set[str] = set()
    shapes: dict = {}
    for i, row in enumerate(rows):
        info = _row(i, row, algorithm, size, shapes)
        if info.name in seen:
            raise _bad(f"tensor name {info.name!r} appears twice")
        seen.add(info.name)
        if each is not None:
            each(info)
        infos.append(info)
    if KEY_DEVICES in meta:
        _parse_devices(meta[KEY_DEVICES], infos)
    return infos


def canonical_header(infos: list[TensorInfo], metadata: dict[str, str] | None) -> tuple[bytes, int]:
    """``(header bytes, data size)`` a writer produces for this table (data order §2.5,
    offsets, §4.1 header dtypes and shapes), giving each row its ``begin`` and ``end``."""
    # Data order is (larger element size first, then name): sort by name, then stably by size.
    # Names came from valid UTF-8, and for such strings code point order is UTF-8 byte order.
    ordered = sorted(infos, key=_name)
    ordered.sort(key=_neg_itemsize)
    members: dict[str, str] = {}  # name -> member text (a dict, not pairs: no object per row)
    per_shape: dict = {}  # (dtype, shape) -> (bytes, header dims text): rows often share one
    position = 0
    enc = container.encode_str
    for info in ordered:
        dt = info.dtype
        key = (dt.name, info.shape)
        known = per_shape.get(key)
        if known is None:
            shape = info.shape if dt.native else (*info.shape, dt.itemsize)
            known = per_shape[key] = (math.prod(info.shape) * dt.itemsize,
                                                   '","shape":[' + ",".join(map(str, shape)) + "]}")
        end = position + known[0]
        info.begin, info.end = position, end
        # container.entry_text, inline: one f-string per row
        members[info.name] = f'{enc(info.name)}:{{"data_offsets":[{position},{end}],"dtype":"{dt.st}{known[1]}'
        position = end
    return container.assemble(members, metadata), position


_name = operator.attrgetter("name")


def _neg_itemsize(info: TensorInfo) -> int:
    return -info.dtype.itemsize


def _row(i: int, row: Any, algorithm: str, size: int, shapes: dict) -> TensorInfo:
    """Row ``i`` of the table, validated (``size``: the algorithm's digest size).

    The common case of a valid row is checked in one pass; any failure goes
    through :func:`_row_error`, which finds the first problem and names it.
    Rows of one shape share one tuple (``shapes``), so a table of many
    tensors leaves fewer objects for the garbage collector to track.
    """
    if type(row) is dict and list(row) == _ENTRY_KEYS:
        name, dt, shape = row["name"], row["dtype"], row["shape"]
        kind, rg, dg = row["kind"], row["requires_grad"], row["digest"]
        dtype = _BY_NAME.get(dt) if type(dt) is str else None
        if (type(name) is str and dtype is not None and type(shape) is list
                and type(rg) is bool and type(dg) is bytes and len(dg) == size
                and (kind == "tensor" or kind == "parameter"
                     or (kind == "ndarray" and not rg and dtype.numpy is not None))):
            for d in shape:
                if type(d) is not int or d < 0:
                    break
            else:
                dims = tuple(shape)  # exact ints (checked): equal tuples are the same shape
                return TensorInfo(i, name, dtype, shapes.setdefault(dims, dims), kind, rg, dg)
    raise _row_error(i, row, algorithm)


def _row_error(i: int, row: Any, algorithm: str) -> FormatError:
    """What is wrong with row ``i``, which :func:`_row` refused."""
    if type(row) is not dict or list(row) != _ENTRY_KEYS:
        return _bad(f"tensor table row {i} must have exactly the keys {_ENTRY_KEYS} in that order")
    name, dt, shape = row["name"], row["dtype"], row["shape"]
    kind, rg, dg = row["kind"], row["requires_grad"], row["digest"]
    if type(name) is not str:
        return _bad(f"tensor table row {i}: name must be a str")
    where = f"tensor {name!r}"
    dtype = dtypes.BY_NAME.get(dt) if type(dt) is str else None
    if dtype is None:
        return _bad(f"{where} has unknown dtype {dt!r}")
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        return _bad(f"{where} shape must be a list of non-negative ints")
    if kind not in KINDS:
        return _bad(f"{where} has unknown kind {kind!r}")
    if type(rg) is not bool or (rg and kind == "ndarray"):
        return _bad(f"{where} has an invalid requires_grad {rg!r}")
    if kind == "ndarray" and dtype.numpy is None:
        return _bad(f"{where} is a numpy array of dtype {dtype.name}, which numpy lacks")
    want = digest.ALGORITHMS[algorithm]
    got = f"{len(dg)} bytes" if type(dg) is bytes else f"a {type(dg).__name__}"
    return _bad(f"{where} digest must be {want} bytes for algorithm {algorithm!r}, not {got}")
