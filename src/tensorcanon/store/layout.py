"""The store's layout (docs/STORE.md, "Layout"): object names, blob headers, tag records.

Every rule a reader of a store checks lives here, used by the writer and every reader:
which names are tags, blobs, markers; how a blob's header is written and what a reader
requires of it before it allocates anything; what a tag record holds. Nothing here does
I/O: backend.py moves bytes, compress.py turns payloads into tensor bytes, store.py puts
them together (tagfile.py, its load side, reads a tag's blobs back as a file).
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass

from ..format import container, digest, dtypes
from ..format.errors import FormatError, UsageError

#: The layout version (docs/STORE.md) this tensorcanon writes: the marker object holds it. Layout 2
#: added packs (many blobs in one object); a layout-1 store is a layout-2 store without packs.
LAYOUT = 2
#: The layouts this tensorcanon reads.
LAYOUTS = (1, 2)
#: The marker object at the root of every store, and its exact content per layout.
MARKER = "tensorcanon-store"
MARKER_TEXTS = {v: f"tensorcanon-store layout {v}\n".encode() for v in LAYOUTS}
MARKER_TEXT = MARKER_TEXTS[LAYOUT]
#: The version a tag record's ``layout`` field holds: records are unchanged since layout 1.
RECORD_LAYOUT = 1
#: The version byte of every blob header: blobs are unchanged since layout 1, in a pack or not.
BLOB_VERSION = 1
#: The digest algorithm of every blob name and tag record (the format's default, fingerprint's).
ALGORITHM = digest.DEFAULT
DIGEST_SIZE = digest.size(ALGORITHM)

#: Rewritten (a random token) by every collection when it ends: a saver that sees another token than at
#: its last save knows blobs may have gone since, and forgets which ones it believed present.
EPOCH = "gc-epoch"
BLOBS = f"blobs/{ALGORITHM}"
PACKS = "packs"
PACK_SUFFIX = ".pack"
TAGS = "tags"
PENDING = "pending"
GC = "gc"
TMP = "tmp"
RECORD_SUFFIX = ".safetensors"
RECORD_FORMAT = "tensorcanon-store-tag"

#: Tag names: 1 to 200 characters of ``A-Z a-z 0-9 . _ -``, the first not a ``.`` (so no tag is
#: a hidden file, ``.`` or ``..``). Nothing else reaches a path, so no tag names a path outside the root.
TAG_RE = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9._\-]{0,199}\Z")
_HEX = re.compile(rf"[0-9a-f]{{{2 * DIGEST_SIZE}}}\Z")
#: Marker names (pending saves, running collections): ``<host>.<pid>.<random hex>``.
MARKER_RE = re.compile(r"([A-Za-z0-9_\-]{1,64})\.([0-9]{1,10})\.([0-9a-f]{16})\Z")


def check_tag(tag: object) -> str:
    """``tag`` if it is a valid tag name, else a :class:`UsageError` saying what a tag may hold."""
    if not isinstance(tag, str) or TAG_RE.match(tag) is None:
        raise UsageError(
            f"{tag!r} is not a tag name: a tag is 1 to 200 characters of A-Z a-z 0-9 . _ - and does "
            "not start with '.' (e.g. 'step-000100'); it names a file in the store, so nothing else is allowed")
    return tag


def tag_path(tag: str) -> str:
    return f"{TAGS}/{check_tag(tag)}{RECORD_SUFFIX}"


def tag_of(name: str) -> str | None:
    """The tag a name under ``tags/`` stands for (the file name), or None for any other name."""
    if not name.endswith(RECORD_SUFFIX):
        return None
    tag = name[: -len(RECORD_SUFFIX)]
    return tag if TAG_RE.match(tag) else None


def blob_path(raw: bytes) -> str:
    """The object name of the blob of tensor digest ``raw``: ``blobs/xxh3-128/ab/ab…``."""
    h = raw.hex()
    return f"{BLOBS}/{h[:2]}/{h}"


def blob_digest(name: str) -> bytes | None:
    """The digest a blob's name (its last two components ``ab/ab…``) stands for, or None."""
    parts = name.rsplit("/", 2)
    if len(parts) < 2 or not _HEX.match(parts[-1]) or parts[-2] != parts[-1][:2]:
        return None
    return bytes.fromhex(parts[-1])


