"""Every read of a checkpoint's files goes through this module.

An index or a rank file is first validated by the library's own validated-file
object (today :func:`tensorcanon.open`: header, manifest and tree, with the
checks of docs/FORMAT.md §9) before anything in it is used. Tensor bytes are
then taken from a read-only memory map of the same file, without a copy, and
hashed against their digest before use (:meth:`RankFile.verified`).

Kept in one place so that the switch to the reader's public validated-file
object (being factored out of reader.py/lazy.py) is a change here only.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Callable

import numpy as np
import torch

from .. import digest as _digest
from .. import reader
from ..errors import FormatError, IntegrityError, TensorCanonError
from ..lazy import LazyFile
from ..limits import DEFAULT, Limits
from ..manifest import TensorInfo
from ..tree import Decoder
from .errors import CheckpointNotFoundError


def with_context(e: TensorCanonError, prefix: str) -> TensorCanonError:
    """A copy of ``e`` (same class, same attributes) whose message starts with ``prefix``.

    Built without calling the class's ``__init__`` (whose signatures differ), so it
    works for every tensorcanon error.
    """
    cls = type(e)
    out = cls.__new__(cls)
    out.__dict__.update(e.__dict__)
    message = str(e)
    out.args = (message if message.startswith(prefix) else prefix + message,)
    return out


def _validated(path: str, limits: Limits):
    """``(header, manifest)`` of a tensorcanon file, validated by the library's file object."""
    lf = LazyFile(path, verify=True, limits=limits)
    try:
        if lf.manifest is None:
            raise FormatError("is a plain safetensors file, not a tensorcanon file")
        return lf.header, lf.manifest
    finally:
        lf.close()


def read_index_file(path: str, limits: Limits = DEFAULT) -> tuple[Any, str, str]:
    """``(object, file digest, algorithm)`` of an index file. An index holds no tensors
    (everything is in its manifest), so decoding it reads no data."""
    header, m = _validated(path, limits)
    if m.tensors:
        raise FormatError("an index holds no tensors, but this file holds "
                          f"{len(m.tensors)} (is it a rank file?)")
    return reader.decode_tree(m, limits, values=[]), m.text(), m.algorithm


