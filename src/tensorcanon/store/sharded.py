"""Reading a sharded checkpoint kept in a store (docs/DISTRIBUTED.md, "In a store"; FORMAT.md §14.10).

``tensorcanon.dcp.save(state, StoreTag(store, "step100"))`` stores each rank file's tensors as blobs
and writes one record, an ordinary store tag whose object is::

    {"blobs": [<one tensor per distinct blob, sorted by digest>],   # what gc keeps, verify checks
     "format": "tensorcanon-dcp-checkpoint",
     "index": <bytes: the index file the directory save writes>,
     "layout": 1,
     "ranks": [<bytes: rank r's file header (its first 8 + N bytes)>, ...]}

Rank ``r``'s file is its header followed by the blobs its table names, in data order, byte for
byte the file the directory save writes (:func:`export` writes that directory). This module reads
such a record: for tensorcanon.dcp (which writes it, and loads through :func:`store_index`) and for
the store's own tools, which show a sharded tag as the checkpoint it is (:func:`summary`: its
logical digest, the digest its save returned, and the bytes of its directory). It needs no
torch.distributed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

from ..format.errors import FileAccessError, FormatError, IntegrityError, MissingFileError, TensorCanonError, UsageError
from ..format.limits import DEFAULT, Limits
from ..format.manifest import TensorInfo
from ..format.tree import items, tag_of
from ..io import writer
from ..io.source import Source
from ..sharded import layout, read
from ..sharded.errors import CheckpointNotFoundError
from ..sharded.files import RankFile, SubtreeDecoder, with_context
from . import layout as store_layout

FORMAT = "tensorcanon-dcp-checkpoint"
LAYOUT = 1
_KEYS = ["blobs", "format", "index", "layout", "ranks"]
#: The digest algorithm of a checkpoint in a store: a store names its blobs by XXH3-128 digests.
ALGORITHM = "xxh3-128"


class Target(Protocol):
    """Where a sharded checkpoint is kept: a store and a tag (``tensorcanon.dcp.StoreTag`` is one;
    ``str()`` of it names both in errors)."""

    store: Any
    tag: str


@dataclass
class Tag:
    """A :class:`Target` for the store's own tools (named as ``tensorcanon.dcp.StoreTag`` names one)."""

    store: Any
    tag: str

    def __str__(self) -> str:
        return f"tag {self.tag!r} of the store {self.store.root!r}"


@dataclass
class Record:
    index: bytes            # the index file
    headers: list[bytes]    # each rank file's header, by rank
    blobs: set[bytes]       # the blobs the record names (what gc keeps)


def read_record(target: Target, limits: Limits = DEFAULT) -> Record:
    """The checkpoint's record, checked as a store tag and field by field."""
    where = str(target)
    try:
        cm = target.store._tag_file(target.tag, limits, blobs=False)
        with cm as cf:
            cf.check_tree()
            fields = _fields(cf)
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
    if type(values["layout"]) is not int:   # (not a layout a later writer could write: damage)
        raise FormatError(f"{where}: its record's 'layout' must be an int, not {values['layout']!r} "
                          f"({type(values['layout']).__name__}); the record is damaged")
    if values["layout"] != LAYOUT:
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


def check_blob_list(target: Target, record: Record, limits: Limits = DEFAULT) -> None:
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


