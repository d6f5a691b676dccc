"""Reading a sharded checkpoint in one process: verify it, consolidate it, load it whole.

None of this needs torch.distributed or a process group. Each logical tensor
is streamed once from its chunks in C order (tiling.runs) and every byte is
hashed twice in that one pass: into its chunk's digest (recorded in the rank
file) and into the tensor's logical digest (recorded in the logical manifest).
Memory use is one tensor at a time (consolidate: none beyond the page cache).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, BinaryIO

from ..format import digest, tensorbytes, tensorkinds
from ..format.errors import FormatError, IntegrityError, TensorCanonError, UsageError
from ..format.limits import DEFAULT, Limits
from ..format.manifest import TensorInfo
from ..format.ordering import sort_key
from ..format.tree import Decoder
from ..io import placement, regular, storage, writer
from . import layout, tiling
from .files import RankFile, with_context

_PIECE = 1 << 20  # hash and copy in pieces that stay in the CPU cache


class RankFiles:
    """The rank files of one checkpoint, each opened (and checked against the index) once."""

    def __init__(self, folder_index: layout.Index, limits: Limits = DEFAULT) -> None:
        self.index = folder_index
        self.limits = limits
        self._open: dict[int, RankFile] = {}

    def get(self, rank: int) -> RankFile:
        f = self._open.get(rank)
        if f is None:
            try:
                if self.index.opener is not None:
                    f = self.index.opener(rank)
                else:
                    f = RankFile.open(self.index.file_path(rank), self.index.files[rank], self.limits,
                                      self.index.options)
            except TensorCanonError as e:
                raise with_context(e, self._holds(rank)) from None
            self._open[rank] = f
        return f

    def _holds(self, rank: int) -> str:
        """Words naming what a rank file holds, so an error about the file names its tensors."""
        index = self.index
        held = [f"tensor {index.logical.tensors[t].name!r} chunk at offsets {list(c.offsets)}"
                for t, cs in enumerate(index.chunks) for c in cs if c.rank == rank]
        if not held:
            return f"rank {rank}'s file (its per-rank values): "
        more = f" and {len(held) - 3} more chunks" if len(held) > 3 else ""
        return f"rank {rank}'s file (holding {', '.join(held[:3])}{more}): "

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def __enter__(self) -> RankFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def chunk_info(files: RankFiles, index: layout.Index, t: int, c: layout.Chunk) -> tuple[RankFile, TensorInfo]:
    """The rank-file row of a chunk, checked against what the index says it holds."""
    info = index.logical.tensors[t]
    what = functools.partial(index.describe, t, c)
    f = files.get(c.rank)
    row = f.info(index.key(t, c), what)
    if row.dtype is not info.dtype or row.shape != tuple(c.sizes) or row.kind != "tensor" or row.requires_grad:
        raise FormatError(
            f"{what()}: the rank file stores it as {row.kind} {row.dtype.name}{list(row.shape)}"
            f"{' requiring grad' if row.requires_grad else ''}, but the index "
            f"{layout.index_path(index.folder)} expects tensor {info.dtype.name}{list(c.sizes)}"
        )
    return f, row


def chunk_rows(index: layout.Index, files: RankFiles, t: int) -> list[tuple[RankFile, TensorInfo]]:
    """The rank-file rows of every chunk of logical tensor ``t`` (:func:`chunk_info`), in index order.

    Finding them bounds the tensor's claimed size by bytes that exist: each row's size is
    bounded by its rank file's size (the file's header was checked against it when it was
    opened), the rows have the chunks' sizes, and the chunks tile the tensor (layout.read).
    Call it before allocating anything for the tensor.
    """
    return [chunk_info(files, index, t, c) for c in index.chunks[t]]


def bound_sizes(index: layout.Index, limits: Limits = DEFAULT) -> None:
    """Every tensor size the index claims, bounded by the rank files (:func:`chunk_rows` of every
    tensor): for a reader that hands the index's shapes to code that allocates from them (DCP's
    ``_load_state_dict_from_keys`` and planners build empty tensors from the metadata) before
    reading any chunk. Reads the rank files' headers, no data."""
    with RankFiles(index, limits) as files:
        for t in range(len(index.logical.tensors)):
            chunk_rows(index, files, t)


