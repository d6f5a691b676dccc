"""Sharded checkpoints kept in a :class:`tensorcanon.Store` (docs/DISTRIBUTED.md, "In a store"): the
writing side, and the one-process functions for a :class:`StoreTag`.

``tcd.save(state, tcd.StoreTag(store, "step100"))`` writes what ``tcd.save(state, dir)`` writes,
without writing the same tensor twice: each rank stores its rank file's tensors as blobs of the
store (content-addressed: a chunk saved again at the next step, or held by two ranks, is stored
once, and compressed where that pays), and the coordinator then writes one record, last, as the
directory save writes its index last. What the record holds, and how it is read (by this package,
and by the store's own tools, which show such a tag as the checkpoint it is), is
tensorcanon/store/sharded.py's: one reader for both. Loading, verifying and consolidating read the
checkpoint through its rank files: every function of tensorcanon.dcp that takes a checkpoint
directory takes a :class:`StoreTag`.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any

from ..format import dtypes
from ..format.errors import UsageError
from ..format.limits import DEFAULT, Limits
from ..format.tensorbytes import Stored
from ..format.tree import items
from ..io import writer
from ..sharded import read
from ..store import Store, layout as store_layout
from ..store.sharded import (  # noqa: F401 - the reading side, used from here by the reader and tests
    ALGORITHM,
    FORMAT,
    LAYOUT,
    Record,
    check_blob_list,
    checked_index,
    export,
    read_record,
    store_index,
)


class StoreTag:
    """A sharded checkpoint kept in a :class:`tensorcanon.Store` under ``tag``.

    Pass it wherever tensorcanon.dcp takes a checkpoint directory: ``save``, ``async_save``,
    ``load``, ``load_unsharded``, ``consolidate``, ``verify``, ``logical_digest``, ``Writer``,
    ``Reader``. ``store`` is a ``Store`` or its root (a folder or URL; ``storage_options`` for fsspec).

    Example::

        store = tensorcanon.Store("ckpts")
        digest = tcd.save(state, tcd.StoreTag(store, "step100"))   # every rank; tensors stored once
        tcd.load(state, tcd.StoreTag(store, "step100"))            # any world size
    """

    def __init__(self, store: Store | str | os.PathLike[str], tag: str, *, storage_options: Any = None) -> None:
        if isinstance(store, Store):
            if storage_options is not None:
                raise UsageError("StoreTag: storage_options go to the Store (tensorcanon.Store(root, "
                                 "storage_options)), not with a Store object")
            self.store = store
        elif isinstance(store, (str, os.PathLike)):
            self.store = Store(store, storage_options)
        else:
            raise UsageError(f"StoreTag: expected a tensorcanon.Store or a store's root (a folder or URL), "
                             f"not {type(store).__name__}")
        if type(tag) is not str:
            raise UsageError(f"StoreTag: the tag must be a str, not {type(tag).__name__}")
        self.tag = store_layout.check_tag(tag)

    def __repr__(self) -> str:
        return f"tensorcanon.dcp.StoreTag({self.store.root!r}, {self.tag!r})"

    def __str__(self) -> str:
        return f"tag {self.tag!r} of the store {self.store.root!r}"

    def __reduce__(self) -> Any:
        raise UsageError("a StoreTag cannot be sent to another process (its Store holds open state): "
                         "use async_save's thread executor with a store")

    def exists(self) -> bool:
        return self.tag in self.store.tags()


def refuse_options(target: StoreTag, storage_options: Any, call: str) -> None:
    if storage_options is not None:
        raise UsageError(f"{call}: storage_options go to the Store of a StoreTag "
                         "(tensorcanon.Store(root, storage_options)), not to this call")


# ---------------------------------------------------------------------------- saving


@dataclass
class RankWrite:
    """What one rank wrote into the store: its rank file's digest and header, and its blobs."""

    file_digest: str
    header: bytes
    chunk_digests: dict[str, bytes]                    # top-level key -> tensor digest
    blobs: list[tuple[bytes, str, tuple[int, ...]]]    # (digest, dtype name, shape), tensors with bytes


def write_rank(target: StoreTag, obj: dict, algorithm: str, limits: Limits) -> RankWrite:
    """Store rank file ``obj``'s tensors as blobs (durable when this returns; no record)."""
    if algorithm != ALGORITHM:
        raise UsageError(f"a checkpoint in a store uses {ALGORITHM} digests (the store names its blobs by them), "
                         f"not {algorithm}: save with algorithm={ALGORITHM!r}")
    p = writer.plan(obj, None, limits, algorithm)
    file_digest, header = target.store._put(p, None)
    digests = {}
    for key, node in items(p.root):  # a flat dict: key -> node
        if type(node) is list and node and node[0] == "tensor":
            digests[key] = p.tensors[node[1]].digest
    blobs = [(s.digest, s.dtype.name, tuple(s.shape)) for s in p.ordered if s.nbytes]
    return RankWrite(file_digest, header, digests, blobs)


