"""Sharded checkpoints kept in a :class:`tensorcanon.Store` (docs/DISTRIBUTED.md, "In a store").

``tcd.save(state, tcd.StoreTag(store, "step100"))`` writes what ``tcd.save(state, dir)`` writes,
without writing the same tensor twice: each rank stores its rank file's tensors as blobs of the
store (content-addressed: a chunk saved again at the next step, or held by two ranks, is stored
once, and compressed where that pays), and the coordinator then writes one record, last, as the
directory save writes its index last. The record is an ordinary store tag (``store.tags()`` lists
it, ``store verify`` checks every blob it names, ``store gc`` keeps them) whose object is::

    {"blobs": [<one tensor per distinct blob, sorted by digest>],   # what gc keeps, verify checks
     "format": "tensorcanon-dcp-checkpoint",
     "index": <bytes: the index file the directory save writes>,
     "layout": 1,
     "ranks": [<bytes: rank r's file header (its first 8 + N bytes)>, ...]}

Rank ``r``'s file is its header followed by the blobs its table names, in data order, byte for
byte the file the directory save writes (:func:`export` writes that directory). Loading, verifying
and consolidating read the checkpoint through those files: every function of tensorcanon.dcp
that takes a checkpoint directory takes a :class:`StoreTag`.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from ..format import dtypes
from ..format.errors import FileAccessError, FormatError, IntegrityError, MissingFileError, TensorCanonError, UsageError
from ..format.limits import DEFAULT, Limits
from ..format.manifest import TensorInfo
from ..format.tensorbytes import Stored
from ..format.tree import items, tag_of
from ..io import writer
from ..io.source import Source
from ..sharded import layout, read
from ..sharded.errors import CheckpointNotFoundError
from ..sharded.files import RankFile, SubtreeDecoder, with_context
from ..store import Store, layout as store_layout

FORMAT = "tensorcanon-dcp-checkpoint"
LAYOUT = 1
_KEYS = ["blobs", "format", "index", "layout", "ranks"]
#: The digest algorithm of a checkpoint in a store: a store names its blobs by XXH3-128 digests.
ALGORITHM = "xxh3-128"


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
        from ..store import layout as store_layout

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


# ---------------------------------------------------------------------------- reading


@dataclass
class Record:
    index: bytes            # the index file
    headers: list[bytes]    # each rank file's header, by rank
    blobs: set[bytes]       # the blobs the record names (what gc keeps)


def read_record(target: StoreTag, limits: Limits = DEFAULT) -> Record:
    """The checkpoint's record, checked as a store tag and field by field."""
    where = str(target)
    try:
        cm = target.store._tag_file(target.tag, limits, blobs=False)
        with cm as cf:
            cf.check_tree()
            assert cf.manifest is not None  # (a store refuses a record that is not a tensorcanon file)
            root = cf.manifest.root
            pairs = list(items(root)) if tag_of(root) == "dict" else []
            fields = dict(pairs) if all(type(k) is str for k, _ in pairs) else {}
            if sorted(fields, key=str) != _KEYS:
                raise FormatError(f"{where} is not a sharded checkpoint (saved with tensorcanon.dcp.save to a "
                                  "StoreTag): read it with store.load")
            rows = cf.rows
            dec = SubtreeDecoder(len(rows), limits)

            def no_tensor(i: int) -> Any:
                raise FormatError(f"{where}: its record holds a tensor where a value is expected")

            values = {k: dec.decode(fields[k], no_tensor) for k in ("format", "index", "layout", "ranks")}
            blob_nodes = fields["blobs"]
            listed = [rows[i].digest for i in _tensor_indices(blob_nodes, where)]
            named = set(listed)
            blobs = {r.digest for r in rows if r.nbytes}
    except MissingFileError as e:
        raise CheckpointNotFoundError(f"{where} does not exist: {e}", filename=str(target)) from None
    if values["format"] != FORMAT:
        raise FormatError(f"{where} is not a sharded checkpoint: its record says format {values['format']!r}")
    if values["layout"] != LAYOUT or type(values["layout"]) is not int:
        raise FormatError(f"{where}: layout {values['layout']!r} is not supported (this tensorcanon reads layout "
                          f"{LAYOUT}); upgrade tensorcanon to read it")
    index, headers = values["index"], values["ranks"]
    if type(index) is not bytes or type(headers) is not list or not headers or \
            not all(type(h) is bytes for h in headers):
        raise FormatError(f"{where}: its record's 'index' must be bytes and 'ranks' a non-empty list of bytes")
    if len(headers) > layout.MAX_WORLD_SIZE:
        raise FormatError(f"{where}: its record holds {len(headers)} ranks, more than {layout.MAX_WORLD_SIZE}")
    for rank, h in enumerate(headers):  # (FORMAT.md §14.10: exactly a file's first 8 + N bytes)
        if len(h) < 8 or len(h) != 8 + int.from_bytes(h[:8], "little"):
            raise FormatError(f"{where}: its record's header of rank {rank} is {len(h)} bytes, not the first "
                              "8 + N bytes of a file (N: what its first 8 bytes say); the record is damaged")
    if named != blobs:
        raise FormatError(f"{where}: its record's 'blobs' must hold every tensor of the record")
    if any(a >= b for a, b in zip(listed, listed[1:], strict=False)):
        raise FormatError(f"{where}: its record's 'blobs' must name each blob once, in ascending order of "
                          "digest; the record is damaged")
    return Record(index, headers, blobs)


