"""What :func:`tensorcanon.open` checks before the whole file: enough to prove one tensor.

Checking a whole file (docs/FORMAT.md §9) costs a few microseconds per
tensor: the manifest decoded and packed again, every table row, the header
rebuilt, the object tree walked. Reading one tensor of a thousand needs far
less to be proven, so :class:`QuickIndex` checks, before ``open`` returns:

- the header length (against the limits and the file size);
- ``__metadata__`` as a canonical header holds it (as fastparse.find_metadata finds it: the
  first ``"__metadata__":{...}`` in the header's bytes, its values str, no key twice): its
  keys, no memory formats, and that the manifest its base64 holds is the one
  the recorded file digest was computed from (so every table row and the whole
  object tree are exactly what was saved);
- the manifest's outline: the top-level keys in order, the algorithm the
  digest names, a supported version, the table's length within the limits;
  the devices text in canonical form for a table of that length.

and for each tensor read, by its path or stored name (:meth:`QuickIndex.index_of`):

- the path: followed from the root, each container on the way a dict, an
  OrderedDict (by a key other than ``_metadata``, its metadata slot's path), a
  list or a tuple holding the key once (registered objects' states add no
  component), ending at a tensor node within the table and within the limits'
  max_depth; a name: the one table row whose name it is;
- its table row (:meth:`QuickIndex.info`): every check of §5.3, decoded alone
  from its bytes in the manifest; its device from the devices text (none for
  an ndarray); a name other than ``__metadata__``;
- its header member: exactly one ``"<name>":{"data_offsets":[`` that starts a
  member (after ``{`` or ``,``), whose text is exactly the canonical member for
  that row (dtype, shape as dtypes.header_shape gives it, within max_ndim,
  offsets) followed by ``,`` or ``}``, its size the row's, inside the file;
- its bytes against its row's digest (the reader, when it reads them).

So a row it gives is the row the full check gives, for every file the full
check accepts (tests/test_lazyindex_differential.py). What it does not prove is
the file as a whole: that the header is valid, canonical JSON with no other
member or key out of place, the other rows, the canonical encodings of the
manifest and its base64, the data section's size and every node of the tree.
Those are checked the first time anything needs the whole file, and a file that
fails them is refused then; a tensor whose own row, member and bytes are proven
is read before that even from such a file (damage elsewhere does not block it).
Anything unexpected raises :class:`NotQuick`; the caller then checks the whole
file as :func:`tensorcanon.load` does, which raises the precise error (or finds
the file valid after all).
"""

from __future__ import annotations

import binascii
import bisect
import dataclasses
import functools
import json
import re
import sys
from json.encoder import encode_basestring
from typing import Any

import msgpack