def pack_path(raw: bytes) -> str:
    """The object name of the pack whose bytes hash to ``raw``: ``packs/<hex>.pack``."""
    return f"{PACKS}/{raw.hex()}{PACK_SUFFIX}"


def pack_digest(name: str) -> bytes | None:
    """The digest a pack's name (``packs/<hex>.pack``) stands for, or None for any other name."""
    folder, _, last = name.rpartition("/")
    if folder != PACKS or not last.endswith(PACK_SUFFIX) or not _HEX.match(last[: -len(PACK_SUFFIX)]):
        return None
    return bytes.fromhex(last[: -len(PACK_SUFFIX)])


def show(raw: bytes) -> str:
    return digest.to_text(raw, ALGORITHM)


# --------------------------------------------------------------------------- blobs

MAGIC = b"tcstore" + bytes([BLOB_VERSION])
# --- storecodec: codecs 4 delta-sub and 5 delta-twos (docs/STORE.md, "Blobs") ---
RAW, ZSTD, GROUPED, DELTA, DELTA_SUB, DELTA_TWOS = 0, 1, 2, 3, 4, 5
CODECS = {RAW: "raw", ZSTD: "zstd", GROUPED: "grouped", DELTA: "delta", DELTA_SUB: "delta-sub",
          DELTA_TWOS: "delta-twos"}
#: The codecs whose blob is a delta against a base blob (a base digest, a depth of 1 or more).
DELTAS = frozenset({DELTA, DELTA_SUB, DELTA_TWOS})
#: The codecs whose payload is a plane table and planes.
PLANED = frozenset({GROUPED, DELTA, DELTA_SUB, DELTA_TWOS})
#: The element sizes a delta-sub or delta-twos blob may have (its elements are unsigned integers).
SUB_SIZES = frozenset({1, 2, 4, 8})
# --- end storecodec ---
STORED, PLANE_ZSTD = 0, 1
#: The fixed part of a blob header: magic, codec, depth, prefix length, decoded size.
_FIXED = struct.Struct("<8sBBHQ")
_PLANE = struct.Struct("<B7xQ")
PAYLOAD_ALIGN = 64
#: The most links a reader follows from a delta blob to a full one (docs/STORE.md).
MAX_DEPTH = 64
#: The most bytes one zstd frame can decode to per byte it holds: every block of a frame takes at
#: least 4 bytes (a 3-byte block header and one byte) and decodes to at most 128 KiB.
ZSTD_MAX_RATIO = 32768
#: Prefix texts are at most this long: a dtype name and 64 dimensions of at most 20 digits.
MAX_PREFIX = 1400


@dataclass(frozen=True)
class BlobHeader:
    """What a blob's header says, every field checked (:func:`parse_header`)."""

    codec: int
    depth: int
    prefix: bytes          # b"float32[3,4]": the tensor digest's first input
    dtype: dtypes.DType
    shape: tuple[int, ...]
    size: int              # decoded bytes
    base: bytes | None     # a delta blob's base digest
    payload: int           # where the payload starts
    planes: tuple[tuple[int, int, int], ...]  # grouped, delta: (codec, start, length) per plane

    @property
    def codec_name(self) -> str:
        return CODECS[self.codec]


_PREFIX = re.compile(rb"([a-z0-9_]{1,40})\[((?:0|[1-9][0-9]{0,19})(?:,(?:0|[1-9][0-9]{0,19}))*)?\]")


def parse_prefix(text: bytes, where: str) -> tuple[dtypes.DType, tuple[int, ...]]:
    """The dtype and shape of a prefix text ``dtype[d0,d1,…]``, written exactly as the tensor digest's."""
    m = _PREFIX.fullmatch(text)
    row = dtypes.BY_NAME.get(m.group(1).decode("ascii")) if m else None
    if m is None or row is None:
        raise FormatError(f"{where}: its header names no tensor ({text[:80]!r} is not a dtype and a shape, "
                          "as 'float32[3,4]')")
    shape = tuple(int(d) for d in m.group(2).split(b",")) if m.group(2) else ()
    if len(shape) > 64:
        raise FormatError(f"{where}: its header claims {len(shape)} dimensions, more than 64")
    if container.too_large(shape, row.itemsize):
        raise FormatError(f"{where}: its header claims a tensor of 2^63 bytes or more ({text[:80]!r})")
    return row, shape