class RankFile:
    """A validated rank file whose tensors are read without a copy from a memory map.

    ``expected`` is the file digest the index records: a file with another digest
    (replaced, edited, from another save) is refused before any tensor is used.
    Chunks are addressed by their key in the file's flat dict.
    """

    def __init__(self, path: str, expected: str | None = None, limits: Limits = DEFAULT) -> None:
        self.path = path
        self._mm: mmap.mmap | None = None
        self._verified: set[int] = set()
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"rank file {path} is missing: the checkpoint is incomplete, or a newer save "
                "replaced it while it was being read"
            ) from None
        try:
            self.header, self.manifest = _validated(path, limits)
            size = os.fstat(fd).st_size
            start = self.header.data_start
            if size != start + self.header.data_size:
                raise FormatError(f"{path} changed while it was being opened")
            if size:
                # ACCESS_COPY: a private mapping whose pages are shared with the page cache until
                # written (never, here); torch accepts its writable buffer without a warning.
                self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
                if self._mm[: len(self.header.raw)] != self.header.raw:
                    raise FormatError(f"{path} changed while it was being opened")
        except TensorCanonError as e:
            self.close()
            raise with_context(e, f"rank file {path}: ") from None
        finally:
            os.close(fd)
        self.digest = self.manifest.text()
        if expected is not None and self.digest != expected:
            self.close()
            raise IntegrityError(
                f"rank file {path} has digest {self.digest} but the index records {expected}: it "
                "was replaced or edited after the checkpoint was saved",
                expected=expected, actual=self.digest,
            )
        root = self.manifest.root
        # The root is a flat dict (validated tree): key -> ["tensor", i] for chunks.
        self._index: dict[str, Any] = {}
        if type(root) is list and root and root[0] == "dict":
            for i in range(1, len(root) - 1, 2):
                self._index[root[i]] = root[i + 1]

    # ------------------------------------------------------------------ contents
    def keys(self) -> list:
        """The keys of the file's flat dict, in canonical order."""
        return list(self._index)

    def info(self, key: str, what: Callable[[], str]) -> TensorInfo:
        """The table row of the tensor stored under ``key``; ``what()`` names it in errors."""
        node = self._index.get(key)
        if type(node) is not list or len(node) != 2 or node[0] != "tensor":
            raise FormatError(f"rank file {self.path} holds no tensor {key!r}, needed for {what()}")
        return self.manifest.tensors[node[1]]

    def raw(self, info: TensorInfo) -> memoryview:
        """The stored bytes of a tensor, not verified (see :meth:`verified`)."""
        if not info.nbytes:
            return memoryview(b"")
        start = self.header.data_start + info.begin
        return memoryview(self._mm)[start : start + info.nbytes]

    def verified(self, info: TensorInfo, what: Callable[[], str]) -> memoryview:
        """The stored bytes of a tensor, hashed against its digest the first time."""
        view = self.raw(info)
        if info.index not in self._verified:
            h = _digest.tensor_hasher(info.dtype.name, info.shape, self.manifest.algorithm)
            h.update(view)
            actual = h.digest()
            if actual != info.digest:
                recorded, computed = self.manifest.text(info.digest), self.manifest.text(actual)
                raise IntegrityError(
                    f"{what()} does not match its digest in rank file {self.path} (stored as "
                    f"{info.name!r}): recorded {recorded}, computed {computed}; the file is damaged",
                    path=info.name, expected=recorded, actual=computed,
                )
            if info.dtype.name == "bool" and len(view) and np.frombuffer(view, np.uint8).max() > 1:
                raise FormatError(f"{what()} is bool but holds a byte other than 0 or 1 "
                                  f"(rank file {self.path})")
            self._verified.add(info.index)
        return view

    def tensor(self, info: TensorInfo, what: Callable[[], str]) -> torch.Tensor:
        """A verified tensor of the stored dtype and shape that *views* the map (no copy).

        Read from it only; it is valid until :meth:`close`.
        """
        view = self.verified(info, what)
        t = info.dtype.torch
        if not len(view):
            return torch.empty(info.shape, dtype=t)
        return torch.frombuffer(view, dtype=torch.uint8).view(t).reshape(info.shape)

    def value(self, key: str, limits: Limits = DEFAULT) -> Any:
        """The value stored under ``key`` (any tree, e.g. a per-rank value), copied and verified."""
        node = self._index.get(key)
        if node is None:
            raise FormatError(f"rank file {self.path} holds no value {key!r}")
        decoder = Decoder([None] * len(self.manifest.tensors), limits.max_depth, build_objects=False)
        decoder.uses = []
        decoder.used = [True] * len(decoder.used)  # a subtree: the whole tree's table order was checked
        decoder.decode(node)
        values: list[Any] = [None] * len(self.manifest.tensors)
        for _, i in decoder.uses:
            if values[i] is None:
                info = self.manifest.tensors[i]
                data = self.verified(info, lambda: f"tensor {info.name!r} of {key!r}")
                buf, mv = _fresh(info)
                mv[:] = data
                from ..tensorbytes import finish

                value = finish(buf, info.dtype, info.shape, info.kind, info.name)
                values[i] = reader.as_recorded(value, info, None, lambda: info.name)
        build = Decoder(values, limits.max_depth)
        build.used = [True] * len(values)
        return build.decode(node)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a tensor still views the map: let the GC unmap it later
                pass
            self._mm = None

    def __enter__(self) -> "RankFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fresh(info: TensorInfo):
    from ..tensorbytes import empty_buffer

    return empty_buffer(info.nbytes, info.kind)


class RankFiles:
    """The rank files of one checkpoint, each opened (and checked against the index) once."""

    def __init__(self, folder_index, limits: Limits = DEFAULT) -> None:
        self.index = folder_index
        self.limits = limits
        self._open: dict[int, RankFile] = {}

    def get(self, rank: int) -> RankFile:
        f = self._open.get(rank)
        if f is None:
            try:
                f = RankFile(self.index.file_path(rank), self.index.files[rank], self.limits)
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

    def __enter__(self) -> "RankFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