from ..format import container, digest, dtypes, manifest, paths
from ..format.errors import FormatError
from ..format.limits import Limits
from ..format.manifest import TensorInfo
from ..format.tree import first_item
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
        self.prefix, self.raw = prefix, raw  # (reader.CheckedFile takes them as they are: raw_header)
        self._max_ndim, self._max_depth = limits.max_ndim, limits.max_depth
        self.data_start = container.LENGTH_SIZE + len(raw)
        self.file_size = src.size
        meta, m, self._meta_span = _metadata(raw)
        if not manifest.claims(meta) or manifest.KEY_MEMORY_FORMATS in meta:
            raise NotQuick  # (channels-last tensors: rare enough to take the full check)
        try:
            manifest.check_keys(meta)
            self.algorithm, recorded = digest.parse_text(meta[manifest.KEY_DIGEST])
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
        """Where the root and the table are in the manifest; the algorithm and version.

        The rows are found as they are needed (:meth:`_row_start`): to read row 500 of 1,000,
        the first 500 are skipped, not all 1,000. The version, which follows the table, is
        read from the manifest's last bytes (``"version"`` and a positive fixint, as a canonical
        manifest ends); that the table ends exactly there is checked once every row is skipped.
        """
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
        self._table_end = len(self.manifest) - len(_VERSION_KEY) - 1
        if self._table_end < u.tell() or self.manifest[self._table_end : -1] != _VERSION_KEY \
                or self.manifest[-1] not in manifest.READABLE_VERSIONS \
                or (not self.count and u.tell() != self._table_end):
            raise NotQuick
        self._rows = [u.tell()]  # where rows 0, 1, ... start, as far as they are known
        self._u = u  # at the end of the last row known
        self._far: dict[int, int] = {}  # row -> where it starts, for rows past the last in _rows

    def _row_start(self, i: int) -> int:
        """Where row ``i`` starts (``i == count``: where the table ends), skipping the rows before
        it that are not known yet.

        Rows up to the last one known are skipped one by one (``_rows``: where each starts, which
        :meth:`_named` needs). Further on, the rows from the last known one to row ``i`` are
        skipped in one call of msgpack's C code (:func:`_skipped`), and only where row ``i``
        starts is kept (``_far``): reading row 500 of 1,000 skipped 500 rows, a Python call
        each."""
        rows = self._rows
        if i < len(rows):
            return rows[i]
        at = self._far.get(i)
        if at is not None:
            return at
        if i - len(rows) >= _FAR and i - len(rows) < 1 << 32:
            near = max((k for k in self._far if k < i), default=len(rows) - 1)
            base = self._far[near] if near >= len(rows) else rows[-1]
            near = max(near, len(rows) - 1)
            at = _skipped(self.manifest, base, i - near, self._table_end)
            if at is None or (i == self.count and at != self._table_end):
                raise NotQuick  # rows over the version, or not ending where it starts
            self._far[i] = at
            return at
        return self._dense_to(i)

    def _dense_to(self, i: int) -> int:
        """Where row ``i`` starts, every row up to it skipped one by one (and kept in ``_rows``)."""
        rows = self._rows
        if i < len(rows):
            return rows[i]
        skip, tell = self._u.skip, self._u.tell
        try:
            rows += [skip() or tell() for _ in range(i + 1 - len(rows))]  # (skip returns None)
        except Exception:  # noqa: BLE001 - msgpack raises many types for malformed input
            raise NotQuick from None
        if rows[-1] > self._table_end or (len(rows) == self.count + 1 and rows[-1] != self._table_end):
            raise NotQuick  # rows over the version, or not ending where it starts
        return rows[i]

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
        if self._root is None and len(trail) == 1 and type(trail[0]) is str and self._max_depth > 1:
            found = self._top_key(trail[0])
            if found is not None:
                return found
        if self._root is None:
            a, b = self._root_span
            try:
                self._root = msgpack.unpackb(self.manifest[a:b], **manifest.UNPACK_OPTIONS)  # as unpack does
            except Exception:  # noqa: BLE001 - any failure: the full checks name the problem
                raise NotQuick from None
        node, depth = self._root, 0  # depth: of node, counted as the decoder counts it (tagged arrays)
        for c in trail:
            node, depth = _unwrap(node, depth)
            if type(node) is not tuple or not node:
                return None
            depth += 1
            tag = node[0]
            if tag == "dict" or tag == "odict":
                if (tag == "odict" and c == METADATA) or (len(node) - first_item(tag)) % 2:
                    return None  # the metadata slot shares its path with a key of that name
                node = _value_of(node, first_item(tag), c)
                if node is _NONE:
                    return None
            elif tag == "list" or tag == "tuple":
                if type(c) is not int or not 0 <= c < len(node) - 1:
                    return None
                node = node[c + 1]
            else:
                return None
        node, depth = _unwrap(node, depth)
        if type(node) is tuple and len(node) == 2 and node[0] == "tensor" and type(node[1]) is int \
                and 0 <= node[1] < self.count and depth < self._max_depth:
            return node[1]
        return None

    def _top_key(self, key: str) -> int | None:
        """The tensor at ``$[key]`` when the root is a dict whose value at ``key`` is a tensor, found
        without decoding the root (a thousand keys: 200 µs right after a collection); None where
        that cannot be shown so (:meth:`_follow` then decodes the root).

        Shown as follows: the root's bytes hold the key's text once (so no other key of the
        root, nor anything below it, is that str: any str equal to it holds its UTF-8 bytes),
        as the canonical encoding of that str followed by a tensor node ``["tensor", i]``; and
        that encoding is the root's item ``1 + 2i`` (its ``i``-th key: a table of the canonical
        form numbers a flat dict's tensors in key order), checked by skipping the ``2i`` items
        before it in one call (:func:`_skipped`)."""
        a, b = self._root_span
        m = self.manifest
        size = _ARRAY_HEAD.get(m[a]) if b - a > 6 else None
        if size is None or m[a + size : a + size + 5] != b"\xa4dict":
            return None  # not a dict
        items = m[a] - 0x90 if size == 1 else int.from_bytes(m[a + 1 : a + size], "big")
        if not items % 2:
            return None  # an odd number of items after the tag (_follow: None)
        head = a + size + 5  # where the dict's first key starts
        text = key.encode("utf-8", "surrogatepass")
        if not text or m.count(text, a, b) != 1:
            return None
        try:
            packed = msgpack.packb(key)
        except (ValueError, UnicodeEncodeError):
            return None
        at = m.find(packed + b"\x92\xa6tensor", head, b)
        v = at + len(packed) + 8  # the tensor's index, a positive int
        if at < 0 or v >= b:
            return None
        kind = m[v]
        width = 0 if kind < 0x80 else _UINT_WIDTH.get(kind, -1)
        if width < 0 or v + width >= b:
            return None
        i = kind if not width else int.from_bytes(m[v + 1 : v + 1 + width], "big")
        if i >= self.count or 2 * i >= 1 << 32 or _skipped(m, head, 2 * i, b) != at:
            return None
        return i

    def _named(self, name: str) -> int | None:
        """The row stored as ``name``: found by its canonical encoding, confirmed by decoding it."""
        try:
            pattern = b"\xa4name" + msgpack.packb(name)
        except (ValueError, UnicodeEncodeError):
            return None
        rows, found = self._rows, []
        at = self.manifest.find(pattern, rows[0], self._table_end)
        while at >= 0:
            while rows[-1] <= at and len(rows) <= self.count:  # the rows up to the one it is in
                self._dense_to(min(len(rows) + 63, self.count))
            i = bisect.bisect_right(rows, at) - 1
            if i >= self.count:
                break  # (past the last row: the table ends before the version; _row_start checked)
            row = self._row_object(i)
            if type(row) is dict and row.get("name") == name and type(row.get("name")) is str:
                found.append(i)
            at = self.manifest.find(pattern, rows[i + 1], self._table_end)  # each row decoded once
        return found[0] if len(found) == 1 else None

    def _row_object(self, i: int) -> Any:
        lo, hi = self._row_start(i), self._row_start(i + 1)
        try:
            return msgpack.unpackb(self.manifest[lo:hi], **manifest.UNPACK_OPTIONS)
        except Exception:  # noqa: BLE001 - any failure: the full checks name the problem
            raise NotQuick from None

    # ------------------------------------------------------------------ proving one tensor
    def info(self, i: int) -> TensorInfo:
        """Row ``i``, validated, with its device and its header entry's offsets."""
        try:
            row = manifest.check_row(i, self._row_object(i), self.algorithm)
        except FormatError:
            raise NotQuick from None
        device = self.devices.get(i, "cpu")
        if (device != "cpu" and row.kind == "ndarray") or row.name == container.META:
            raise NotQuick
        begin, end = self._entry(row)
        return dataclasses.replace(row, device=device, begin=begin, end=end)

    def _entry(self, info: TensorInfo) -> tuple[int, int]:
        """``(begin, end)`` from the one header member for ``info`` (a row without offsets yet),
        which must be canonical."""
        raw = self.raw
        key = (encode_basestring(info.name) + _OFFSETS).encode("utf-8")
        # Not looked for inside __metadata__ (its first ``}`` ends it: no member starts there), which
        # is most of the header: its values are JSON strs (no unescaped ``"``), which the key has.
        meta_at, meta_end = self._meta_span
        where = -1
        for lo, hi in ((0, meta_at), (meta_end, len(raw))):
            at = raw.find(key, lo, hi)
            while at >= 0:
                if raw[at - 1 : at] in (b"{", b","):  # a member name, not text inside a string
                    if where >= 0:
                        raise NotQuick  # twice
                    where = at
                at = raw.find(key, at + 1, hi)
        if where < 0:
            raise NotQuick
        close = raw.find(b"]", where + len(key))
        numbers = raw[where + len(key) : close].split(b",")
        if len(numbers) != 2 or not all(n.isdigit() and len(n) <= 20 for n in numbers):  # 20: < 2**64
            raise NotQuick
        begin, end = int(numbers[0]), int(numbers[1])
        dt = info.dtype
        shape = dtypes.header_shape(dt, info.shape)
        if len(shape) > self._max_ndim:
            raise NotQuick
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