def check_blob_list(target: StoreTag, record: Record, limits: Limits = DEFAULT) -> None:
    """The record's ``blobs`` are exactly the blobs its rank files' tables name (FORMAT.md §14.10): none
    missing (gc would free it) and none that no rank file uses (gc would keep it forever, and verify
    would vouch for a record that is not what a writer writes). Reads every rank header, no blob."""
    world, used = len(record.headers), set[bytes]()
    for rank, header in enumerate(record.headers):
        with target.store._header_file(header, f"{target.tag} (rank {rank} of {world})", limits, blobs=False) as cf:
            used.update(r.digest for r in cf.rows if r.nbytes)
    if used - record.blobs:
        raise FormatError(f"{target}: its rank files name {len(used - record.blobs)} blobs its record does not "
                          "(gc would not keep them); the record is damaged")
    if record.blobs - used:
        raise FormatError(f"{target}: its record's 'blobs' names {len(record.blobs - used)} blobs that no rank "
                          "file uses (gc would keep them for nothing); the record is damaged")


def _tensor_indices(node: Any, where: str) -> list[int]:
    if tag_of(node) != "list":
        raise FormatError(f"{where}: its record's 'blobs' must be a list of tensors")
    out = []
    for n in node[1:]:
        if tag_of(n) != "tensor" or len(n) != 2 or type(n[1]) is not int:
            raise FormatError(f"{where}: its record's 'blobs' must be a list of tensors")
        out.append(n[1])
    return out


def export(target: StoreTag, folder: str | os.PathLike[str], *, limits: Limits = DEFAULT) -> str:
    """Write the checkpoint as the directory ``tcd.save(state, folder)`` writes, byte for byte: each
    rank file from its header and its blobs (every blob checked against its digest on the way), the
    index last. Returns the logical digest. The folder must not hold a checkpoint already."""
    folder = os.fspath(folder)
    if layout.is_remote(folder):
        raise UsageError(f"export writes a local directory, not {folder!r}: export, then copy it")
    if os.path.exists(layout.index_path(folder)):
        raise FormatError(f"{folder!r} already holds a checkpoint (its {layout.INDEX_NAME}): export into a new "
                          "or empty directory")
    record = read_record(target, limits)
    index = checked_index(target, record, limits)   # (before anything is written)
    check_blob_list(target, record, limits)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:  # (a file where the folder belongs, or below one; no permission)
        raise FileAccessError(f"cannot create the folder {folder!r} to export {target} into: {e.strerror or e}; "
                              "export into a new or empty directory", filename=folder, errno=e.errno) from None
    for rank in range(index.world_size):
        _export_rank(target, record, rank, folder, index.files[rank], limits)
    writer.replace_atomically(layout.index_path(folder), lambda f, tmp: writer._write_all(f, record.index))
    return index.logical_digest


def _export_rank(target: StoreTag, record: Record, rank: int, folder: str, expected: str, limits: Limits) -> None:
    world = len(record.headers)
    what = f"{target}: rank {rank}'s file"
    store = target.store
    with store._header_file(record.headers[rank], f"{target.tag} (rank {rank} of {world})", limits) as cf:
        cf.check_tree()   # (its blobs are among the record's: check_blob_list)
        file_digest = cf.digest or ""
        if file_digest != expected:
            raise IntegrityError(f"{what} has digest {file_digest}, but the index records {expected}: the record "
                                 "is damaged", expected=expected, actual=file_digest)
        vf = cast(Any, cf.src.f)  # (the store's file object: the header, then the blobs)
        name = layout.rank_file_name(rank, world, file_digest)
        try:
            writer.replace_atomically(os.path.join(folder, name), lambda f, tmp: vf.write_to(f, cf))
        except (IntegrityError, FormatError) as e:
            raise _name_damage(target, cf, e, what) from None


def _name_damage(target: StoreTag, cf: Any, e: TensorCanonError, what: str) -> TensorCanonError:
    """``e`` (a blob that fails its digest, or cannot be decoded), naming the chunk that uses it."""
    store = target.store
    for r in cf.rows:
        if not r.nbytes:
            continue
        try:
            store._blob_bytes(r.digest)
        except TensorCanonError as found:
            return with_context(found, f"{what}: {_chunk(r.name)} is damaged in the store: ")
    return with_context(e, f"{what}: ")


