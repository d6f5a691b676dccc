"""What :func:`tensorcanon.open` checks before the whole file: enough to prove one tensor.

Checking a whole file (docs/FORMAT.md §9) costs a few microseconds per
tensor: the manifest decoded and packed again, every table row, the header
rebuilt, the object tree walked. Reading one tensor of a thousand needs far
less to be proven, so :class:`QuickIndex` checks, before ``open`` returns:

- the header length (against the limits and the file size);
- ``__metadata__``'s keys, and that the manifest it holds is the one the
  recorded file digest was computed from (so every table row and the whole
  object tree are exactly what was saved);
- the manifest's outline: the top-level keys in order, the algorithm the
  digest names, a supported version, the table's length within the limits.

and for each tensor read: its table row (every check of §5.3), the header
entry for it (exactly one, in the canonical form for that row, inside the
file) and its bytes against its digest. A path is found by following the
tree from the root, checking each container on the way holds the key once.

Anything unexpected raises :class:`NotQuick`; the caller then checks the
whole file as :func:`tensorcanon.load` does, which raises the precise error
(or finds the file valid after all). Checks of the file as a whole (canonical
encodings, the header of every tensor, the table's order and names, every
node of the tree) are made the first time anything needs the whole file.
"""

from __future__ import annotations

import base64
import bisect
import json
import re
from json.encoder import encode_basestring
from typing import Any

import msgpack

from ..format import container, digest, fastparse, manifest, paths
from ..format.errors import FormatError
from ..format.limits import Limits
from ..format.manifest import TensorInfo
from ..format.tree import first_item, items
from ..format.walk import METADATA
from .source import Source

_COMPONENT = re.compile(r'\[("(?:[^"\\]|\\.)*"|-?[0-9]+)\]')
_OFFSETS = ':{"data_offsets":['


class NotQuick(Exception):
    """This file, or this lookup, needs the full check (internal; never reaches a caller)."""