_NONE = object()
# The first byte of an array's header (fixarray, array 16, array 32) -> the header's size (_top_key).
_ARRAY_HEAD = {**{0x90 + n: 1 for n in range(16)}, 0xDC: 3, 0xDD: 5}
_UINT_WIDTH = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
_FAR = 16  # rows past the last known from which they are skipped in one call (_skipped)


def _skipped(m: bytes, at: int, n: int, end: int) -> int | None:
    """Where the ``n``-th msgpack value from offset ``at`` of ``m`` ends (None: the values do not
    all end before ``end``, or are malformed): skipped in one call, as the elements of an array
    of ``n`` (an array header, then the values)."""
    head = b"\xdd" + n.to_bytes(4, "big")
    u = msgpack.Unpacker(max_buffer_size=len(head) + end - at, **manifest.UNPACK_OPTIONS)
    try:
        u.feed(head)
        u.feed(memoryview(m)[at:end])
        u.skip()
    except Exception:  # noqa: BLE001 - msgpack raises many types for malformed input
        return None
    return at + u.tell() - len(head)


def _value_of(node: tuple, start: int, key: Any) -> Any:
    """The value of the one key of the mapping node ``node`` (pairs from ``start``) that is ``key``
    and of its type; :data:`_NONE` when there is no such key or more than one. (Found in C: a file
    of a thousand tensors has a thousand keys to look through.)"""
    keys = node[start::2]
    n = keys.count(key)  # every key == key: of its type or another (1 == 1.0 == True)
    if n == 0:
        return _NONE
    at = keys.index(key)
    if n != 1 or type(keys[at]) is not type(key):
        # another type equal to it, or a repeat: the general rule (a key of its type, exactly once)
        found = [v for k, v in zip(keys, node[start + 1 :: 2], strict=False) if type(k) is type(key) and k == key]
        return found[0] if len(found) == 1 else _NONE
    return node[start + 1 + 2 * at]


