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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import msgpack

from . import container, devices, digest, dtypes, paths
from .errors import FormatError, IntegrityError, LimitError, TensorCanonError
from .limits import Limits, exceeds
from .ordering import MAX_SAME_HASH

VERSION = 3
"""The format version this library writes (docs/FORMAT.md §1.3)."""
READABLE_VERSIONS = (1, 2, 3)
"""The format versions this library reads: version 1 differs from 2 in its tensor-name rule, 2 from 3
in how lists are written (packed lists, §6.13)."""
KEY_MANIFEST = "tensorcanon.manifest"
KEY_DIGEST = "tensorcanon.digest"
KEY_FORMAT = "format"
KINDS = ("tensor", "parameter", "ndarray")
_TOP_KEYS = ["algorithm", "meta", "root", "tensors", "version"]
_ENTRY_KEYS = ["digest", "dtype", "kind", "name", "requires_grad", "shape"]
KEY_DEVICES = "tensorcanon.devices"
KEY_MEMORY_FORMATS = "tensorcanon.memory_formats"
MEMORY_FORMAT_NDIM = {"channels_last": 4, "channels_last_3d": 5}
_DEFAULT_ALGORITHM = digest.DEFAULT  # (inside Manifest, the name ``digest`` is a field)
_BY_NAME = dtypes.BY_NAME


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One row of the tensor table, validated and matched to its header entry; immutable.

    A row is whole when the check that proves it returns it (:func:`parse`, :func:`read`,
    :func:`read_file`, :func:`read_table`): its data's offsets in data order (docs/FORMAT.md
    §2.5), its device and memory format from ``__metadata__``. Nothing changes it after.
    """

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
    memory_format: str | None = None

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(slots=True)
class _Building:
    """A table row while a check fills it in: TensorInfo's fields (its slots, in the same order),
    assignable. It never leaves this module: :func:`_frozen` makes it a TensorInfo in place."""

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
    memory_format: str | None = None


if _Building.__slots__ != TensorInfo.__slots__:
    raise AssertionError("internal error: _Building and TensorInfo must have the same slots")


def _frozen(rows: list[_Building]) -> list[TensorInfo]:
    """``rows``, whose check is complete, as TensorInfo: the same objects, their class changed (the
    two classes have the same slots, so each keeps its values). Building a frozen dataclass field
    by field costs five times as much as this, on every row of a table of 20,000 tensors."""
    for row in rows:
        row.__class__ = TensorInfo  # type: ignore[assignment]
    return cast("list[TensorInfo]", rows)


@dataclass
class Manifest:
    raw: bytes
    root: Any
    meta: Any
    tensors: list[TensorInfo]   # table order (indices used by the tree)
    digest: bytes
    algorithm: str = _DEFAULT_ALGORITHM
    version: int = VERSION

    def text(self, raw: bytes | None = None) -> str:
        """A digest of this file (the file digest if ``raw`` is None) as text."""
        return digest.to_text(self.digest if raw is None else raw, self.algorithm)


def pack(root: Any, meta: Any, table: list[dict], algorithm: str = digest.DEFAULT,
         version: int = VERSION) -> bytes:
    """Canonical manifest bytes. ``table`` rows must already have sorted keys."""
    obj = {"algorithm": digest.check(algorithm), "meta": meta, "root": root, "tensors": table, "version": version}
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (ValueError, TypeError, OverflowError) as e:  # depth beyond msgpack's own limit
        raise LimitError(
            f"the object cannot be encoded as msgpack ({e}); it is nested deeper than msgpack allows",
            limit="max_depth", path="$", hint="keep limits.max_depth at or below 256",
        ) from e


class Packed:
    """A manifest packed once, whose tensor digests can be filled in later without packing again.

    ``packed(digests)`` gives exactly ``pack(root, meta, rows, algorithm, version)``
    for the rows with those digests: msgpack encodes a map or an array as its
    header followed by its items, so the manifest is a fixed head, each row
    (a fixed start, the digest, the rest of the row) and a fixed tail. Each
    row is kept as bytes, not as a dict: saving many tensors leaves the
    garbage collector fewer objects to track.
    """

    def __init__(self, root: Any, meta: Any, rows: list[tuple[str, str, Sequence[int], str, bool]],
                 algorithm: str = digest.DEFAULT,
                 version: int = VERSION) -> None:
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
        self._tail = packer.pack("version") + packer.pack(version)
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
        for d, rest in zip(digests, self._rests, strict=True):
            parts += (start, d, rest)
        parts.append(self._tail)
        return b"".join(parts)


def table_row(name: str, dtype_name: str, shape: Sequence[int], kind: str, requires_grad: bool,
              digest_raw: bytes) -> dict[str, Any]:
    return {
        "digest": digest_raw, "dtype": dtype_name, "kind": kind,
        "name": name, "requires_grad": requires_grad, "shape": list(shape),
    }


def devices_text(devices: list[str]) -> str:
    """``"3:cuda:0,7:cuda:1"``: table index and device of every tensor not on the CPU."""
    return ",".join(f"{i}:{d}" for i, d in enumerate(devices) if d != "cpu")


def memory_formats_text(formats: list[str | None]) -> str:
    """``"0:channels_last,4:channels_last_3d"``: table index and memory format of every tensor
    laid out channels-last (docs/FORMAT.md §5.6)."""
    return ",".join(f"{i}:{f}" for i, f in enumerate(formats) if f is not None)


def header_metadata(manifest_raw: bytes, devices: list[str], algorithm: str = digest.DEFAULT,
                    memory_formats: list[str | None] | None = None) -> dict[str, str]:
    meta = {
        KEY_FORMAT: "pt",
        KEY_DIGEST: digest.to_text(digest.manifest_digest(manifest_raw, algorithm), algorithm),
        KEY_MANIFEST: base64.b64encode(manifest_raw).decode("ascii"),
    }
    text = devices_text(devices)
    if text:
        meta[KEY_DEVICES] = text
    text = memory_formats_text(memory_formats or [])
    if text:
        meta[KEY_MEMORY_FORMATS] = text
    return meta


def channels_last_differs(name: str, shape: tuple[int, ...]) -> bool:
    """True when a tensor of ``shape`` laid out as memory format ``name`` cannot also be
    C-contiguous: it has elements, more than one channel and more than one spatial position."""
    return (len(shape) == MEMORY_FORMAT_NDIM[name] and 0 not in shape and shape[1] > 1
            and any(d > 1 for d in shape[2:]))


def _entries(text: str, key: str, count: int, omit: str) -> Iterator[tuple[int, str, str]]:
    """``(index, value, entry)`` for each comma-separated ``index:value`` entry of
    ``__metadata__[key]`` for a table of ``count`` rows; canonical form is the caller's check.

    ``omit`` says when a writer leaves the key out (for the message about empty text).
    """
    if not text:
        raise _bad(f"__metadata__[{key!r}] is empty (omit it {omit})")
    for item in text.split(","):
        index, sep, value = item.partition(":")
        # (20 digits: any table index; more would only feed int() hostile work, or exceed Python's
        # 4,300-digit limit and raise its ValueError)
        if not sep or not index.isascii() or not index.isdigit() or len(index) > 20 \
                or not int(index) < count:
            raise _bad(f"__metadata__[{key!r}] has a malformed entry {item[:80]!r}")
        yield int(index), value, item


def _parse_memory_formats(text: str, infos: list[_Building]) -> None:
    """Apply ``__metadata__["tensorcanon.memory_formats"]`` to the table, accepting only canonical text."""
    key = KEY_MEMORY_FORMATS
    for index, name, item in _entries(text, key, len(infos), "when no tensor is channels-last"):
        if name not in MEMORY_FORMAT_NDIM:
            raise _bad(f"__metadata__[{key!r}] has a malformed entry {item[:80]!r}")
        info = infos[index]
        if info.kind == "ndarray":
            raise _bad(f"tensor {info.name!r} is a numpy array but is given memory format {name!r}")
        if not channels_last_differs(name, info.shape):
            raise _bad(f"tensor {info.name!r} of shape {list(info.shape)} cannot be {name} without also "
                       "being contiguous, so no writer records it")
        info.memory_format = name
    if memory_formats_text([i.memory_format for i in infos]) != text:
        raise _bad(f"__metadata__[{key!r}] is not in canonical form (ascending indices, each index once)")


def _parse_devices(text: str, infos: list[_Building]) -> None:
    """Apply ``__metadata__["tensorcanon.devices"]`` to the table, accepting only canonical text."""
    for index, device in devices_of(text, len(infos), lambda i: infos[i].name).items():
        info = infos[index]
        if info.kind == "ndarray":
            raise _bad(f"tensor {info.name!r} is a numpy array but is given device {device!r}")
        info.device = device


def devices_of(text: str, count: int, name_of: Callable[[int], str]) -> dict[int, str]:
    """``{table index: device}`` from ``__metadata__["tensorcanon.devices"]`` of a table of
    ``count`` rows, accepting only canonical text (``name_of(i)`` names row ``i`` in errors)."""
    out: dict[int, str] = {}
    for i, device, _ in _entries(text, KEY_DEVICES, count, "when every tensor is on the CPU"):
        problem = devices.of_tensor(device)
        if problem is not None:
            raise _bad(f"tensor {name_of(i)!r}: {problem}")
        out[i] = device
    if ",".join(f"{i}:{d}" for i, d in sorted(out.items())) != text:
        raise _bad(f"__metadata__[{KEY_DEVICES!r}] is not in canonical form (ascending indices, "
                   "each index once, canonical device names, no 'cpu' entries)")
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
    infos = _table(decoded.obj["tensors"], decoded.algorithm, limits)
    by_name = {e.name: e for e in header.entries}
    for info in infos:
        entry = by_name.get(info.name)
        if entry is None:
            raise _bad(f"tensor {info.name!r} is not in the header")
        want = dtypes.header_shape(info.dtype, info.shape)
        if entry.dtype != info.dtype.st or entry.shape != want:
            raise _bad(
                f"tensor {info.name!r} is {info.dtype.name}{list(info.shape)} here but the header says "
                f"{entry.dtype}{list(entry.shape)}"
            )
    _apply_metadata(infos, meta, decoded.version)
    if len(infos) != len(by_name):
        extra = sorted(set(by_name) - {i.name for i in infos})[:3]
        raise _bad(f"the header holds tensors the manifest does not list: {extra}")
    rows = _placed(infos)
    if canonical_header(rows, header.metadata)[0] != header.raw:
        raise FormatError(
            "header is not in canonical form (tensor order, offsets, key order, spacing or "
            "__metadata__ keys differ from what tensorcanon writes)", offset=container.LENGTH_SIZE,
        )
    return decoded.manifest(rows)


@dataclass
class Decoded:
    """A manifest whose bytes passed every check (docs/FORMAT.md §9.2 items 1-5), before its table."""

    raw: bytes
    obj: dict
    algorithm: str
    digest: bytes
    version: int

    def manifest(self, infos: list[TensorInfo]) -> Manifest:
        return Manifest(raw=self.raw, root=self.obj["root"], meta=self.obj["meta"], tensors=infos,
                        digest=self.digest, algorithm=self.algorithm, version=self.version)


def check_keys(meta: dict) -> None:
    """Raise unless ``__metadata__`` holds exactly the keys of a tensorcanon file (§9.2 item 1)."""
    optional = {KEY_DEVICES, KEY_MEMORY_FORMATS}
    if not {KEY_FORMAT, KEY_DIGEST, KEY_MANIFEST} <= set(meta) <= {KEY_FORMAT, KEY_DIGEST, KEY_MANIFEST} | optional \
            or meta[KEY_FORMAT] != "pt":
        raise _bad(
            f"__metadata__ must hold {sorted([KEY_FORMAT, KEY_DIGEST, KEY_MANIFEST])} (and "
            f"{KEY_DEVICES!r} when a tensor is not on the CPU, {KEY_MEMORY_FORMATS!r} when one is "
            "channels-last), with format 'pt'"
        )


def _manifest_bytes(meta: dict) -> bytes:
    """Check ``__metadata__``'s keys; the manifest bytes its text holds, in canonical base64."""
    check_keys(meta)
    text = meta[KEY_MANIFEST]
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _bad("is not valid base64") from None
    # Canonical: encoding ``raw`` again gives ``text``. validate=True admits only the alphabet and
    # "=" at the end, so every group of 4 characters but the last encodes its 3 bytes the one way:
    # compare the length and the last group (not a copy of the whole text; it may be 130 MB).
    tail = raw[len(raw) - (len(raw) % 3 or 3):]
    if len(text) != 4 * -(-len(raw) // 3) or base64.b64encode(tail).decode("ascii") != text[len(text) - 4:]:
        raise _bad("base64 is not in canonical form (non-zero padding bits)")  # "AS==" decodes like "AQ=="
    return raw


def _recorded_digest(meta: dict) -> tuple[str, str, bytes]:
    """The file digest ``__metadata__`` records: ``(its text, algorithm, raw digest)``."""
    recorded = meta.get(KEY_DIGEST)
    if not isinstance(recorded, str) or not digest.is_text(recorded):
        raise _bad(f"__metadata__[{KEY_DIGEST!r}] is missing or malformed")
    algorithm, raw = digest.parse_text(recorded)
    return recorded, algorithm, raw


def vouched(meta: dict) -> bool:
    """Whether the file digest ``__metadata__`` records vouches for the manifest text it holds (its
    keys right, the text canonical base64, its bytes hashing to that digest), never raising: what a
    reader reporting a failed manifest check asks to tell damage from a file written wrong."""
    try:
        raw = _manifest_bytes(meta)
        _, algorithm, recorded = _recorded_digest(meta)
        return digest.manifest_digest(raw, algorithm) == recorded
    except TensorCanonError:
        return False


def decode(meta: dict) -> Decoded:
    """Check ``__metadata__``'s keys and decode the manifest it holds: base64 and msgpack, both in
    canonical form, the top-level keys, version and algorithm, and the recorded file digest."""
    raw = _manifest_bytes(meta)
    obj, algorithm = unpack(raw)
    recorded, recorded_algorithm, recorded_raw = _recorded_digest(meta)
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
    return Decoded(raw, obj, algorithm, actual, obj["version"])


_BATCH = 256  # table rows decoded, checked canonical and turned into table rows at a time


def read(meta: dict, limits: Limits) -> Manifest:
    """:func:`decode` and :func:`read_table` in one pass, for the common case of a valid manifest.

    Accepts exactly the manifests those two accept, and raises :class:`FormatError`
    (or :class:`IntegrityError`) for any other, without naming the first problem in
    the order of docs/FORMAT.md §9: a caller that needs that (fastparse.py) runs
    the full checks then. The difference is in what stays alive: the table is
    decoded a batch of rows at a time, each batch packed again and compared with
    its bytes (the canonical check, piece by piece: msgpack writes a map or an
    array as its header followed by its items, so equal pieces make equal wholes),
    then turned into table rows and dropped. Loading many small tensors so
    leaves the garbage collector the rows only, not also a dict per row.
    """
    return _read(meta, limits, False)


def read_file(meta: dict, limits: Limits) -> Manifest:
    """:func:`read`, each row with the device and memory format ``meta`` records for it (§9.2
    item 7): the table as the file whose ``__metadata__`` is ``meta`` holds it (fastparse.py)."""
    return _read(meta, limits, True)


def _read(meta: dict, limits: Limits, with_metadata: bool) -> Manifest:
    raw = _manifest_bytes(meta)
    _, algorithm, recorded_raw = _recorded_digest(meta)
    actual = digest.manifest_digest(raw, algorithm)
    if recorded_raw != actual:
        raise IntegrityError("the manifest does not match the file digest")
    try:
        root, meta_tree, infos, version = _stream(raw, algorithm, limits)
    except (FormatError, LimitError):
        raise
    except Exception as e:  # noqa: BLE001 - msgpack raises many types for bad input
        raise _bad(f"is not valid, canonical msgpack ({type(e).__name__})") from None
    if with_metadata:
        _apply_metadata(infos, meta, version)
    return Manifest(raw=raw, root=root, meta=meta_tree, tensors=_placed(infos), digest=actual,
                    algorithm=algorithm, version=version)


def _map(obj: dict) -> dict:
    """msgpack's ``object_hook``: keep the two maps a manifest has, refuse any other at once.

    msgpack builds each map as a dict before anything else sees it: a dict costs some
    80 bytes, an empty map one byte, so a manifest of millions of maps where the format
    allows none would take ~64 times its size in memory before the tree check refused it.
    """
    keys = list(obj)
    if keys == _ENTRY_KEYS or keys == _TOP_KEYS:
        return obj
    raise _bad(
        f"holds a map with the keys {paths.show(keys)}; maps appear only as the top-level map and the "
        f"tensor-table rows, each with exactly the keys {_TOP_KEYS} or {_ENTRY_KEYS} in that order "
        "(the object tree holds no maps: docs/FORMAT.md §5.1)")


UNPACK_OPTIONS: dict[str, Any] = {
    "raw": False, "strict_map_key": True, "use_list": False, "object_hook": _map,
    "max_map_len": len(_ENTRY_KEYS),
}
"""How manifest bytes are unpacked (here and in lazyindex.py): arrays as tuples (see :func:`unpack`),
no map but the manifest's own (:func:`_map`; its keys are str, whose hash is random per process)."""


def unpacker(raw: bytes) -> msgpack.Unpacker:
    """An Unpacker over manifest bytes (or a part of them), with :data:`UNPACK_OPTIONS`."""
    u = msgpack.Unpacker(max_buffer_size=len(raw) + 1, **UNPACK_OPTIONS)
    u.feed(raw)
    return u


def _stream(raw: bytes, algorithm: str, limits: Limits) -> tuple[Any, Any, list[_Building], int]:
    """The body of :func:`read`: ``(root, meta, table rows, version)`` of canonical manifest bytes."""
    u = unpacker(raw)
    unpack, tell = u.unpack, u.tell
    packer = msgpack.Packer(use_bin_type=True)
    pack = packer.pack
    if u.read_map_header() != len(_TOP_KEYS):
        raise _bad("must be a map of 5 keys")
    values = []
    for key in _TOP_KEYS[:3]:  # algorithm, meta, root
        if unpack() != key:
            raise _bad(f"must hold the keys {_TOP_KEYS} in that order")
        values.append(unpack())
    if values[0] != algorithm or unpack() != "tensors":
        raise _bad("names another algorithm than its digest, or lacks 'tensors'")
    count = u.read_array_header()
    if exceeds(limits, "max_tensors", count):
        raise LimitError(f"manifest lists {count} tensors, over max_tensors={limits.max_tensors}",
                         limit="max_tensors")
    head = b"".join([packer.pack_map_header(len(_TOP_KEYS)), pack("algorithm"), pack(algorithm),
                     pack("meta"), pack(values[1]), pack("root"), pack(values[2]), pack("tensors"),
                     packer.pack_array_header(count)])
    view = memoryview(raw)
    if view[: len(head)] != head or tell() != len(head):
        raise _bad("is not in canonical form")
    infos: list[_Building] = []
    size = digest.ALGORITHMS[algorithm]
    shapes: dict = {}
    i = 0
    while i < count:
        n = min(_BATCH, count - i)
        start = tell()
        batch = [unpack() for _ in range(n)]
        if pack(batch) != packer.pack_array_header(n) + raw[start : tell()]:
            raise _bad("is not in canonical form")
        for row in batch:
            infos.append(_row(i, row, algorithm, size, shapes))
            i += 1
    if len({info.name for info in infos}) != count:  # (read_table names the first repeated name)
        raise _bad("a tensor name appears twice")
    start = tell()
    if unpack() != "version":
        raise _bad("must end with 'version'")
    version = unpack()
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise _bad("has a version this tensorcanon does not read")
    if tell() != len(raw) or raw[start:] != pack("version") + pack(version):
        raise _bad("is not in canonical form, or has trailing bytes")
    return values[2], values[1], infos, version


def _apply_metadata(infos: list[_Building], meta: dict, version: int) -> None:
    """Apply the devices and memory formats of ``__metadata__`` to a validated table (§9.2 item 7)."""
    if KEY_DEVICES in meta:
        _parse_devices(meta[KEY_DEVICES], infos)
    if KEY_MEMORY_FORMATS in meta:
        if version < 2:
            raise _bad(f"__metadata__[{KEY_MEMORY_FORMATS!r}] is a format-2 key, in a version-1 file")
        _parse_memory_formats(meta[KEY_MEMORY_FORMATS], infos)


def canonical_header(infos: Sequence[TensorInfo], metadata: dict[str, str] | None) -> tuple[bytes, int]:
    """``(header bytes, data size)`` a writer produces for this table: each row's member at the
    offsets the row holds (the functions that check a table place every row in data order,
    §2.5), with its §4.1 header dtype and shape (:func:`dtypes.header_shape`)."""
    members: dict[str, str] = {}  # name -> member text (a dict, not pairs: no object per row)
    # (dtype, shape) -> the member's dtype and shape text: rows often share one. By the shape
    # tuple's id, not its value: rows of one shape share one tuple (_shared), and a file can give
    # many shapes one hash, which would make a dict of them take quadratic time.
    per_shape: dict = {}
    size = 0
    enc = container.encode_str
    header_shape = dtypes.header_shape
    last_dt = last_shape = None  # (the row before's: runs of rows share both, and skip the dict)
    text: str | None = ""
    for info in infos:
        dt, shape = info.dtype, info.shape
        if shape is not last_shape or dt is not last_dt:
            key = (dt.name, id(shape))
            text = per_shape.get(key)
            if text is None:
                text = per_shape[key] = f'"dtype":"{dt.st}","shape":[{",".join(map(str, header_shape(dt, shape)))}]}}'
            last_dt, last_shape = dt, shape
        begin, end = info.begin, info.end
        # container.entry_text, inline: one f-string per row
        members[info.name] = f'{enc(info.name)}:{{"data_offsets":[{begin},{end}],{text}'
        size += end - begin
    return container.assemble(members, metadata), size


def _placed(rows: list[_Building]) -> list[TensorInfo]:
    """The checked ``rows`` as TensorInfo, each given its data's offsets where the one layout of
    a table puts them (data order, no gaps: docs/FORMAT.md §2.5), the only place a file may hold them."""
    ordered = container.in_data_order(rows, _name, _itemsize)
    starts, size = container.packed([math.prod(row.shape) * row.dtype.itemsize for row in ordered])
    ends = [*starts[1:], size] if starts else []  # each ends where the next starts
    frozen = TensorInfo
    for row, begin, end in zip(ordered, starts, ends, strict=True):
        row.begin, row.end = begin, end
        row.__class__ = frozen  # type: ignore[assignment]  # (_frozen, inline: one pass over a large table)
    return cast("list[TensorInfo]", rows)


_name = operator.attrgetter("name")
_itemsize = operator.attrgetter("dtype.itemsize")


def unpack(raw: bytes) -> tuple[dict, str]:
    """Decode manifest bytes: ``(top-level map, algorithm)``, or raise.

    Checks the canonical msgpack encoding (decode, re-encode, compare), the
    top-level keys, the version and the digest algorithm: everything about the
    bytes that does not need a file around them (§9.2 steps 3 and 4). Also used
    for manifests kept outside a file (the logical manifest of a sharded
    checkpoint, tensorcanon.sharded).

    msgpack arrays come back as tuples (the object tree's tagged arrays, the
    table, shapes): re-encoded they give the same bytes, and a tuple of atomic
    values is one object fewer for the garbage collector to track. A map other
    than the top level and the table's rows is refused as it is read (:func:`_map`).
    """
    try:
        obj = msgpack.unpackb(raw, **UNPACK_OPTIONS)
    except FormatError:
        raise
    except Exception as e:  # noqa: BLE001 - msgpack raises many types for bad input
        raise _bad(f"is not valid msgpack ({type(e).__name__}: {e})") from None
    try:
        canonical = msgpack.packb(obj, use_bin_type=True) == raw
    except Exception:  # noqa: BLE001 - what cannot be packed again is not canonical
        canonical = False
    if not canonical:
        raise _bad("is not in canonical form (non-shortest numbers, repeated keys or float32)")
    if type(obj) is not dict or list(obj) != _TOP_KEYS:
        raise _bad(f"must be a map with exactly the keys {_TOP_KEYS} in that order")
    version = obj["version"]
    if type(version) is not int or version not in READABLE_VERSIONS:  # 1.0 and True equal 1
        raise _bad(
            f"format version {paths.show(version)} is not supported by this tensorcanon "
            f"(it reads versions {', '.join(map(str, READABLE_VERSIONS))}); upgrade tensorcanon to "
            "read this file"
        )
    algorithm = obj["algorithm"]
    if type(algorithm) is not str or algorithm not in digest.ALGORITHMS:
        raise _bad(
            f"digest algorithm {paths.show(algorithm)} is not supported (this tensorcanon knows "
            f"{sorted(digest.ALGORITHMS)}); upgrade tensorcanon if the file is newer"
        )
    return obj, algorithm


def read_table(table: Any, algorithm: str, limits: Limits) -> list[TensorInfo]:
    """Validate a manifest's tensor table (rows, dtypes, kinds, digest sizes, unique names): its
    rows on the CPU, each at its data's offsets in data order (§2.5)."""
    return _placed(_table(table, algorithm, limits))


def _table(table: Any, algorithm: str, limits: Limits) -> list[_Building]:
    if type(table) is not tuple:  # a msgpack array (see unpack)
        raise _bad("'tensors' must be a list")
    if exceeds(limits, "max_tensors", len(table)):
        raise LimitError(f"manifest lists {len(table)} tensors, over max_tensors={limits.max_tensors}",
                         limit="max_tensors")
    infos: list[_Building] = []
    seen: set[str] = set()
    size = digest.ALGORITHMS[algorithm]
    shapes: dict = {}
    for i, row in enumerate(table):
        info = _row(i, row, algorithm, size, shapes)
        if info.name in seen:
            raise _bad(f"tensor name {info.name!r} appears twice")
        seen.add(info.name)
        infos.append(info)
    return infos


def plain_table(header: container.Header) -> list[TensorInfo]:
    """Table rows for a plain safetensors file (no manifest): one per header entry, in data order,
    CPU tensors at the entry's offsets, without digests.

    A dtype this torch lacks (``float8_e8m0fnu`` before torch 2.7...) is refused when
    the tensor is read, naming it.
    """
    rows = []
    for i, e in enumerate(header.entries):
        dtype = dtypes.from_safetensors(e.dtype)
        assert dtype is not None, e.dtype  # container.parse admits only the dtypes dtypes.py knows
        rows.append(_Building(i, e.name, dtype, e.shape, "tensor", False, b"", "cpu", e.begin, e.end))
    return _frozen(rows)


def check_row(i: int, row: Any, algorithm: str) -> TensorInfo:
    """Row ``i`` of a table (its decoded map), checked alone (every check of §5.3): on the CPU,
    with no offsets, as the table alone gives it (lazyindex.py then takes its device and its
    header entry's offsets, and makes the row it reads with them)."""
    return _frozen([_row(i, row, algorithm, digest.size(algorithm), {})])[0]


def _row(i: int, row: Any, algorithm: str, size: int, shapes: dict) -> _Building:
    """Row ``i`` of the table, validated (``size``: the algorithm's digest size).

    The common case of a valid row is checked in one pass; any failure goes
    through :func:`_row_error`, which finds the first problem and names it.
    Rows of one shape share one tuple (``shapes``), so a table of many
    tensors leaves fewer objects for the garbage collector to track.
    """
    if type(row) is dict and list(row) == _ENTRY_KEYS:
        dg, dt, kind, name, rg, shape = row.values()  # (in _ENTRY_KEYS' order, just checked)
        dtype = _BY_NAME.get(dt) if type(dt) is str else None
        if (type(name) is str and dtype is not None and type(shape) is tuple and type(kind) is str
                and type(rg) is bool and (not rg or dtype.differentiable)
                and type(dg) is bytes and len(dg) == size
                and (kind == "tensor" or kind == "parameter"
                     or (kind == "ndarray" and not rg and dtype.has_numpy))):
            for d in shape:
                if type(d) is not int or d < 0:
                    break
            else:  # exact ints (checked): equal tuples are the same shape
                if not container.too_large(shape, dtype.itemsize):
                    return _Building(i, name, dtype, shapes.get(shape) or _shared(shapes, shape), kind, rg, dg)
    _row_error(i, row, algorithm)
    raise AssertionError("internal error: _row refused a row _row_error accepts")  # never reached


def _shared(shapes: dict, shape: tuple) -> tuple:
    """``shape``, or the equal tuple an earlier row has (so rows of one shape share one tuple).

    A file can give many shapes one Python hash (a tuple's hash is a function of its ints'),
    and a dict of them would take time quadratic in their number: at most ``MAX_SAME_HASH``
    shapes of one hash are kept, counted under the hash itself (an int key; shapes are tuples).
    """
    known = shapes.get(shape)
    if known is not None:
        return known
    h = hash(shape)
    n = shapes.get(h, 0)
    if n < MAX_SAME_HASH:
        shapes[h] = n + 1
        shapes[shape] = shape
    return shape


def _row_error(i: int, row: Any, algorithm: str) -> None:
    """Raise what is wrong with row ``i``, which :func:`_row` refused (the first problem found)."""
    if type(row) is not dict or list(row) != _ENTRY_KEYS:
        raise _bad(f"tensor table row {i} must have exactly the keys {_ENTRY_KEYS} in that order")
    name, dt, shape = row["name"], row["dtype"], row["shape"]
    kind, rg, dg = row["kind"], row["requires_grad"], row["digest"]
    if type(name) is not str:
        raise _bad(f"tensor table row {i}: name must be a str")
    where = f"tensor {paths.show(name)}"
    dtype = dtypes.BY_NAME.get(dt) if type(dt) is str else None
    if dtype is None:
        raise _bad(f"{where} has unknown dtype {paths.show(dt)}")
    if type(shape) is not tuple or not all(type(d) is int and d >= 0 for d in shape):
        raise _bad(f"{where} shape must be a list of non-negative ints")
    problem = container.size_problem(shape, dtype.itemsize)
    if problem is not None:
        raise _bad(f"{where} {problem}")
    if type(kind) is not str or kind not in KINDS:
        raise _bad(f"{where} has unknown kind {paths.show(kind)}")
    if type(rg) is not bool or (rg and kind == "ndarray"):
        raise _bad(f"{where} has an invalid requires_grad {paths.show(rg)}")
    if rg and not dtype.differentiable:
        raise _bad(f"{where} has requires_grad true but dtype {dtype.name}; only floating-point and "
                   "complex tensors can require gradients (docs/FORMAT.md §5.3)")
    if kind == "ndarray" and not dtype.has_numpy:
        raise _bad(f"{where} is a numpy array of dtype {dtype.name}, which numpy lacks")
    want = digest.ALGORITHMS[algorithm]
    if type(dg) is not bytes or len(dg) != want:
        got = f"{len(dg)} bytes" if type(dg) is bytes else f"a {type(dg).__name__}"
        raise _bad(f"{where} digest must be {want} bytes for algorithm {algorithm!r}, not {got}")