def _chunk(key: str) -> str:
    """Words for a rank file's key: a chunk (``name@offsets``) or a per-rank value's tensor."""
    name, _, offsets = key.rpartition("@")
    return f"the chunk {key!r} (tensor {name!r})" if name and offsets != "rank" else f"the tensor {key!r}"


class _StoreRankFile(RankFile):
    """A rank file whose data are a store's blobs: they are looked up (each blob's header read and
    checked against its row) when data is first read, not when the file is opened (a load opens
    every rank file to bound sizes, and reads few); a blob that cannot be read or decoded names the
    chunk it holds (a blob's own errors name only the blob)."""

    _blobs: Any = None  # the store's file object, until its blobs are looked up
    _store: Any = None  # the store

    def _attach(self) -> None:
        if self._blobs is not None:
            vf, self._blobs = self._blobs, None
            vf.attach(self.rows)

    def raw(self, info: Any) -> memoryview:
        try:
            self._attach()
            return super().raw(info)
        except (IntegrityError, FormatError) as e:
            raise with_context(e, f"{self.path}: {_chunk(info.name)}: ") from None

    def read(self, *args: Any, **kwargs: Any) -> Any:
        self._attach()
        return super().read(*args, **kwargs)

    def info(self, key: str, what: Callable[[], str]) -> TensorInfo:
        """The row of a chunk, its size bounded by the blob that holds it (readers call this before
        they allocate a tensor of the chunk's size: a rank file's header comes from the record, so
        unlike a file's size, nothing else bounds what its rows claim). One look-up in the packs'
        indexes (or the loose object's size), no read; the blob's own header is checked when it is read."""
        row = super().info(key, what)
        if row.nbytes:
            try:
                length = self._store._stored_length(row.digest)
            except MissingFileError:
                raise IntegrityError(f"{self.path}: {_chunk(key)}: its blob {store_layout.show(row.digest)} is "
                                     "missing from the store; the checkpoint cannot be loaded (save it again)",
                                     expected=store_layout.show(row.digest)) from None
            if row.nbytes > length * store_layout.ZSTD_MAX_RATIO:
                raise FormatError(f"{self.path}: {_chunk(key)} claims {row.nbytes} bytes, but its blob "
                                  f"{store_layout.show(row.digest)} is {length} bytes stored (a blob decodes to at "
                                  f"most {store_layout.ZSTD_MAX_RATIO} times that); the record is damaged")
        return row


def checked_index(target: StoreTag, record: Record, limits: Limits = DEFAULT) -> layout.Index:
    """The record's index, validated as any index (layout.read), naming as many rank files as the
    record holds headers."""
    with tempfile.TemporaryDirectory(prefix="tensorcanon-dcp-") as folder:
        writer.replace_atomically(layout.index_path(folder), lambda f, tmp: writer._write_all(f, record.index))
        try:
            index = layout.read(folder, limits)
        except TensorCanonError as e:
            raise with_context(_replaced(e, layout.index_path(folder), "its index"), f"{target}: its index: ") \
                from None
    index.folder = str(target)
    if index.logical.algorithm != ALGORITHM:   # (FORMAT.md §14.10: XXH3-128 throughout, the store's digests)
        raise FormatError(f"{target}: its index is of a {index.logical.algorithm} checkpoint; a checkpoint in a "
                          f"store has {ALGORITHM} digests (the store names blobs by them): the record is damaged")
    if index.world_size != len(record.headers):
        raise FormatError(f"{target}: its index names {index.world_size} rank files, its record holds "
                          f"{len(record.headers)} headers; the record is damaged")
    return index


def _replaced(e: TensorCanonError, old: str, new: str) -> TensorCanonError:
    """``e`` with ``old`` (a temporary path) replaced by ``new`` in its message."""
    rebuild, (cls, _, state) = e.__reduce__()
    return rebuild(cls, (str(e).replace(f"index {old}: ", "").replace(old, new),), state)


def store_index(target: StoreTag, limits: Limits = DEFAULT) -> layout.Index:
    """The checkpoint's index (validated as any index) whose rank files are read from the store:
    each opened when a reader first uses it, as its header (from the record) and the blobs its
    table names, every chunk hashed against its digest when it is read (Index.opener)."""
    record = read_record(target, limits)
    index = checked_index(target, record, limits)
    check_blob_list(target, record, limits)
    world = index.world_size

    def opener(rank: int) -> RankFile:
        what = f"{target}: rank {rank}'s file"
        stack = contextlib.ExitStack()
        try:
            cf = stack.enter_context(target.store._header_file(record.headers[rank], f"{target.tag} (rank {rank} "
                                                               f"of {world})", limits, blobs=False))
        except BaseException:
            stack.close()
            raise
        vf = cast(Any, cf.src.f)  # (the store's file object: read again from its start, as a rank file)
        vf.seek(0)
        f = cast(_StoreRankFile, _StoreRankFile.over(Source(vf, name=cf.src.name), what, index.files[rank], limits,
                                                    stack))
        f._blobs = vf
        f._store = target.store
        return f

    index.opener = opener
    return index


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