_META_OPEN = b'"' + container.META.encode("ascii") + b'":{'
_PAIRS = json.JSONDecoder(object_pairs_hook=tuple)  # an object's (key, value) pairs, repeats kept
_VERSION_KEY = msgpack.packb("version")  # what a manifest ends with, but for the version's one byte
_MANIFEST_AT = b'"' + manifest.KEY_MANIFEST.encode("ascii") + b'":"'


def _metadata(raw: bytes) -> tuple[dict[str, str], bytes, tuple[int, int]]:
    """``(__metadata__ without the manifest's text, the manifest's bytes, where the object's
    ``"__metadata__":{`` starts and its ``}`` is)`` of header bytes as a canonical header holds
    them (:func:`fastparse.find_metadata`), else :class:`NotQuick`.

    The manifest's base64 text (most of the header: 150 KB for a thousand tensors) is decoded
    where it lies in ``raw``, not decoded as JSON first: the rest of the object is decoded as JSON
    with that value left empty (``""``), which must then be the value the object holds for the
    manifest's key (a JSON string holds no unescaped ``"``, and base64 holds no ``\\``, so the text
    between the quotes is the value JSON would give)."""
    at = raw.find(_META_OPEN)
    end = raw.find(b"}", at) if at >= 0 else -1
    key = raw.find(_MANIFEST_AT, at, end) if end >= 0 else -1
    if raw[:1] != b"{" or key < 0:
        raise NotQuick
    lo = key + len(_MANIFEST_AT)
    hi = raw.find(b'"', lo, end)
    if hi < 0:
        raise NotQuick
    rest = raw[at + len(_META_OPEN) - 1 : lo] + raw[hi : end + 1]
    try:
        pairs = _PAIRS.decode(rest.decode("utf-8"))  # (a canonical header is UTF-8)
        meta = dict(pairs) if type(pairs) is tuple else None
        if meta is None or len(meta) != len(pairs) or meta.get(manifest.KEY_MANIFEST) != "" \
                or not all(type(v) is str for v in meta.values()):
            raise NotQuick  # (a key twice: the full check names it)
        return meta, _b64decode(memoryview(raw)[lo:hi]), (at, end)
    except (ValueError, RecursionError):  # (binascii.Error is a ValueError)
        raise NotQuick from None


def _b64decode(text: memoryview) -> bytes:
    """The bytes of base64 ``text`` (RFC 4648 standard alphabet, ``=`` padding, nothing else), else
    a ValueError (``binascii.Error``).

    CPython decodes base64 a character at a time: 300 µs for the 150 KB of a thousand tensors'
    manifest, the largest part of opening their file. Where pybase64 is installed (the ``fast``
    extra) its vectorized decoder takes 10-40 µs; with ``validate=True`` it refuses what binascii's
    strict mode refuses in every case tested (tests/test_hashing_paths.py), and some text that
    binascii accepts (``AAAA===``), which the full check then decides. A decoding that differed
    would be caught all the same: the bytes decoded are hashed against the file digest."""
    fast = _fast_b64()
    if fast is not None:
        return fast(text, validate=True)
    if sys.version_info >= (3, 11):
        return binascii.a2b_base64(text, strict_mode=True)
    import base64  # (Python 3.10: no strict mode in binascii)

    return base64.b64decode(text, validate=True)


@functools.cache
def _fast_b64() -> Any:
    """pybase64's ``b64decode`` where it is installed, else None."""
    try:
        import pybase64
    except ImportError:
        return None
    return pybase64.b64decode


def _unwrap(node: Any, depth: int) -> tuple[Any, int]:
    """A registered object's state, and its depth: it adds no path component (walk.py), but its
    ``obj`` node is one level of the tree."""
    while type(node) is tuple and len(node) == 3 and node[0] == "obj":
        node, depth = node[2], depth + 1
    return node, depth


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
