"""What the API, the command line and lockfiles do with a checkpoint directory.

Kept here so that those modules only ask "is this a checkpoint directory?" and
call one function. A checkpoint's identity is its logical digest: hashing,
verifying, locking and diffing all work on the logical content, so a 2-rank
and a 3-rank checkpoint of one state hash, lock and diff as the same thing.
"""

from __future__ import annotations

import os
from typing import Any

from ..format import paths
from ..format.errors import TensorCanonError
from ..format.limits import DEFAULT, Limits
from ..io import storage
from . import layout, read


def is_checkpoint(path: Any) -> bool:
    """True for a directory that holds an index (complete or damaged: reading it will tell); also
    for a directory URL of object storage (a storage.Location, with its options) that holds one."""
    if layout.is_remote(path):  # storage.names_checkpoint: the one decision (a URL naming both is refused)
        loc = path if isinstance(path, storage.Location) else storage.Location(str(path))
        return storage.names_checkpoint(loc)
    return layout.is_checkpoint(path)


def is_directory(path: str | os.PathLike) -> bool:
    return os.path.isdir(path)


def content_digest(path: Any, *, verify: bool = True, limits: Limits = DEFAULT) -> str:
    """The logical digest: recomputed from every byte (``verify``) or read from the index."""
    if verify:
        return read.verify(path, limits=limits)
    return read.logical_digest(path, limits=limits)


def files(path: str | os.PathLike, limits: Limits = DEFAULT) -> list[str]:
    """The local files a checkpoint directory's digest reads: its index (read here only after the
    caller has judged it), then every rank file the index names."""
    index = layout.read(os.fspath(path), limits)
    return [os.path.join(os.fspath(path), layout.INDEX_NAME)] + [index.file_path(r) for r in range(index.world_size)]


def read_by(path: Any, limits: Limits = DEFAULT) -> list[str]:
    """What reading ``path`` reads, for a command that must not write its output over its input
    (storage.written_over): a checkpoint's folder (or prefix), its index and every rank file its index
    names, local or in a store; any other path or URL alone. A damaged index names no file: its
    folder and index are listed still."""
    try:
        if not is_checkpoint(path):
            return [os.fspath(path)]
        folder, _ = layout.where(path)
    except TensorCanonError:  # (an ambiguous or unreachable URL: reading it says so)
        return [os.fspath(path)]
    try:
        index = layout.read(path, limits)
    except TensorCanonError:
        return [folder, layout.index_path(folder)]
    return [folder, layout.index_path(folder)] + [index.file_path(r) for r in range(index.world_size)]


def consolidated_size(path: Any, limits: Limits = DEFAULT) -> int:
    """The size in bytes of the file ``consolidate`` writes: the checkpoint's size as one file,
    the same for every world size (lockfiles record it)."""
    return _logical_size(layout.read(path, limits))


def _logical_size(index: layout.Index) -> int:
    """A checkpoint's size: its consolidated file's, the one size ``inspect`` and ``lock`` give it."""
    header, data_size = index.consolidated_header()
    return len(header) + data_size


def logical_state(path: str | os.PathLike, limits: Limits = DEFAULT) -> tuple[Any, str]:
    """``(value, algorithm)``: the checkpoint's logical state on the CPU, and its digest algorithm,
    as ``tensorcanon.diff`` compares files (it wraps them in a ``diff.Loaded``)."""
    path = os.fspath(path)
    return read.load_unsharded(path, map_location="cpu", limits=limits), layout.read(path, limits).algorithm


def describe(path: Any, limits: Limits = DEFAULT) -> dict[str, Any]:
    """What ``tensorcanon inspect DIR`` shows: the logical tree and table, and the layout."""
    index = layout.read(path, limits)
    return {
        "index": index,
        "root": index.logical.root,
        "table": index.logical.tensors,
        "digest": index.logical_digest,
        "algorithm": index.algorithm,
        "world_size": index.world_size,
        "files": [os.path.basename(index.file_path(r)) for r in range(index.world_size)],
        "chunks": {info.name: [{"rank": c.rank, "offsets": list(c.offsets), "sizes": list(c.sizes)}
                               for c in index.chunks[t]] for t, info in enumerate(index.logical.tensors)},
        "per_rank": [paths.join(p) for p in index.per_rank],  # (repr fails on an int of 4,300+ digits)
        "size": _logical_size(index),        # as one file: the size lock records, any world size
        "stored_size": _size(index),          # its files as saved (index and rank files)
    }


def _size(index: layout.Index) -> int:
    """The bytes of a checkpoint's files: its index and its rank files."""
    names = [layout.INDEX_NAME] + [os.path.basename(index.file_path(r)) for r in range(index.world_size)]
    if index.options is None:
        return sum(os.path.getsize(os.path.join(index.folder, n)) for n in names)
    store, prefix = layout.open_store(index.folder, index.options)
    return sum(store.size(layout.join(prefix, n)) for n in names)


def checkpoints_under(folder: str | os.PathLike[str]) -> list[str]:
    """Checkpoint directories at or below ``folder`` (a checkpoint's own files are not listed
    separately: it is one entry)."""
    out = []
    for root, dirs, _ in os.walk(folder):
        if is_checkpoint(root):
            out.append(root)
            dirs[:] = []
    return out
