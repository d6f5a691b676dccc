"""The on-disk layout of a sharded checkpoint (docs/FORMAT.md §14): names, the index, its checks.

A checkpoint is a directory holding

- one ordinary tensorcanon file per rank, ``rank-<r>-of-<w>.<digest hex>.safetensors``:
  a flat dict whose keys are chunk keys ``<tensor name>@<global offsets>``
  (the chunks that rank wrote) and per-rank keys ``<path>@rank`` (the rank's
  own values, :class:`tensorcanon.dcp.PerRank`);
- ``index.safetensors``, a tensorcanon file written last (the commit marker)
  whose object is::

      {"chunks": [[[rank, offsets, sizes], ...], ...],  # per logical tensor, sorted
       "files": [<rank file digest>, ...],             # one per rank, in rank order
       "format": "tensorcanon-sharded",
       "layout": 1,
       "logical": <bytes>,                             # the logical manifest
       "per_rank": [<path tuple>, ...]}                # sorted, canonical key order

The *logical manifest* is the manifest (§5) of the file ``tensorcanon.dumps``
would write for the whole state held in one process, without its per-rank
values; its digest is the checkpoint's *logical digest*, equal to
``tensorcanon.fingerprint`` of that state whatever the world size. Every name
is derived from these fields, so the index names nothing twice.

:func:`read` is the one place that validates an index. What it returns can be
used as it is: every logical tensor's shape is within the limits and its byte
size fits in 64 bits (its bytes are still only claimed: readers find each
chunk's row in its rank file, whose header the file's size bounds, before
allocating anything), and every per-rank path is a key that the logical state
lacks, of a dict reached through dicts and lists, so a per-rank value never
replaces, or hides inside, a value that the logical digest covers.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ..format import digest as _digest, manifest, packed, paths as _paths, tensorkinds
from ..format.errors import FormatError, LimitError, TensorCanonError
from ..format.limits import DEFAULT, Limits
from ..format.ordering import UnorderableKey, sort_key
from ..format.sharding import (  # noqa: F401 - the names the index is checked against, used from here
    FORMAT,
    INDEX_NAME,
    LAYOUT_VERSION,
    PER_RANK_SUFFIX,
    RANK_FILE_RE,
    chunk_key,
    rank_file_name,
)
from ..format.tree import Decoder, decode_manifest, items, tag_of, tensor_names
from ..io import regular, storage
from . import files, tiling
from .errors import CheckpointNotFoundError

#: Upper bound on the world size an index may declare (a hostile index cannot make
#: a reader allocate per-rank state for more ranks than this).
MAX_WORLD_SIZE = 1 << 20
_INDEX_KEYS = ["chunks", "files", "format", "layout", "logical", "per_rank"]


def per_rank_keys(paths: list[tuple]) -> list[str]:
    """The keys of per-rank values in every rank file, from their paths in the state, in the
    index's order: the unique names (docs/FORMAT.md §3.4) of the paths, then ``@rank``.

    Unique names: paths whose base names collide (``("a.b",)`` and ``("a", "b")``) get
    distinct keys (``a.b@rank``, ``a.b~1@rank``), so no two paths share a value. A per-rank
    key never equals a chunk key: its last ``@`` is followed by ``rank``, a chunk key's by
    digits and commas."""
    return [n + PER_RANK_SUFFIX for n in tensor_names(paths)]


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a logical tensor: the rank file holding it and its box."""

    rank: int
    box: tiling.Box

    @property
    def offsets(self) -> tuple[int, ...]:
        return self.box.offsets

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.box.sizes