def chunk_bytes(target: StoreTag, raw: bytes) -> memoryview:
    """The bytes of a chunk another rank stored (for the digest of a split tensor), checked."""
    return target.store._blob_bytes(raw).data


def commit(target: StoreTag, epoch: bytes, index: bytes, headers: list[bytes],
           blobs: list[tuple[bytes, str, tuple[int, ...]]], limits: Limits = DEFAULT) -> None:
    """Write the checkpoint's record (the coordinator, after every rank's blobs are durable)."""
    distinct: dict[bytes, tuple[str, tuple[int, ...]]] = {}
    for raw, dtype, shape in blobs:
        distinct.setdefault(raw, (dtype, shape))
    order = sorted(distinct)
    placeholders = [Stored(dtypes.BY_NAME[distinct[raw][0]], distinct[raw][1], memoryview(b"")) for raw in order]
    obj = {"blobs": placeholders, "format": FORMAT, "index": index, "layout": LAYOUT, "ranks": list(headers)}
    p = writer.plan(obj, None, limits, ALGORITHM)
    by_id = {id(v): raw for v, raw in zip(placeholders, order, strict=True)}
    for s in p.tensors:
        s.digest = by_id[id(s.value)]
    header, _ = p.header()
    target.store._put_record(target.tag, header, order, epoch)


def index_bytes(p: writer.Plan) -> bytes:
    """The bytes of an index file (what the directory save writes for plan ``p``)."""
    buf = io.BytesIO()
    writer.write(p, buf)
    return buf.getvalue()


# ---------------------------------------------------------------------------- the one-process functions


def load_unsharded(checkpoint: Any, *, rank: int | None = None, map_location: Any = None,
                   limits: Limits = DEFAULT, storage_options: Any = None) -> Any:
    """The whole logical state of a checkpoint in one process (with ``rank=r``, also rank ``r``'s
    per-rank values). ``checkpoint``: a directory (or directory URL, with ``storage_options``) or a
    :class:`StoreTag`.

    Example::

        full = tensorcanon.dcp.load_unsharded("ckpt/step100")
    """
    if not isinstance(checkpoint, StoreTag):
        return read.load_unsharded(checkpoint, rank=rank, map_location=map_location, limits=limits,
                                   storage_options=storage_options)
    refuse_options(checkpoint, storage_options, "load_unsharded")
    return read.load_unsharded(store_index(checkpoint, limits), rank=rank, map_location=map_location, limits=limits)


def verify(checkpoint: Any, *, expect: str | None = None, limits: Limits = DEFAULT,
           storage_options: Any = None) -> str:
    """Check every byte of a checkpoint (a directory, a directory URL or a :class:`StoreTag`: there,
    its record and every blob it names too) and return its logical digest.

    Example::

        tensorcanon.dcp.verify("ckpt/step100", expect=digest)
    """
    if not isinstance(checkpoint, StoreTag):
        return read.verify(checkpoint, expect=expect, limits=limits, storage_options=storage_options)
    refuse_options(checkpoint, storage_options, "verify")
    return read.verify(store_index(checkpoint, limits), expect=expect, limits=limits)


def consolidate(checkpoint: Any, out: str | os.PathLike[str], *, limits: Limits = DEFAULT,
                storage_options: Any = None) -> str:
    """Write the checkpoint's logical state as one tensorcanon file (``tensorcanon.dumps`` of it,
    byte for byte) and return its digest. ``checkpoint``: a directory, a directory URL or a
    :class:`StoreTag` (``storage_options`` then reach ``out`` only).

    Example::

        tensorcanon.dcp.consolidate("ckpt/step100", "step100.safetensors")
    """
    if not isinstance(checkpoint, StoreTag):
        return read.consolidate(checkpoint, out, limits=limits, storage_options=storage_options)
    return read.consolidate(store_index(checkpoint, limits), out, limits=limits, storage_options=storage_options)


def logical_digest(checkpoint: Any, *, limits: Limits = DEFAULT, storage_options: Any = None) -> str:
    """The checkpoint's logical digest, from its validated index, without reading tensor data.

    Example::

        tensorcanon.dcp.logical_digest("ckpt/step100")
    """
    if not isinstance(checkpoint, StoreTag):
        return read.logical_digest(checkpoint, limits=limits, storage_options=storage_options)
    refuse_options(checkpoint, storage_options, "logical_digest")
    return checked_index(checkpoint, read_record(checkpoint, limits), limits).logical_digest


__all__ = ["StoreTag", "export", "load_unsharded", "verify", "consolidate", "logical_digest"]
