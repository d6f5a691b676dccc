"""Lazy access to a saved file: validate everything up front, read tensors on demand.

:func:`open` checks the header and manifest exactly as :func:`tensorcanon.load`
does (the same code), and checks that the object tree is well-formed, before
any tensor is exposed. The data section is memory-mapped; reading one tensor
touches only that tensor's bytes, which are copied out of the map and, by
default, verified against their digest on first access, with the algorithm
the file's manifest names.
"""

from __future__ import annotations

import builtins
import mmap
import os
from typing import Any, Iterator

import torch

from . import digest, paths, reader, tensorbytes
from .errors import FormatError, TensorCanonError
from .gcpause import paused
from .limits import DEFAULT, Limits


class LazyFile:
    """A validated, memory-mapped tensorcanon (or plain safetensors) file.

    Index it by a tensor's path in the saved object (``'$["model"]["fc.weight"]'``,
    as listed by :meth:`keys`) or by its stored name. Each access returns a fresh
    tensor copied from the map; ``verify=True`` checks its digest the first time.
    """

    def __init__(self, path: str | os.PathLike, *, map_location: Any = None, verify: bool = True,
                 limits: Limits = DEFAULT) -> None:
        self.path = os.fspath(path)
        self.map_location = map_location
        self.verify = verify
        try:
            self._fh = builtins.open(self.path, "rb", buffering=0)
        except IsADirectoryError:
            raise FormatError(f"{self.path!r} is a directory, not a tensorcanon file") from None
        self._mm: mmap.mmap | None = None
        try:
            src = reader.Source(self._fh)
            self.header, self.manifest = reader._read_header(src, limits)
            m = self.manifest
            self._paths: dict[str, int] = {}
            if m is not None:
                uses: list = []
                reader.decode_tree(m, limits, uses=uses)  # the checks load makes, building nothing
                for trail, index in uses:  # paths rendered from decoded keys, as in every error
                    self._paths.setdefault(paths.join(trail), index)
                self._infos = m.tensors
            else:
                self._infos = None
                self._paths = {paths.join((e.name,)): i for i, e in enumerate(self.header.entries)}
            self._by_name = {
                e.name: i for i, e in enumerate(m.tensors if m is not None else self.header.entries)
            }
            self._verified = [False] * len(self._by_name)
            if self.header.data_size:
                self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------- mapping API
    def keys(self) -> list[str]:
        """Paths of the tensors in the saved object, in canonical order."""
        return list(self._paths)

    @property
    def names(self) -> list[str]:
        """Stored tensor names (header keys)."""
        return list(self._by_name)

    @property
    def digest(self) -> str | None:
        """The recorded file digest (None for a plain safetensors file)."""
        return self.manifest.text() if self.manifest is not None else None

    @property
    def algorithm(self) -> str | None:
        """The file's digest algorithm, ``"xxh3-128"`` or ``"sha256"`` (None for plain safetensors)."""
        return self.manifest.algorithm if self.manifest is not None else None

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)

    def __contains__(self, key: object) -> bool:
        return key in self._paths or key in self._by_name

    def _index(self, key: str) -> int:
        if isinstance(key, str):
            if key in self._paths:
                return self._paths[key]
            if key in self._by_name:
                return self._by_name[key]
        raise KeyError(f"{key!r} is neither a tensor path (see .keys()) nor a stored tensor name in {self.path!r}")

    def __getitem__(self, key: str) -> Any:
        if self._fh is None:
            raise TensorCanonError(f"{self.path!r} is closed")
        idx = self._index(key)
        if self._infos is None:
            return self._plain(idx)
        info = self._infos[idx]
        buf, mv = tensorbytes.empty_buffer(info.nbytes, info.kind)
        start = self.header.data_start + info.begin
        if info.nbytes:
            with memoryview(self._mm) as whole:
                piece = whole[start : start + info.nbytes]
                mv[:] = piece
                piece.release()
        if self.verify and not self._verified[idx]:
            h = digest.tensor_hasher(info.dtype.name, info.shape, self.manifest.algorithm)
            h.update(mv)
            actual = h.digest()
            if actual != info.digest:
                raise reader._integrity_error(self.manifest, info, actual, self.header.data_start)
            self._verified[idx] = True
        value = tensorbytes.finish(buf, info.dtype, info.shape, info.kind, info.name)
        return reader.as_recorded(value, info, self.map_location,
                                  lambda: reader._tensor_path(self.manifest, info))

    def _plain(self, idx: int) -> torch.Tensor:
        from .dtypes import from_safetensors

        e = self.header.entries[idx]
        row = from_safetensors(e.dtype)
        if row is None or row.torch is None:
            raise FormatError(f"tensor {e.name!r} has dtype {e.dtype}, which torch cannot hold")
        buf, mv = tensorbytes.empty_buffer(e.end - e.begin, "tensor")
        start = self.header.data_start + e.begin
        if len(mv):
            with memoryview(self._mm) as whole:
                piece = whole[start : start + len(mv)]
                mv[:] = piece
                piece.release()
        t = tensorbytes.finish(buf, row, e.shape, "tensor", e.name)
        return reader._place(t, "cpu", self.map_location, lambda: paths.join((e.name,)))

    # ------------------------------------------------------------- lifetime
    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> "LazyFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<tensorcanon.LazyFile {self.path!r}: {len(self)} tensors>"


@paused
def open(path: str | os.PathLike, *, map_location: Any = None, verify: bool = True,  # noqa: A001
         limits: Limits = DEFAULT) -> LazyFile:
    """Open a saved file for lazy, per-tensor access by path.

    The header and manifest are validated in full first (as :func:`load` does);
    each tensor is read from a memory map when indexed, and its digest checked
    the first time (``verify=True``). Reading 1 tensor of 1,000 reads only its bytes.

    Example::

        with tensorcanon.open("ckpt.safetensors") as f:
            print(f.keys()[:3])
            w = f['$["model"]["fc.weight"]']
    """
    return LazyFile(path, map_location=map_location, verify=verify, limits=limits)


__all__ = ["open", "LazyFile"]