@dataclass
class Index:
    """A validated index, with the logical manifest decoded (not its tree)."""

    folder: str
    digest: str                       # the index file's own digest
    files: list[str]                  # rank file digests, by rank
    logical: manifest.Manifest        # the logical manifest (tensors: the logical table)
    chunks: list[list[Chunk]]         # per logical tensor, in table order
    per_rank: list[tuple]             # paths of per-rank values in the state
    per_rank_keys: list[str]
    options: dict | None = None       # a checkpoint in object storage: its storage_options (else None)
    # the checks on logical tensors' values that the logical tree asks for (sparse indices, jagged
    # offsets: docs/FORMAT.md §6.12), which verify runs on the verified bytes (tensorkinds.run_deferred)
    value_checks: list[tensorkinds.Deferred] = field(default_factory=list)
    # opens rank ``r``'s file where it is not a file of ``folder`` (a checkpoint kept in a
    # tensorcanon.Store: its header in the store's record, its data the store's blobs; dcp/store.py)
    opener: Callable[[int], Any] | None = None  # -> files.RankFile

    @property
    def world_size(self) -> int:
        return len(self.files)

    @property
    def algorithm(self) -> str:
        return self.logical.algorithm

    @property
    def logical_digest(self) -> str:
        return self.logical.text()

    def file_path(self, rank: int) -> str:
        return join(self.folder, rank_file_name(rank, self.world_size, self.files[rank]))

    def key(self, tensor: int, chunk: Chunk) -> str:
        return chunk_key(self.logical.tensors[tensor].name, chunk.offsets)

    def consolidated_header(self) -> tuple[bytes, int]:
        """``(header bytes, data size)`` of the one file :func:`sharded.consolidate` writes."""
        meta = manifest.header_metadata(self.logical.raw, [], self.algorithm)
        return manifest.canonical_header(self.logical.tensors, meta)

    def describe(self, tensor: int, chunk: Chunk | None = None) -> str:
        """Words naming a tensor (and a chunk of it) for error messages."""
        text = f"tensor {self.logical.tensors[tensor].name!r}"
        if chunk is not None:
            text += (f" chunk at offsets {list(chunk.offsets)} (sizes {list(chunk.sizes)}, "
                     f"rank file {os.path.basename(self.file_path(chunk.rank))})")
        return text


def build(logical_raw: bytes, file_digests: list[str], chunks: list[list[Chunk]],
          per_rank: list[tuple]) -> dict:
    """The index object, ready for ``tensorcanon.save`` (field by field as :func:`read` checks)."""
    return {
        "chunks": [
            [[c.rank, list(c.offsets), list(c.sizes)] for c in sorted(cs, key=_chunk_order)]
            for cs in chunks
        ],
        "files": list(file_digests),
        "format": FORMAT,
        "layout": LAYOUT_VERSION,
        "logical": logical_raw,
        "per_rank": sorted(per_rank, key=sort_key),
    }


def _chunk_order(c: Chunk) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (c.offsets, c.sizes)


def join(folder: str, name: str) -> str:
    """The path (or URL, for a checkpoint in object storage) of file ``name`` of ``folder``."""
    return f"{folder.rstrip('/')}/{name}" if storage.is_url(folder) else os.path.join(folder, name)


def index_path(folder: str | os.PathLike) -> str:
    return join(os.fspath(folder), INDEX_NAME)


def where(folder: Any, storage_options: Any = None) -> tuple[str, dict | None]:
    """``(folder, storage options)``: a local directory's path and None (a ``file://`` URL is a
    path), or a directory URL of object storage (``s3://bucket/run/step100``, without a trailing
    ``/``) and its ``storage_options`` (docs/STORAGE.md). Options with a local path are refused."""
    if not isinstance(folder, storage.Location):
        folder = os.fspath(folder)
    found = storage.resolve(folder, storage_options)
    if isinstance(found, storage.Location):
        return found.url.rstrip("/"), dict(found.options or {})
    return os.fspath(found), None


def is_remote(folder: Any) -> bool:
    """True for a directory URL of object storage (not a path, nor a ``file://`` URL)."""
    if isinstance(folder, storage.Location):
        return True
    text = folder if isinstance(folder, str) else None
    return text is not None and storage.is_url(text) and storage.local_path(text) is None


def open_store(folder: str, options: dict) -> tuple[storage.Store, str]:
    """The store holding a checkpoint directory URL, and the directory's path in it."""
    store, path = storage.open_store(folder, options)
    return store, path.rstrip("/")