def header_bytes(codec: int, depth: int, prefix: bytes, size: int, base: bytes | None,
                 planes: list[tuple[int, int]] | None) -> bytes:
    """A blob's header, padding included (the payload follows it)."""
    out = bytearray(_FIXED.pack(MAGIC, codec, depth, len(prefix), size))
    out += prefix
    if base is not None:
        out += base
    out += bytes(-len(out) % PAYLOAD_ALIGN)
    if planes is not None:
        for plane_codec, length in planes:
            out += _PLANE.pack(plane_codec, length)
    return bytes(out)


def header_room(prefix: bytes, base: bool) -> int:
    """Bytes of a blob's header before its plane table: where a raw or zstd payload starts."""
    n = _FIXED.size + len(prefix) + (DIGEST_SIZE if base else 0)
    return n + (-n % PAYLOAD_ALIGN)


#: Bytes a reader fetches first from a blob: the whole header of any blob (prefix, base, 16 planes).
HEAD = _FIXED.size + MAX_PREFIX + DIGEST_SIZE + PAYLOAD_ALIGN + 16 * _PLANE.size


def parse_header(head: bytes, total: int, where: str) -> BlobHeader:
    """Check the header at the start of a blob of ``total`` bytes (``head``: its first bytes, at
    least :data:`HEAD` of them when the blob is that long) and return what it says.

    Every size is bounded here by the blob's own length before anything is allocated for it: a
    raw payload is exactly the decoded size, a zstd frame decodes to at most
    :data:`ZSTD_MAX_RATIO` times its length, the plane table ends the blob exactly.
    """
    if len(head) < _FIXED.size:
        raise FormatError(f"{where}: {total} bytes, too short for a blob header (at least {_FIXED.size})")
    magic, codec, depth, plen, size = _FIXED.unpack_from(head)
    if magic != MAGIC:
        if magic[:7] == MAGIC[:7]:
            raise FormatError(f"{where}: a blob of version {magic[7]}, which this tensorcanon does not read "
                              f"(it reads blob version {BLOB_VERSION}); a newer tensorcanon is needed")
        raise FormatError(f"{where}: not a blob of a tensorcanon store (it does not start with {MAGIC!r})")
    if codec not in CODECS:
        raise FormatError(f"{where}: unknown codec {codec} (known: {sorted(CODECS)})", offset=8)
    if plen > MAX_PREFIX or _FIXED.size + plen > len(head):
        raise FormatError(f"{where}: its prefix text claims {plen} bytes, more than the header holds", offset=10)
    prefix = bytes(head[_FIXED.size : _FIXED.size + plen])
    row, shape = parse_prefix(prefix, where)
    if size != math.prod(shape) * row.itemsize:
        raise FormatError(f"{where}: its header claims {size} decoded bytes, but {prefix.decode()} holds "
                          f"{math.prod(shape) * row.itemsize}", offset=12)
    is_delta = codec in DELTAS  # (storecodec: delta, delta-sub, delta-twos)
    if is_delta != (depth > 0):
        raise FormatError(f"{where}: depth {depth} with codec {CODECS[codec]} (a delta blob has depth 1 to "
                          f"{MAX_DEPTH}, every other depth 0)", offset=9)
    if depth > MAX_DEPTH:
        raise FormatError(f"{where}: a delta chain of depth {depth}, more than {MAX_DEPTH}", offset=9)
    if codec in (DELTA_SUB, DELTA_TWOS) and row.itemsize not in SUB_SIZES:  # (storecodec)
        raise FormatError(f"{where}: a {CODECS[codec]} blob of {prefix.decode()}, whose elements are "
                          f"{row.itemsize} bytes ({CODECS[codec]} takes 1, 2, 4 or 8)", offset=8)
    at = _FIXED.size + plen
    base = None
    if is_delta:
        base = bytes(head[at : at + DIGEST_SIZE])
        if len(base) != DIGEST_SIZE:
            raise FormatError(f"{where}: the header ends inside its base digest", offset=at)
        at += DIGEST_SIZE
    pad = -at % PAYLOAD_ALIGN
    if bytes(head[at : at + pad]) != bytes(pad) or at + pad > total:
        raise FormatError(f"{where}: its header padding is not {pad} zero bytes", offset=at)
    at += pad
    planes: list[tuple[int, int, int]] = []
    if codec in PLANED:  # (storecodec: delta-sub and delta-twos too)
        k = row.itemsize
        table_end = at + k * _PLANE.size
        if table_end > len(head) or table_end > total:
            raise FormatError(f"{where}: the blob ends inside its plane table", offset=at)
        start = table_end
        plane_size = size // k
        for i in range(k):
            plane_codec, length = _PLANE.unpack_from(head, at + i * _PLANE.size)
            if bytes(head[at + i * _PLANE.size + 1 : at + i * _PLANE.size + 8]) != bytes(7):
                raise FormatError(f"{where}: plane {i}'s reserved bytes are not zero", offset=at + i * _PLANE.size)
            if plane_codec == STORED:
                if length != plane_size:
                    raise FormatError(f"{where}: stored plane {i} holds {length} bytes, not {plane_size}")
            elif plane_codec == PLANE_ZSTD:
                if not 0 < length <= total or plane_size > length * ZSTD_MAX_RATIO:
                    raise FormatError(f"{where}: zstd plane {i} of {length} bytes cannot decode to {plane_size}")
            else:
                raise FormatError(f"{where}: plane {i} has unknown codec {plane_codec}")
            planes.append((plane_codec, start, length))
            start += length
        end = start
    elif codec == RAW:
        end = at + size
    else:  # ZSTD: one frame, the rest of the blob
        end = total
        if total <= at or size > (total - at) * ZSTD_MAX_RATIO:
            raise FormatError(f"{where}: a zstd payload of {total - at} bytes cannot decode to {size} bytes")
    if end != total:
        raise FormatError(f"{where}: the blob is {total} bytes but its header accounts for {end}; it is "
                          "truncated or has trailing bytes")
    return BlobHeader(codec, depth, prefix, row, shape, size, base, at, tuple(planes))