def export(target: Target, folder: str | os.PathLike[str], *, limits: Limits = DEFAULT) -> str:
    """Write the checkpoint as the directory ``tcd.save(state, folder)`` writes, byte for byte: each
    rank file from its header and its blobs (every blob checked against its digest on the way), the
    index last. Returns the logical digest. The folder must be new or empty (FileAccessError otherwise: a
    directory holding anything else, even a checkpoint's leftovers, is not the one ``save`` writes)."""
    folder = os.fspath(folder)
    if layout.is_remote(folder):
        raise UsageError(f"export writes a local directory, not {folder!r}: export, then copy it")
    if os.path.exists(layout.index_path(folder)):
        raise FileAccessError(f"{folder!r} already holds a checkpoint (its {layout.INDEX_NAME}): export into a new "
                              "or empty directory", filename=folder, errno=errno.EEXIST)
    _check_new_or_empty(folder, target)
    record = read_record(target, limits)
    index = checked_index(target, record, limits)   # (before anything is written)
    check_blob_list(target, record, limits)
    made = not os.path.isdir(folder)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:  # (a file where the folder belongs, or below one; no permission)
        raise FileAccessError(f"cannot create the folder {folder!r} to export {target} into: {e.strerror or e}; "
                              "export into a new or empty directory", filename=folder, errno=e.errno) from None
    written: list[str] = []
    try:
        for rank in range(index.world_size):
            written.append(_export_rank(target, record, rank, folder, index.files[rank], limits))
        _check_written(target, index, folder, limits)
        writer.replace_atomically(layout.index_path(folder), lambda f, tmp: writer._write_all(f, record.index))
    except BaseException:  # (a blob found damaged on the way: leave the folder as it was, new or empty)
        for path in written:
            with contextlib.suppress(OSError):
                os.remove(path)
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise
    return index.logical_digest


def _check_written(target: Target, index: layout.Index, folder: str, limits: Limits) -> None:
    """The rank files just written checked against the index before the index is written (as
    ``verify`` of the directory would: what each holds, every chunk, the logical digests). Each blob
    was checked against its name on the way, but no digest covers the index: a record whose index
    is sound as a file but not this checkpoint's (its rank files plain files, its logical manifest
    another checkpoint's) exports as a directory that is not a checkpoint; export refuses it then,
    rather than return a logical digest the directory does not have."""
    local = dataclasses.replace(index, folder=folder, opener=None, options=None)
    try:
        read.verify(local, limits=limits)
    except (FormatError, IntegrityError) as e:
        raise with_context(e, f"{target}: its checkpoint does not check (the record is damaged): ") from None


def _check_new_or_empty(folder: str, target: Target) -> None:
    """``folder`` does not exist, or is an empty directory (docs/CLI.md: "into a new or empty local
    folder"): export never writes beside other files."""
    if target.store._b.holds(folder):
        raise UsageError(f"cannot export {target} into {folder!r}: it is inside the store's folder, where "
                         "gc deletes what is not the store's; export into a new or empty directory outside it")
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return  # (new: made once the record checked)
    except OSError as e:  # (a file, or a path below one; no permission)
        raise FileAccessError(f"cannot export {target} into {folder!r}: {e.strerror or e}; export into a new or "
                              "empty directory", filename=folder, errno=e.errno) from None
    if names:
        raise FileAccessError(f"cannot export {target} into {folder!r}: it is not empty (it holds {len(names)} "
                              f"entr{'y' if len(names) == 1 else 'ies'}, such as {sorted(names)[0]!r}); export "
                              "into a new or empty directory",
                              filename=folder, errno=errno.ENOTEMPTY)


def _export_rank(target: Target, record: Record, rank: int, folder: str, expected: str, limits: Limits) -> str:
    """Write rank ``rank``'s file into ``folder``; returns its path."""
    world = len(record.headers)
    what = f"{target}: rank {rank}'s file"
    store = target.store
    with store._header_file(record.headers[rank], f"{target.tag} (rank {rank} of {world})", limits) as cf:
        cf.check_tree()   # (its blobs are among the record's: check_blob_list)
        file_digest = _rank_digest(cf, what, expected)
        vf = cast(Any, cf.src.f)  # (the store's file object: the header, then the blobs)
        name = layout.rank_file_name(rank, world, file_digest)
        path = os.path.join(folder, name)
        try:
            writer.replace_atomically(path, lambda f, tmp: vf.write_to(f, cf))
        except (IntegrityError, FormatError) as e:
            raise _name_damage(target, cf, e, what) from None
    return path