def is_checkpoint(folder: Any, storage_options: Any = None) -> bool:
    """True if ``folder`` is a directory (or a directory URL) that holds an index (it may still be damaged)."""
    folder, options = where(folder, storage_options)
    if options is None:
        return os.path.isdir(folder) and os.path.isfile(index_path(folder))
    store, path = open_store(folder, options)
    return store.exists(join(path, INDEX_NAME))


def missing(folder: str) -> TensorCanonError:
    """The error for a directory that is not (or not yet) a checkpoint."""
    if not os.path.exists(folder):
        return CheckpointNotFoundError(f"checkpoint directory {folder!r} does not exist", filename=folder)
    if not os.path.isdir(folder):
        return FormatError(f"{folder!r} is a file, not a sharded checkpoint directory")
    # (the words tensorcanon.load uses for the same directory: an interrupted save only where it looks like one)
    return CheckpointNotFoundError(f"{folder!r} {regular.directory_reason(folder)}", filename=index_path(folder))


def missing_remote(folder: str) -> TensorCanonError:
    """The error for a directory URL that holds no index (an unfinished save, or none)."""
    shown = storage.redact(folder)
    return CheckpointNotFoundError(
        f"{shown!r} holds no {INDEX_NAME}, so it is not a complete tensorcanon checkpoint: the index is "
        "written last, after every rank file, so an interrupted save leaves none", filename=index_path(shown))