# --------------------------------------------------------------------------- tag records


def record_object(tag: str, header: bytes) -> dict:
    """The object a tag record holds (saved with tensorcanon.dumps): the tag, and the header
    (length prefix included) of the file ``tensorcanon.save`` writes for the tagged object."""
    return {"format": RECORD_FORMAT, "header": header, "layout": RECORD_LAYOUT, "tag": tag}


def record_header(obj: object, tag: str, where: str) -> bytes:
    """The header a loaded tag record holds, after checking every field of it."""
    if type(obj) is not dict or sorted(obj) != ["format", "header", "layout", "tag"]:
        raise FormatError(f"{where}: not a tag record (its object is not a dict of format, header, layout, tag)")
    if obj["format"] != RECORD_FORMAT:
        raise FormatError(f"{where}: format {obj['format']!r:.60}, not {RECORD_FORMAT!r}")
    if type(obj["layout"]) is not int or obj["layout"] != RECORD_LAYOUT:
        raise FormatError(f"{where}: layout {obj['layout']!r:.30}; this tensorcanon reads records of layout "
                          f"{RECORD_LAYOUT} (a newer tensorcanon is needed)")
    if obj["tag"] != tag:
        raise FormatError(f"{where}: the record is of tag {obj['tag']!r:.220}, not {tag!r}: a record was "
                          "renamed or copied; delete it or save the tag again")
    header = obj["header"]
    if type(header) is not bytes or len(header) < container.LENGTH_SIZE + 2:
        raise FormatError(f"{where}: its header is not bytes of a file header")
    n = int.from_bytes(header[: container.LENGTH_SIZE], "little")
    if n + container.LENGTH_SIZE != len(header):
        raise FormatError(f"{where}: its header claims {n} bytes but holds {len(header) - container.LENGTH_SIZE}")
    return header


# --------------------------------------------------------------------------- packs

#: A pack starts with this magic (the layout that introduced packs), then zero bytes up to byte 64,
#: and ends with its trailer.
PACK_MAGIC = b"tcspack" + bytes([2])
PACK_HEADER = PACK_MAGIC + bytes(PAYLOAD_ALIGN - len(PACK_MAGIC))
#: An index entry: the blob's digest, its offset in the pack, its length.
_ENTRY = struct.Struct(f"<{DIGEST_SIZE}sQQ")
ENTRY_SIZE = _ENTRY.size
#: The trailer, the pack's last bytes: the index's offset, the entry count, 8 zero bytes, the magic.
_TRAILER = struct.Struct("<QQ8x8s")
TRAILER_SIZE = _TRAILER.size
#: The most entries a pack may hold (a writer starts another pack at this many): bounds what a
#: reader allocates for an index it has not checked yet.
MAX_PACK_ENTRIES = 1 << 20