def _rank_digest(cf: Any, what: str, expected: str) -> str:
    """The digest of a rank file (``cf``, from its header), which must be the index's ``expected``."""
    file_digest = cf.digest or ""
    if file_digest != expected:
        raise IntegrityError(f"{what} has digest {file_digest}, but the index records {expected}: the record "
                             "is damaged", expected=expected, actual=file_digest)
    return file_digest


def _name_damage(target: Target, cf: Any, e: TensorCanonError, what: str) -> TensorCanonError:
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


def checked_index(target: Target, record: Record, limits: Limits = DEFAULT) -> layout.Index:
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
    text = str(e).replace(f"index {old}: ", "").removeprefix(f"{old}: ")   # (the caller names it once)
    return rebuild(cls, (text.replace(old, new),), state)


def store_index(target: Target, limits: Limits = DEFAULT) -> layout.Index:
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


# ------------------------------------------------------------- a sharded tag as the store's tools show it


def claims(store: Any, tag: str, limits: Limits = DEFAULT) -> bool:
    """Whether ``tag``'s record says it is a sharded checkpoint's: its object a dict of exactly the
    record's keys whose ``format`` is :data:`FORMAT` (no blob read). Such a record is then read as
    one, and a record that claims to be one and is not sound is damaged."""
    with store._tag_file(tag, limits, blobs=False) as cf:
        return _claims(cf)


def claims_header(store: Any, header: bytes, tag: str, limits: Limits = DEFAULT) -> bool:
    """:func:`claims`, from the header the record of ``tag`` holds (already read)."""
    with store._header_file(header, tag, limits, blobs=False) as cf:
        return _claims(cf)


def _fields(cf: Any) -> dict[str, Any]:
    """The top-level fields of a record's object (manifest nodes), by key; empty unless it is a
    dict of str keys."""
    assert cf.manifest is not None  # (a store refuses a record that is not a tensorcanon file)
    root = cf.manifest.root
    pairs = list(items(root)) if tag_of(root) == "dict" else []
    return dict(pairs) if all(type(k) is str for k, _ in pairs) else {}


def _claims(cf: Any) -> bool:
    fields = _fields(cf)
    return sorted(fields, key=str) == _KEYS and fields["format"] == FORMAT


@dataclass
class Summary:
    """What the store's tools show of a tag: the digest its save returned, and its size."""

    digest: str        # a file's digest; a sharded checkpoint's logical digest
    size: int          # the file's bytes; a sharded checkpoint's directory (index and rank files)
    ranks: int | None  # a sharded checkpoint's world size; None for a file


def summary(store: Any, tag: str, limits: Limits = DEFAULT) -> Summary:
    """``tag`` as the store's tools show it: a file's digest and size, from its record alone; a
    sharded checkpoint's logical digest (what ``tensorcanon.dcp.save`` returned) and the bytes of
    the directory it exports as, from its record and rank headers (checked: the index as any index,
    the record's blob list against the rank files' tables, each rank file's digest against the
    index), no blob read."""
    with store._tag_file(tag, limits, blobs=False) as cf:
        if not _claims(cf):
            return Summary(cf.digest or "", cf.src.size or 0, None)
    target = Tag(store, tag)
    record = read_record(target, limits)
    index = checked_index(target, record, limits)
    check_blob_list(target, record, limits)
    size = len(record.index)
    world = len(record.headers)
    for rank, header in enumerate(record.headers):
        with store._header_file(header, f"{tag} (rank {rank} of {world})", limits, blobs=False) as cf:
            _rank_digest(cf, f"{target}: rank {rank}'s file", index.files[rank])
            size += cf.src.size or 0
    return Summary(index.logical_digest, size, world)


def verify(store: Any, tag: str, limits: Limits = DEFAULT) -> str:
    """Check every byte of the sharded checkpoint ``tag`` (its record, every blob it names, each rank
    file against the index, the logical tensors against their digests) and return its logical
    digest (what ``tensorcanon.dcp.verify`` of it returns)."""
    return read.verify(store_index(Tag(store, tag), limits), limits=limits)