def read(folder: Any, limits: Limits = DEFAULT, storage_options: Any = None) -> Index:
    """Read and validate a checkpoint's index; raise a tensorcanon error naming what is wrong.

    Validates the index file like any tensorcanon file, then every field: the
    logical manifest (canonical, with a well-formed tree; each tensor at most
    ``limits.max_ndim`` dimensions and, as every table row, less than 2^63 bytes), one digest
    per rank in the logical manifest's algorithm, chunks that tile each tensor
    exactly, per-rank paths outside the logical state (:func:`_check_per_rank`),
    and canonical order everywhere. Rank files are not opened here. A directory URL of object
    storage (with ``storage_options``) is read through ranged reads, and refused the same way
    without its index.
    """
    given = folder.url if isinstance(folder, storage.Location) else folder
    folder, options = where(folder, storage_options)
    path = index_path(folder)
    source: Any = path
    if options is None:
        if not os.path.isfile(path):
            raise missing(folder)
    else:  # storage.names_checkpoint: the one decision, which refuses a URL that is also an object
        named = given if isinstance(given, str) and given.endswith("/") else folder
        if not storage.names_checkpoint(storage.Location(named, options)):
            raise missing_remote(folder)
        source = storage.Location(path, options, sequential=False, is_object=True)
    shown = storage.redact(path)
    try:
        root, own_digest, own_algorithm = files.read_index_file(source, limits)
    except TensorCanonError as e:
        raise files.with_context(e, f"index {shown}: ") from None
    where_ = f"index {shown}"

    def bad(message: str) -> FormatError:
        return FormatError(f"{where_}: {message}")

    if type(root) is not dict or sorted(root) != _INDEX_KEYS or not all(type(k) is str for k in root):
        raise bad(f"must be a dict with exactly the keys {_INDEX_KEYS}")
    if root["format"] != FORMAT:
        raise bad(f"'format' is {_paths.show(root['format'])}, not {FORMAT!r}: not a sharded checkpoint index")
    if type(root["layout"]) is not int or root["layout"] != LAYOUT_VERSION:
        raise bad(f"layout version {_paths.show(root['layout'])} is not supported (this tensorcanon reads "
                  f"version {LAYOUT_VERSION}); upgrade tensorcanon to read it")
    raw = root["logical"]
    if type(raw) is not bytes:
        raise bad("'logical' must be bytes (the logical manifest)")
    try:
        obj, algorithm = manifest.unpack(raw)
        infos = manifest.read_table(obj["tensors"], algorithm, limits)
        for info in infos:
            _check_shape(info, limits)
        if obj["meta"] is not None:
            raise FormatError("manifest: 'meta' must be nil in a sharded checkpoint's logical manifest")
        logical = manifest.Manifest(raw=raw, root=obj["root"], meta=None, tensors=infos,
                                    digest=_digest.manifest_digest(raw, algorithm), algorithm=algorithm,
                                    version=obj["version"])
        # the tree's structure, the table's order and names, the tensor kinds' parts' dtypes and
        # shapes (by the table's rows): the check every reader makes; the checks on parts' values
        # are kept for verify (load makes them on the built parts)
        value_checks = decode_manifest(logical.root, None, [info.name for info in infos], logical.version,
                                       limits.max_depth, rows=infos,
                                       max_string_bytes=limits.max_string_array_bytes)[1].deferred
    except TensorCanonError as e:
        raise files.with_context(e, f"{where_}: logical manifest: ") from None
    if own_algorithm != algorithm:
        raise bad(f"the index file uses {own_algorithm} digests but its logical manifest uses {algorithm}")

    digests = root["files"]
    if type(digests) is not list or not 1 <= len(digests) <= MAX_WORLD_SIZE:
        raise bad(f"'files' must list one digest per rank (1 to {MAX_WORLD_SIZE})")
    for r, d in enumerate(digests):
        if not _digest.is_text(d) or _digest.algorithm_of(d) != algorithm:
            raise bad(f"'files'[{r}] must be a {algorithm} digest text, found {_paths.show(d)}")
    world = len(digests)

    table = root["chunks"]
    if type(table) is not list or len(table) != len(infos):
        raise bad(f"'chunks' must hold one list per logical tensor ({len(infos)})")
    chunks: list[list[Chunk]] = []
    for info, entries in zip(infos, table, strict=True):
        what = f"{where_}: tensor {info.name!r}"
        if type(entries) is not list or not entries:
            raise FormatError(f"{what}: its chunk list must be a non-empty list")
        out = []
        for entry in entries:
            if (type(entry) is not list or len(entry) != 3 or type(entry[0]) is not int
                    or not 0 <= entry[0] < world or not _int_list(entry[1], len(info.shape))
                    or not _int_list(entry[2], len(info.shape))):
                raise FormatError(f"{what}: malformed chunk {_paths.show(entry)}: expected [rank < {world}, "
                                  f"offsets, sizes] with {len(info.shape)} non-negative ints each")
            out.append(Chunk(entry[0], tiling.Box(tuple(entry[1]), tuple(entry[2]))))
        if [_chunk_order(c) for c in out] != sorted({_chunk_order(c) for c in out}):
            raise FormatError(f"{what}: chunks are not in canonical order (by offsets, no repeats)")
        tiling.check(info.shape, [c.box for c in out], what)
        chunks.append(out)

    paths = root["per_rank"]
    if type(paths) is not list or not all(type(p) is tuple and p for p in paths):
        raise bad("'per_rank' must be a list of non-empty key tuples")
    try:
        keys = [sort_key(p) for p in paths]
    except (UnorderableKey, UnicodeEncodeError):
        raise bad("'per_rank' holds a path with a key that is not a key value") from None
    if any(not a < b for a, b in itertools.pairwise(keys)):
        raise bad("'per_rank' paths are not in canonical order (or repeat)")
    _check_per_rank(logical.root, paths, limits, bad)
    return Index(folder, own_digest, list(digests), logical, chunks, list(paths), per_rank_keys(list(paths)),
                 options, value_checks)


def _check_shape(info: manifest.TensorInfo, limits: Limits) -> None:
    """A logical tensor's claimed rank: at most ``limits.max_ndim`` dimensions, as a file's header
    must have (its size is bounded where every table row's is: container.too_large, in
    manifest.read_table). Checked before anything uses the shape."""
    if len(info.shape) > limits.max_ndim:
        raise LimitError(f"tensor {info.name!r} has {len(info.shape)} dimensions, over max_ndim={limits.max_ndim}",
                         limit="max_ndim")


