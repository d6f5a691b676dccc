"""Lazy access to a saved file: validate everything up front, read tensors on demand.

:func:`open` checks the header and manifest exactly as :func:`tensorcanon.load`
does (the same code), and checks that the object tree is well-formed, before
any tensor is exposed. The data section is memory-mapped; reading one tensor
touches only that tensor's bytes, which are copied out of the map and, by
default, verified against their digest on first access, with the algorithm
the file's manifest names.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

from . import paths, reader
from .errors import TensorCanonError
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
        self._file: reader.CheckedFile | None = reader.open_file(self.path, limits, use_mmap=True)
        try:
            f = self._file
            self.header, self.manifest = f.header, f.manifest
            self._paths: dict[str, int] = {}
            for trail, index in f.uses():  # checks the whole tree, as load does, building nothing
                self._paths.setdefault(paths.join(trail), index)
            self._by_name = {r.name: r.index for r in f.rows}
            self._verified = [False] * len(f.rows)
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
        if self._file is None:
            raise TensorCanonError(f"{self.path!r} is closed")
        idx = self._index(key)
        check = self.verify and not self._verified[idx]
        value = self._file.read(idx, map_location=self.map_location, verify=check)
        if check:
            self._verified[idx] = True
        return value

    # ------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Release the file and its memory map; tensors already read stay valid (they are copies)."""
        f, self._file = self._file, None
        if f is not None:
            f.close()

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