def stream(index: layout.Index, files: RankFiles, t: int, sink: Callable[[memoryview], object] | None = None,
           *, check_chunks: bool = True, rows: list[tuple[RankFile, TensorInfo]] | None = None) -> bytes:
    """Feed logical tensor ``t``'s bytes in C order to ``sink`` and return its digest.

    Raises :class:`IntegrityError` naming the tensor when the digest differs from the
    logical manifest's, and naming the chunk when a chunk's bytes differ from its rank
    file's digest. With ``check_chunks`` (verify) every chunk is also hashed against
    its own digest as it passes; without (loading, consolidating) the logical digest
    alone proves every byte, and the chunks are hashed only when it differs, to name
    the damaged one. Nothing is verified before it is given to ``sink``: callers that
    keep the bytes discard them when this raises. ``rows``: :func:`chunk_rows`, if the
    caller found them already.
    """
    info = index.logical.tensors[t]
    chunks = index.chunks[t]
    algorithm = index.algorithm
    itemsize = info.dtype.itemsize
    if rows is None:
        rows = chunk_rows(index, files, t)
    whole = len(chunks) == 1 and tuple(chunks[0].sizes) == tuple(info.shape)
    h = digest.tensor_hasher(info.dtype.name, info.shape, algorithm)
    per_chunk = [digest.tensor_hasher(info.dtype.name, c.sizes, algorithm) if check_chunks and not whole else None
                 for c in chunks]
    views: dict[int, memoryview] = {}
    is_bool, bad_bool = info.dtype.name == "bool", None
    if is_bool:
        import numpy as np  # (only for bool tensors: verifying a checkpoint needs no numpy otherwise)
    for j, start, count in tiling.runs(info.shape, [c.box for c in chunks]):
        view = views.get(j)
        if view is None:
            f, row = rows[j]
            view = views[j] = f.raw(row)
        lo, hi = start * itemsize, (start + count) * itemsize
        for p in range(lo, hi, _PIECE):
            piece = view[p : min(p + _PIECE, hi)]
            h.update(piece)
            chunk_hasher = per_chunk[j]
            if chunk_hasher is not None:
                chunk_hasher.update(piece)
            if is_bool and bad_bool is None and len(piece) and np.frombuffer(piece, np.uint8).max() > 1:
                bad_bool = j  # raised once the digests are checked: a damaged file is an IntegrityError
            if sink is not None:
                sink(piece)
    actual = h.digest()
    if actual != info.digest and not check_chunks:  # hash the chunks now, to name the damaged one
        stream(index, files, t, check_chunks=True)
    for j, (c, (f, row)) in enumerate(zip(chunks, rows, strict=True)):
        chunk_hasher = per_chunk[j]
        chunk_actual = actual if whole else chunk_hasher.digest() if chunk_hasher is not None else None
        if not c.box.numel and check_chunks:
            f.verified(row, functools.partial(index.describe, t, c))  # an empty chunk: its digest covers its shape
        elif chunk_actual is not None and chunk_actual != row.digest:
            raise IntegrityError(
                f"{index.describe(t, c)} does not match its digest in the rank file: recorded "
                f"{index.logical.text(row.digest)}, computed {index.logical.text(chunk_actual)}; "
                "the file is damaged", path=info.name,
                expected=index.logical.text(row.digest), actual=index.logical.text(chunk_actual),
            )
    if actual != info.digest:
        raise IntegrityError(
            f"{index.describe(t)} assembled from its {len(chunks)} chunk(s) does not match its logical "
            f"digest: recorded {index.logical.text(info.digest)}, computed {index.logical.text(actual)}; "
            "the checkpoint is damaged or its index does not belong to these files",
            path=info.name, expected=index.logical.text(info.digest), actual=index.logical.text(actual),
        )
    if bad_bool is not None:
        raise FormatError(f"{index.describe(t, chunks[bad_bool])} is bool but holds a byte other than 0 or 1")
    return actual