def _check_per_rank(root: Any, per_rank: list[tuple], limits: Limits, bad: Callable[[str], FormatError]) -> None:
    """Refuse a per-rank path that is not where a writer puts per-rank values (docs/FORMAT.md §14.6).

    Walking the logical tree (its nodes; nothing is built): every key of the path but
    the last leads through a dict or OrderedDict (by key) or a list (by index), as the
    writer allows; the last one's parent is a dict or OrderedDict that lacks it, both in
    canonical order and by Python equality (a key ``True`` would overwrite the key ``1``),
    and no other per-rank path ends in a key of that dict equal to it. So a per-rank value
    never replaces a value the logical digest covers, nor another per-rank value, and no
    per-rank path leads through another one.
    """
    decoder = Decoder([], limits.max_depth)  # for key nodes only (the tree was checked)
    dicts: dict[int, tuple[dict, set]] = {}  # id(dict node) -> ({sort key: value node}, {key})
    listed = {sort_key(p) for p in per_rank}
    finals: dict[int, set] = {}  # id(dict node) -> the last keys of the per-rank paths in it
    lists: dict[int, Any] = {}  # id(ints or records node) -> the list node it packs (kept alive: ids stay unique)

    def entries(node: Any) -> tuple[dict, set]:
        found = dicts.get(id(node))
        if found is None:
            pairs = [(decoder.decode(k), v) for k, v in items(node)]
            found = dicts[id(node)] = ({sort_key(k): v for k, v in pairs}, {k for k, _ in pairs})
        return found

    def refuse(problem: str) -> FormatError:
        return bad(f"{problem}; a per-rank value is the value of a dict key that the logical state lacks, "
                   "reached from the root through dicts and lists (docs/FORMAT.md §14.6): this index was "
                   "not written by tensorcanon.dcp, or was edited")

    for path in per_rank:
        node = root
        for i, k in enumerate(path):
            last = i == len(path) - 1
            node = packed.as_list(node, lists)  # a packed list (FORMAT.md §6.13): walked as the list it holds
            tag = tag_of(node)
            if tag in ("dict", "odict"):
                by_order, keys = entries(node)
                child = by_order.get(sort_key(k))
                if not last and child is None:
                    inside = sort_key(path[: i + 1]) in listed
                    raise refuse(f"per-rank path {_paths.join(path)} leads through {_paths.join(path[: i + 1])}, "
                                 + ("another per-rank path" if inside else "which the logical state does not hold"))
                if last:
                    if child is not None or k in keys:
                        raise refuse(f"per-rank path {_paths.join(path)} names a value of the logical state")
                    taken = finals.setdefault(id(node), set())
                    if k in taken:  # ("d", (1,)) and ("d", (True,)): one key to Python
                        raise refuse(f"per-rank path {_paths.join(path)} and another one are the same key "
                                     "to Python (no dict holds both)")
                    taken.add(k)
            elif tag == "list" and not last and type(k) is int and 0 <= k < len(node) - 1:
                child = node[k + 1]
            else:
                held = ("a list" if last else f"a list without an item {_paths.show(k)}") if tag == "list" \
                    else _kind(node)
                raise refuse(f"per-rank path {_paths.join(path)}: its {'parent' if last else 'ancestor'} "
                             f"{_paths.join(path[:i])} is {held} in the logical state")
            node = child


def _kind(node: Any) -> str:
    """What a tree node holds, in words for a message (``a tuple``, ``an int``, ``None``...)."""
    if node is None:
        return "None"
    kind = "int" if type(node) is msgpack.ExtType else tag_of(node) or type(node).__name__
    return {"obj": "a registered object"}.get(kind, ("an " if kind[0] in "aeiou" else "a ") + kind)


def _int_list(v: Any, n: int) -> bool:
    return type(v) is list and len(v) == n and all(type(x) is int and 0 <= x < 2**63 for x in v)