class QuickIndex:
    """A file's manifest, proven authentic and outlined, before the whole file is checked.

    Construct it from a Source positioned at the start of the file; it raises
    the library's errors for a header length that cannot be read (the full
    check would raise the same), :class:`NotQuick` for anything else it does
    not accept.
    """

    def __init__(self, src: Source, limits: Limits) -> None:
        prefix, raw = container.read_raw(src.read, src.size, limits)
        self.raw = raw
        self.data_start = container.LENGTH_SIZE + len(raw)
        self.file_size = src.size
        meta = fastparse.find_metadata(raw)
        if meta is None or not manifest.claims(meta) or manifest.KEY_MEMORY_FORMATS in meta:
            raise NotQuick  # (channels-last tensors: rare enough to take the full check)
        try:
            manifest.check_keys(meta)
            self.algorithm, recorded = digest.parse_text(meta[manifest.KEY_DIGEST])
            m = base64.b64decode(meta[manifest.KEY_MANIFEST], validate=True)
        except (ValueError, TypeError):  # FormatError is a ValueError too
            raise NotQuick from None
        self.digest = digest.manifest_digest(m, self.algorithm)
        if self.digest != recorded:
            raise NotQuick
        self.manifest = m
        try:
            self._outline(limits)
            self.devices = (manifest.devices_of(meta[manifest.KEY_DEVICES], self.count, str)
                            if manifest.KEY_DEVICES in meta else {})
        except NotQuick:
            raise
        except Exception:  # noqa: BLE001 - msgpack raises many types for malformed input; so may devices_of
            raise NotQuick from None
        self._root: Any = None

    def _outline(self, limits: Limits) -> None:
        """Where the root and each table row are in the manifest; the algorithm and version."""
        u = manifest.unpacker(self.manifest)

        def key(name: str) -> None:
            k = u.unpack()
            if type(k) is not str or k != name:
                raise NotQuick

        if u.read_map_header() != 5:
            raise NotQuick
        key("algorithm")
        if u.unpack() != self.algorithm:
            raise NotQuick
        key("meta")
        u.skip()
        key("root")
        start = u.tell()
        u.skip()
        self._root_span = (start, u.tell())
        key("tensors")
        self.count = u.read_array_header()
        if self.count > limits.max_tensors:
            raise NotQuick
        rows = [u.tell()]
        for _ in range(self.count):
            u.skip()
            rows.append(u.tell())
        self._rows = rows
        key("version")
        version = u.unpack()
        if type(version) is not int or version not in manifest.READABLE_VERSIONS or u.tell() != len(self.manifest):
            raise NotQuick

    # ------------------------------------------------------------------ finding a tensor
    def index_of(self, key: Any) -> int | None:
        """The table index of the tensor at path ``key`` or stored as ``key``; None: ask the full check."""
        if type(key) is not str:
            return None
        if key.startswith(paths.ROOT + "["):
            trail = _parse_path(key)
            if trail is not None:
                return self._follow(trail)
        return self._named(key)

    def _follow(self, trail: tuple) -> int | None:
        if self._root is None:
            a, b = self._root_span
            try:
                self._root = msgpack.unpackb(self.manifest[a:b], **manifest.UNPACK_OPTIONS)  # as unpack does
            except Exception:  # noqa: BLE001 - any failure: the full checks name the problem
                raise NotQuick from None
        node = self._root
        for c in trail:
            node = _unwrap(node)
            if type(node) is not tuple or not node:
                return None
            tag = node[0]
            if tag == "dict" or tag == "odict":
                if (tag == "odict" and c == METADATA) or (len(node) - first_item(tag)) % 2:
                    return None  # the metadata slot shares its path with a key of that name
                found = [v for k, v in items(node) if type(k) is type(c) and k == c]
                if len(found) != 1:
                    return None
                node = found[0]
            elif tag == "list" or tag == "tuple":
                if type(c) is not int or not 0 <= c < len(node) - 1:
                    return None
                node = node[c + 1]
            else:
                return None
        node = _unwrap(node)
        if type(node) is tuple and len(node) == 2 and node[0] == "tensor" and type(node[1]) is int \
                and 0 <= node[1] < self.count:
            return node[1]
        return None

    def _named(self, name: str) -> int | None:
        """The row stored as ``name``: found by its canonical encoding, confirmed by decoding it."""
        try:
            pattern = b"\xa4name" + msgpack.packb(name)
        except (ValueError, UnicodeEncodeError):
            return None
        rows, found = self._rows, []
        at = self.manifest.find(pattern, rows[0])
        while 0 <= at < rows[-1]:
            i = bisect.bisect_right(rows, at) - 1
            row = self._row_object(i)
            if type(row) is dict and row.get("name") == name and type(row.get("name")) is str:
                found.append(i)
            at = self.manifest.find(pattern, rows[i + 1])  # each row decoded once, however often it matches
        return found[0] if len(found) == 1 else None

    def _row_object(self, i: int) -> Any:
        try:
            return msgpack.unpackb(self.manifest[self._rows[i] : self._rows[i + 1]], **manifest.UNPACK_OPTIONS)
        except Exception:  # noqa: BLE001 - any failure: the full checks name the problem
            raise NotQuick from None

    # ------------------------------------------------------------------ proving one tensor
    def info(self, i: int) -> TensorInfo:
        """Row ``i``, validated, with its device and its header entry's offsets."""
        try:
            info = manifest._row(i, self._row_object(i), self.algorithm, digest.size(self.algorithm), {})
        except FormatError:
            raise NotQuick from None
        device = self.devices.get(i)
        if device is not None:
            if info.kind == "ndarray":
                raise NotQuick
            info.device = device
        if info.name == container.META:
            raise NotQuick
        info.begin, info.end = self._entry(info)
        return info

    def _entry(self, info: TensorInfo) -> tuple[int, int]:
        """``(begin, end)`` from the one header member for ``info``, which must be canonical."""
        raw = self.raw
        key = (encode_basestring(info.name) + _OFFSETS).encode("utf-8")
        at, where = raw.find(key), -1
        while at >= 0:
            if raw[at - 1 : at] in (b"{", b","):  # a member name, not text inside a string
                if where >= 0:
                    raise NotQuick  # twice
                where = at
            at = raw.find(key, at + 1)
        if where < 0:
            raise NotQuick
        close = raw.find(b"]", where + len(key))
        numbers = raw[where + len(key) : close].split(b",")
        if len(numbers) != 2 or not all(n.isdigit() and len(n) <= 20 for n in numbers):  # 20: < 2**64
            raise NotQuick
        begin, end = int(numbers[0]), int(numbers[1])
        dt = info.dtype
        shape = fastparse.container_shape(info)
        text = container.entry_text(info.name, dt.st, shape, begin, end).encode("utf-8")
        after = where + len(text)
        if raw[where:after] != text or raw[after : after + 1] not in (b",", b"}"):
            raise NotQuick
        nbytes = 1
        for d in info.shape:
            nbytes *= d
        if end - begin != nbytes * dt.itemsize or self.file_size is None \
                or self.data_start + end > self.file_size:
            raise NotQuick
        return begin, end

    def header(self) -> container.Header:
        """A header for reading tensors at the offsets :meth:`info` gives (no entries of its own)."""
        size = (self.file_size or self.data_start) - self.data_start
        return container.Header(len(self.raw), [], None, size, self.raw)


def _unwrap(node: Any) -> Any:
    """A registered object's state: it adds no path component (walk.py)."""
    while type(node) is tuple and len(node) == 3 and node[0] == "obj":
        node = node[2]
    return node


def _parse_path(key: str) -> tuple | None:
    """The str and int components of a path as :func:`paths.join` renders them, or None."""
    out: list = []
    pos = len(paths.ROOT)
    while pos < len(key):
        m = _COMPONENT.match(key, pos)
        if m is None:
            return None
        text = m.group(1)
        if text.startswith('"'):
            try:
                out.append(json.loads(text))
            except ValueError:
                return None
        elif len(text) > 21:  # paths.join writes ints beyond 64 bits in hex: no path has this one
            return None
        else:
            out.append(int(text))
        pos = m.end()
    trail = tuple(out)
    return trail if trail and paths.join(trail) == key else None
