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

from . import container, dtypes, manifest
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
        m = manifest.read_file(metadata, limits)  # decode, read_table and the devices, in one pass
        infos = m.tensors
        built, data_size = manifest.canonical_header(infos, metadata)
    except (TensorCanonError, RecursionError, MemoryError):
        return None
    if built[: len(prefix)] != prefix or memoryview(built)[len(prefix) :] != raw:  # (no copy of raw)
        return None
    if file_size is not None and container.LENGTH_SIZE + len(raw) + data_size != file_size:
        return None  # truncated or trailing bytes: the full parse says which
    max_ndim = limits.max_ndim
    header_shape = dtypes.header_shape
    for info in infos:
        # The header's shape has at most one dimension more than the row's, so only a row of
        # max_ndim dimensions or more can exceed the limit. A row named "__metadata__" would be a
        # repeated header key, which the full parse refuses.
        if (len(info.shape) >= max_ndim and len(header_shape(info.dtype, info.shape)) > max_ndim) \
                or info.name == container.META:
            return None

    def entries() -> list[container.Entry]:
        return [container.Entry(i.name, i.dtype.st, dtypes.header_shape(i.dtype, i.shape), i.begin, i.end)
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