def read_tensor(index: layout.Index, files: RankFiles, t: int, map_location: Any = None) -> Any:
    """Logical tensor ``t`` assembled from its chunks, verified, with its recorded kind.

    Its buffer is allocated only once every chunk's row is found (:func:`chunk_rows`), so
    an index that claims more bytes than its rank files hold is refused, naming the chunk,
    before anything of that size is allocated.
    """
    info = index.logical.tensors[t]
    rows = chunk_rows(index, files, t)
    buf, mv = tensorbytes.empty_buffer(info.nbytes, info.kind)
    pos = 0

    def copy(piece: memoryview) -> None:
        nonlocal pos
        mv[pos : pos + len(piece)] = piece
        pos += len(piece)

    stream(index, files, t, copy, check_chunks=False, rows=rows)
    value = tensorbytes.finish(buf, info.dtype, info.shape, info.kind, info.name)
    return placement.as_recorded(value, info, map_location, lambda: info.name)


def _open(folder: Any, limits: Limits, storage_options: Any = None) -> layout.Index:
    if isinstance(folder, layout.Index):  # read already (a checkpoint in a store: tensorcanon.dcp.StoreTag)
        return folder
    return layout.read(folder, limits, storage_options)


def logical_digest(folder: str | os.PathLike, *, limits: Limits = DEFAULT, storage_options: Any = None) -> str:
    """The checkpoint's logical digest, read from its (validated) index without reading data."""
    return _open(folder, limits, storage_options).logical_digest


def load_unsharded(folder: str | os.PathLike | layout.Index, *, rank: int | None = None, map_location: Any = None,
                   limits: Limits = DEFAULT, storage_options: Any = None) -> Any:
    """The whole state of a checkpoint in one process: full tensors, original containers, verified.

    ``rank=None`` (the default) gives the logical state, whose
    ``tensorcanon.fingerprint`` is the checkpoint's logical digest; per-rank values
    are left out. ``rank=r`` adds rank ``r``'s per-rank values at their paths, which
    the index guarantees are keys the logical state lacks (layout.read), so the
    logical state's values are exactly those that :func:`verify` covers either way.

    ``folder`` may be a directory URL of object storage (``s3://bucket/run/step100``), with
    ``storage_options`` (docs/STORAGE.md); so may every function of this module.
    """
    index = _open(folder, limits, storage_options)
    if rank is not None and (type(rank) is not int or not 0 <= rank < index.world_size):
        from ..format.errors import UsageError

        raise UsageError(f"rank must be an int in [0, {index.world_size}) for this checkpoint, not {rank!r}")
    with RankFiles(index, limits) as files:
        if map_location is not None:
            placement.check_all(index.logical.tensors, map_location, lambda t: index.describe(t))
        values = [read_tensor(index, files, t, map_location) for t in range(len(index.logical.tensors))]
        root = Decoder(values, limits.max_depth, max_string_bytes=limits.max_string_array_bytes).decode(
            index.logical.root)
        if rank is not None and index.per_rank:
            f = files.get(rank)
            for path, key in zip(index.per_rank, index.per_rank_keys, strict=True):
                _insert(root, path, f.value(key, limits))
    return root


def _insert(root: Any, path: tuple, value: Any) -> None:
    """Put a per-rank value back at its path. layout.read checked the path against the logical
    tree: it leads through dicts (by key, in canonical order) and lists to a dict that lacks
    its last key."""
    parent = root
    for k in path[:-1]:
        if type(parent) is list or k in parent:
            parent = parent[k]
        else:  # a key equal to itself only canonically: a NaN (Python's == says no)
            parent = next(v for key, v in parent.items() if sort_key(key) == sort_key(k))
    parent[path[-1]] = value


