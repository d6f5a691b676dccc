"""Checking a canonical tensorcanon header in one pass.

A tensorcanon header is fully determined by its manifest: the table gives
every tensor's name, dtype and shape, hence the data order and the offsets,
and the writer serializes them one way only (docs/FORMAT.md §2, §9.2 item 8).
So a reader need not parse the header's JSON member by member: it decodes
``__metadata__``, makes every manifest check (the same functions the full
parse uses), rebuilds the header the writer would have written and compares
bytes. Equal bytes prove every check of §9.1 on the header at once (valid
UTF-8 JSON, no repeated keys, known dtypes, offsets in order with no gap or
overlap) and the header/table cross-check of §9.2; the file size and the
limits are checked here as well.

Anything else (a plain safetensors file, a damaged or non-canonical header)
returns None, and the caller runs the full parse (container.parse_raw, then
manifest.parse), which raises the precise error in the order §9 gives. This
pass therefore accepts exactly the files the full parse accepts: it only
skips work on those that pass.
"""

from __future__ import annotations

import json

from . import container, manifest
from .errors import TensorCanonError
from .limits import Limits

_META_OPEN = b'"' + container.META.encode("ascii") + b'":{'


def parse(prefix: bytes, raw: bytes, file_size: int | None,
          limits: Limits) -> tuple[container.Header, manifest.Manifest] | None:
    """``(header, manifest)`` of a canonical tensorcanon header, or None (run the full parse).

    ``prefix`` and ``raw`` are the length prefix and header bytes
    (:func:`container.read_raw`); ``file_size`` is None for a stream.
    """
    metadata = find_metadata(raw)
    if metadata is None or not manifest.claims(metadata):
        return None
    try:
        m = manifest.read(metadata, limits)  # decode and read_table, in one pass
        infos = m.tensors
        manifest.apply_metadata(infos, metadata, m.version)
        built, data_size = manifest.canonical_header(infos, metadata)
    except (TensorCanonError, RecursionError, MemoryError):
        return None
    if built[: len(prefix)] != prefix or memoryview(built)[len(prefix) :] != raw:  # (no copy of raw)
        return None
    if file_size is not None and container.LENGTH_SIZE + len(raw) + data_size != file_size:
        return None  # truncated or trailing bytes: the full parse says which
    max_ndim = limits.max_ndim
    for info in infos:
        # A row named "__metadata__" would be a repeated header key, which the full parse refuses.
        if len(info.shape) + (not info.dtype.native) > max_ndim or info.name == container.META:
            return None

    def entries() -> list[container.Entry]:
        return [container.Entry(i.name, i.dtype.st, tuple(container_shape(i)), i.begin, i.end)
                for i in sorted(infos, key=lambda r: r.begin)]

    header = container.Header(len(raw), None, metadata, data_size, built, make_entries=entries)
    return header, m


def find_metadata(raw: bytes) -> dict[str, str] | None:
    """The ``__metadata__`` object of header bytes as a canonical header holds it, else None.

    In a canonical header the metadata values (base64, digest text, devices
    text) hold no ``}``, so the object ends at the next one. What this returns
    for any other header is only a guess, which a caller must confirm (the
    comparison in :func:`parse`, the manifest digest in lazyindex.py).
    """
    if raw[:1] != b"{":
        return None
    at = raw.find(_META_OPEN)
    end = raw.find(b"}", at) if at >= 0 else -1
    if end < 0:
        return None
    try:
        metadata = json.loads(raw[at + len(_META_OPEN) - 1 : end + 1])
    except (ValueError, RecursionError):
        return None
    if type(metadata) is not dict or not all(type(v) is str for v in metadata.values()):
        return None
    return metadata


def container_shape(info: manifest.TensorInfo) -> tuple[int, ...]:
    """The shape the header records for a table row (§4.1: an extra dimension for U8-stored dtypes)."""
    return info.shape if info.dtype.native else (*info.shape, info.dtype.itemsize)