@dataclass(frozen=True)
class PackIndex:
    """What a pack's trailer and index say, every entry checked (:func:`parse_pack_index`)."""

    size: int                                  # the pack's length in bytes
    index_at: int                              # where its index starts
    entries: dict[bytes, tuple[int, int]]      # blob digest -> (offset, length)


def pack_tail(entries: list[tuple[bytes, int, int]], index_at: int) -> bytes:
    """A pack's index and trailer, for blobs ``(digest, offset, length)`` (any order) and an index
    starting at ``index_at`` (the end of the last blob)."""
    rows = sorted(entries)
    out = bytearray()
    for raw, offset, length in rows:
        out += _ENTRY.pack(raw, offset, length)
    out += _TRAILER.pack(index_at, len(rows), PACK_MAGIC)
    return bytes(out)


def pack_trailer(tail: bytes, size: int, where: str) -> tuple[int, int]:
    """The index offset and entry count the trailer at the end of ``tail`` (a pack's last bytes, at
    least :data:`TRAILER_SIZE` of them where the pack is that long) states, checked against the
    pack's ``size`` before anything is allocated for them."""
    if size < len(PACK_HEADER) + TRAILER_SIZE or len(tail) < TRAILER_SIZE:
        raise FormatError(f"{where}: {size} bytes, too short for a pack (a header of {len(PACK_HEADER)} and a "
                          f"trailer of {TRAILER_SIZE} bytes at least)")
    index_at, count, magic = _TRAILER.unpack_from(tail, len(tail) - TRAILER_SIZE)
    at = size - TRAILER_SIZE
    if magic != PACK_MAGIC:
        raise FormatError(f"{where}: its trailer does not end with {PACK_MAGIC!r}: not a pack, or a truncated one",
                          offset=at + 24)
    if bytes(tail[len(tail) - TRAILER_SIZE + 16 : len(tail) - 8]) != bytes(8):
        raise FormatError(f"{where}: its trailer's reserved bytes are not zero", offset=at + 16)
    if not 1 <= count <= MAX_PACK_ENTRIES:
        raise FormatError(f"{where}: its trailer claims {count} blobs (a pack holds 1 to {MAX_PACK_ENTRIES})",
                          offset=at + 8)
    if index_at != size - TRAILER_SIZE - count * ENTRY_SIZE or index_at < len(PACK_HEADER):
        raise FormatError(f"{where}: its trailer puts an index of {count} entries at byte {index_at}, but the pack "
                          f"is {size} bytes (the index must end where the trailer starts); it is truncated or "
                          "damaged", offset=at)
    return index_at, count


def parse_pack_index(index: bytes, index_at: int, count: int, size: int, where: str) -> PackIndex:
    """Check a pack's index (``count`` entries read at ``index_at``) and return it: entries sorted
    by digest with no two equal, every blob 64-byte aligned inside the pack's blob area (after
    its header, before its index), no two blobs overlapping."""
    if len(index) != count * ENTRY_SIZE:
        raise FormatError(f"{where}: its index is {len(index)} bytes, not {count * ENTRY_SIZE}", offset=index_at)
    entries: dict[bytes, tuple[int, int]] = {}
    previous = b""
    spans = []
    for i, (raw, offset, length) in enumerate(_ENTRY.iter_unpack(index)):
        at = index_at + i * ENTRY_SIZE
        if raw <= previous:
            raise FormatError(f"{where}: index entry {i} ({show(raw)}) is not after the one before it (entries are "
                              "sorted by digest, each digest once)", offset=at)
        previous = raw
        if offset % PAYLOAD_ALIGN or offset < len(PACK_HEADER) or length < _FIXED.size \
                or length > index_at - offset:
            raise FormatError(f"{where}: index entry {i} ({show(raw)}) puts a blob of {length} bytes at byte "
                              f"{offset}, outside the pack's blobs (bytes {len(PACK_HEADER)} to {index_at}, each "
                              f"blob at a multiple of {PAYLOAD_ALIGN})", offset=at)
        entries[raw] = (offset, length)
        spans.append((offset, length, raw))
    spans.sort()
    for (o1, n1, r1), (o2, _, r2) in zip(spans, spans[1:], strict=False):
        if o1 + n1 > o2:
            raise FormatError(f"{where}: the blobs {show(r1)} and {show(r2)} overlap (bytes {o1} to {o1 + n1} and "
                              f"from {o2})")
    return PackIndex(size, index_at, entries)