def verify(folder: str | os.PathLike | layout.Index, *, expect: str | None = None, limits: Limits = DEFAULT,
           storage_options: Any = None) -> str:
    """Check every byte of a checkpoint and return its logical digest.

    Validates the index, opens every rank file (checking its digest against the
    index and that it holds exactly the chunks and per-rank values the index
    assigns to it), re-hashes every chunk and recomputes every logical tensor
    digest, hence the logical digest, and runs on the verified bytes the checks load makes on
    values (docs/FORMAT.md §6.12: sparse indices, jagged offsets), in the logical state and in
    every rank's per-rank values. ``expect`` must then equal the logical digest.
    """
    if expect is not None and not digest.is_text(expect):
        raise UsageError(f"expect={digest.text_error(expect)}")
    index = _open(folder, limits, storage_options)
    with RankFiles(index, limits) as files:
        wanted: list[set] = [set(index.per_rank_keys) for _ in range(index.world_size)]
        for t, chunks in enumerate(index.chunks):
            for c in chunks:
                wanted[c.rank].add(index.key(t, c))
        for r in range(index.world_size):
            f = files.get(r)
            have = set(f.keys())
            if have != wanted[r]:
                extra, lost = sorted(map(str, have - wanted[r]))[:3], sorted(wanted[r] - have)[:3]
                raise FormatError(
                    f"rank file {f.path} does not hold what the index assigns to rank {r}"
                    + (f"; unexpected {extra}" if extra else "") + (f"; missing {lost}" if lost else "")
                )
            for key in index.per_rank_keys:
                f.value(key, limits)  # decodes and verifies every tensor in it, with load's checks
        kept = tensorkinds.kept_rows(index.value_checks)
        for t in range(len(index.logical.tensors)):
            part = kept.get(t)
            stream(index, files, t, None if part is None else part.extend)
        # the checks load makes on the built tensor kinds (sparse indices, jagged offsets), on the
        # verified bytes of their parts: a checkpoint that verifies loads (docs/FORMAT.md §6.12)
        tensorkinds.run_deferred(index.value_checks, index.logical.tensors, kept.__getitem__)
    found = index.logical_digest
    if expect is not None and found != expect:
        raise IntegrityError(f"logical digest is {found}, expected {expect}", expected=expect, actual=found)
    return found


def _keeping(parts: set[int], t: int, kept: dict[int, bytearray],
             sink: Callable[[memoryview], object] | None = None) -> Callable[[memoryview], object] | None:
    """``sink`` for logical tensor ``t``, which also copies the bytes into ``kept[t]`` when ``t`` is one
    of ``parts``, whose values FORMAT.md §6.12 checks (sparse indices, jagged offsets:
    :func:`_check_values`)."""
    if t not in parts:
        return sink
    buf = kept[t] = bytearray()
    if sink is None:
        return buf.extend

    def both(piece: memoryview) -> None:
        buf.extend(piece)
        sink(piece)
    return both


def _check_values(index: layout.Index, kept: dict[int, bytearray]) -> None:
    """The checks of §6.12 on the values of parts (kept by :func:`_keeping`, once verified): what a
    load of the logical state checks, so that verify and consolidate refuse what load refuses."""
    try:
        tensorkinds.run_deferred(index.value_checks, index.logical.tensors, kept.__getitem__)
    except TensorCanonError as e:
        raise with_context(e, f"index {layout.index_path(index.folder)}: logical manifest: ") from None


def _refuse_own_file(folder: str, out: str) -> None:
    """UsageError when ``out`` is (by name, symlink or hard link: the same device and inode) the
    checkpoint folder or a file in it: writing it would destroy the checkpoint being read."""
    if not os.path.exists(out):
        return  # nothing there yet (or unreachable: the write says why)
    mine = [folder]
    try:
        mine += [e.path for e in os.scandir(folder)]
    except OSError:
        return  # not a folder: _open says so
    path = regular.same_file(out, mine)
    if path is not None:
        what = "the checkpoint folder" if path == folder else f"{path}, a file of the checkpoint"
        raise UsageError(f"cannot consolidate into {out}: it is {what} being read, which writing it "
                         "would destroy; write the file elsewhere")


def _refuse_own_object(index: layout.Index, out: str | os.PathLike, options: Any) -> None:
    """UsageError when ``out``, by any path or URL (``memory://a`` or ``memory:///a``, a ``local://``
    URL of a local file, a symlink), is the checkpoint's folder or prefix, its index or one of its
    rank files (storage.written_over); or, for an object, the prefix of another checkpoint, which the
    object would make ambiguous (storage.refuse_shadowing). Checked before a byte is written."""
    mine = [index.folder, layout.index_path(index.folder)] + [index.file_path(r) for r in range(index.world_size)]
    hit = storage.written_over(out, mine, options)
    if hit is not None:
        what = "the checkpoint" if hit == index.folder else f"{storage.redact(hit)}, a file of the checkpoint"
        raise UsageError(f"cannot consolidate into {storage.redact(os.fspath(out))}: it is {what} being read, which "
                         "writing it would destroy; write the file elsewhere")
    name = os.fspath(out)
    if storage.is_url(name) and storage.local_path(name) is None:
        store, path = storage.open_store(name, options)
        if store.local() is None:
            storage.refuse_shadowing(store, path)


def consolidate(folder: str | os.PathLike | layout.Index, out: str | os.PathLike, *, limits: Limits = DEFAULT,
                storage_options: Any = None) -> str:
    """Write the checkpoint as one ordinary tensorcanon file; return its digest (the logical digest).

    The file's bytes are those of ``tensorcanon.dumps(state)`` for the logical state
    held in one process (tensors on the CPU). Tensors are streamed from the rank
    files into the output one piece at a time, each verified as it passes; the
    output is written atomically and removed if anything fails to verify. ``folder`` and ``out``
    may be URLs of object storage (both reached with ``storage_options``): the output is then
    one object, which appears only complete (docs/STORAGE.md).
    """
    out_url = storage.is_url(os.fspath(out)) and storage.local_path(os.fspath(out)) is None
    if not out_url and not layout.is_remote(folder) and not isinstance(folder, layout.Index):
        _refuse_own_file(os.fspath(folder), storage.local_path(os.fspath(out)) or os.fspath(out))
    index = _open(folder, limits, storage_options if layout.is_remote(folder) or not out_url else None)
    _refuse_own_object(index, out, storage_options)
    infos = index.logical.tensors
    header, data_size = index.consolidated_header()
    order = sorted(range(len(infos)), key=lambda t: infos[t].begin)  # data order

    def fill(f: BinaryIO, tmp: str) -> str:
        f.write(header)
        kept: dict[int, bytearray] = {}
        parts = {i for check in index.value_checks for i in check.indices}
        with RankFiles(index, limits) as files:
            for t in order:
                stream(index, files, t, _keeping(parts, t, kept, f.write), check_chunks=False)
        _check_values(index, kept)  # (a file load would refuse is removed, not left)
        return index.logical_digest

    try:
        if out_url:
            from ..io import remote

            store, path = storage.open_store(os.fspath(out), storage_options)
            return remote.write_object(store, path, lambda f: fill(f, ""), hold=len(header),
                                       total=len(header) + data_size)
        return writer.replace_atomically(out, fill)
    except TensorCanonError as e:
        raise with_context(e, f"consolidating {storage.redact(index.folder)}: ") from None


__all__ = ["stream", "read_tensor", "logical_digest", "load_unsharded", "verify", "consolidate"]
