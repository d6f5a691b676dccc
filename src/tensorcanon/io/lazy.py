"""Lazy access to a saved file: prove what is read, when it is read.

:func:`open` maps the file and, before it returns, checks what reading any
one tensor relies on (lazyindex.py): the header length, and that the
manifest is the one the recorded file digest covers. Reading a tensor then
checks its table row and header entry and hashes its bytes (once), so what
it returns is exactly what was saved, in a few hundred microseconds for a
file of a thousand tensors: a :class:`reader.RowReader` reads the rows so
proven. Everything else :func:`tensorcanon.load` checks (the canonical form
of the header, the manifest and the object tree) is checked the first time
something needs the whole file, by making the file's :class:`reader.CheckedFile`:
:meth:`LazyFile.keys`, ``len``, iteration, :meth:`LazyFile.check`, a path or
name the quick lookup cannot resolve, ``verify=False`` (checked in full at
open, as nothing is hashed then) or a plain safetensors file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

from ..format import paths
from ..format.errors import FormatError, TensorCanonError
from ..format.limits import DEFAULT, Limits
from . import lazyindex, reader, source, storage


class LazyFile(Mapping):
    """An open tensorcanon (or plain safetensors) file, read tensor by tensor.

    A read-only mapping from each tensor's path in the saved object
    (``'$["model"]["fc.weight"]'``, as :meth:`keys` lists them) to the tensor;
    a tensor's stored name works as a key too. ``keys``, ``values``,
    ``items``, ``get``, ``in`` and ``len`` work as for a dict; each access
    returns a fresh CPU copy (or a tensor placed by ``map_location``), hashed
    against its digest the first time it is read (``verify=True``).

    Lifetime: use it as a context manager (or call :meth:`close`). The file is
    memory-mapped, without an open file descriptor; closing releases the map.
    Tensors already read are copies and stay valid after close; reading after
    close raises. Another process rewriting the file in place while it is open
    can change the bytes of tensors not yet read (they then fail their digest)
    and, by truncating it, make reading them kill the process with SIGBUS, as
    with any memory-mapped file; tensorcanon's own saves replace files by a
    rename, which leaves an open file's map intact.

    An object in a store (a URL) is read by ranged reads instead of a map: the
    header, then only the bytes of the tensors read (docs/STORAGE.md).
    """

    def __init__(self, path: str | os.PathLike | bytes, *, map_location: Any = None, verify: bool = True,
                 limits: Limits = DEFAULT, storage_options: Any = None) -> None:
        self.map_location = map_location
        self.verify = verify
        self._limits = limits
        self._src: source.Source | None
        path = storage.resolve(path, storage_options)
        if isinstance(path, (bytes, bytearray, memoryview)):  # a file's bytes, already in memory
            self.path = "<bytes>"
            self._src = source.Source(data=path)
        elif isinstance(path, storage.Location):  # an object in a store: ranged reads
            self.path = path.display
            self._src = source.of_object(path.but(sequential=False))
        else:
            self.path = os.fspath(path)
            self._src = source.map_plain(self.path)
        self._full: reader.CheckedFile | None = None
        self._quick: lazyindex.QuickIndex | None = None
        self._quick_reader: reader.RowReader | None = None  # reads the rows self._quick proves
        self._verified: set[int] = set()
        self._paths: dict[str, int] | None = None  # path text -> table index (_path_index)
        try:
            if verify:
                try:
                    self._quick = lazyindex.QuickIndex(self._src, limits)
                except lazyindex.NotQuick:
                    pass
            if self._quick is None:
                self._checked()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ the whole file
    def _open_src(self) -> source.Source:
        if self._src is None:
            raise TensorCanonError(f"{self.path!r} is closed")
        return self._src

    def _checked(self) -> reader.CheckedFile:
        """The file checked in full (as load checks it, without hashing tensor data); once."""
        if self._full is None:
            src = self._open_src()
            q = self._quick
            if q is None:
                src.seek(0)
            # (the header bytes the quick index read: every check is made on them again)
            f = reader.CheckedFile(src, self._limits, raw_header=None if q is None else (q.prefix, q.raw))
            f.check_tree()  # the whole tree, building nothing (paths only when asked: _path_index)
            # the values of index parts (sparse indices, jagged offsets), which load checks too:
            # read (and proven) alone, so check() refuses what load refuses (FORMAT.md §6.12)
            proven = f.check_values(verify=self.verify)
            if self.verify:
                self._verified.update(proven)
            self._by_name = {r.name: r.index for r in f.rows}
            self._full = f
        return self._full

    def _path_index(self) -> dict[str, int]:
        """Path text -> table index of every tensor use, built on first need: the text of every
        use of a deep tree costs far more than the bytes that encode it, and check() needs none."""
        f = self._checked()
        if self._paths is None:
            found: dict[str, int] = {}
            for trail, index in f.uses():
                found.setdefault(paths.join(trail), index)
            self._paths = found
        return self._paths

    def check(self) -> None:
        """Check the whole file now, as :func:`tensorcanon.load` does but without hashing tensor
        data (:func:`tensorcanon.verify` hashes it all); raises what load would raise."""
        self._checked()

    @property
    def header(self) -> Any:
        return self._checked().header

    @property
    def manifest(self) -> Any:
        return self._checked().manifest

    # ------------------------------------------------------------------ mapping protocol
    def keys(self) -> list[str]:  # type: ignore[override]
        """Paths of the tensors in the saved object, in canonical order."""
        return list(self._path_index())

    @property
    def names(self) -> list[str]:
        """Stored tensor names (header keys)."""
        self._checked()
        return list(self._by_name)

    @property
    def digest(self) -> str | None:
        """The recorded file digest (None for a plain safetensors file)."""
        if self._full is None and self._quick is not None:
            return digest_text(self._quick)
        m = self._checked().manifest
        return m.text() if m is not None else None

    @property
    def algorithm(self) -> str | None:
        """The file's digest algorithm, ``"xxh3-128"`` or ``"sha256"`` (None for plain safetensors)."""
        if self._full is None and self._quick is not None:
            return self._quick.algorithm
        m = self._checked().manifest
        return m.algorithm if m is not None else None

    def __iter__(self) -> Iterator[str]:
        return iter(self._path_index())

    def __len__(self) -> int:
        return len(self._path_index())

    def __contains__(self, key: object) -> bool:
        if self._full is None and self._quick is not None:
            try:
                if self._quick.index_of(key) is not None:
                    return True
            except lazyindex.NotQuick:
                pass
        self._checked()
        return key in self._by_name or key in self._path_index()

    def _index(self, key: str) -> int:
        self._checked()
        if isinstance(key, str):
            found = self._path_index()
            if key in found:
                return found[key]
            if key in self._by_name:
                return self._by_name[key]
            below = [p for p in self._path_index() if p.startswith(key + "[")]
            if below:  # a sparse, nested or registered tensor (FORMAT.md §6.12), or a container
                raise KeyError(
                    f"{key!r} in {self.path!r} is not one stored tensor: the tensors below it are "
                    f"{', '.join(below[:4])}{', ...' if len(below) > 4 else ''} (a sparse, nested or registered "
                    "subclass tensor is stored as its parts); read those, or tensorcanon.load the file")
        raise KeyError(f"{key!r} is neither a tensor path (see .keys()) nor a stored tensor name in {self.path!r}")

    def __getitem__(self, key: str) -> Any:
        src = self._open_src()
        if src.shrunk():  # (lazyred) truncated since open: reading its lost pages would be SIGBUS
            raise FormatError(f"{self.path} is shorter than when it was opened: another program truncated it "
                              "(SECURITY.md, memory-mapped reading); open it again once it is complete")
        if self._full is None and self._quick is not None:
            value = self._quick_read(src, key)
            if value is not _MISSING:
                return value
        idx = self._index(key)
        check = self.verify and idx not in self._verified
        value = self._checked().read(idx, map_location=self.map_location, verify=check)
        if check:
            self._verified.add(idx)
        return value

    def _quick_read(self, src: source.Source, key: str) -> Any:
        """The tensor at ``key``, proven by itself (lazyindex.py); _MISSING where the whole file must
        be checked first (a lookup it cannot resolve, any failure: the full check names it)."""
        q = self._quick
        assert q is not None
        try:
            idx = q.index_of(key)
            if idx is None:
                return _MISSING
            info = q.info(idx)
            if self._quick_reader is None:
                self._quick_reader = reader.RowReader(src, self._limits, q.data_start, q.algorithm)
            check = idx not in self._verified
            value = self._quick_reader.read_row(info, map_location=self.map_location, verify=check)
        except (lazyindex.NotQuick, TensorCanonError):
            return _MISSING
        if check:
            self._verified.add(idx)
        return value

    def __eq__(self, other: object) -> bool:  # identity, not "same items" (that would read every tensor)
        return self is other

    __hash__ = object.__hash__

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Release the file's map; tensors already read stay valid (they are copies)."""
        src, self._src = self._src, None
        self._full = self._quick_reader = self._quick = None
        if src is not None:
            src.release()
            if src.f is not None:  # an object in a store: its reader's connections and threads
                src.f.close()

    def __enter__(self) -> LazyFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._src is None else (
            f"{len(self)} tensors" if self._full is not None else "open")
        return f"<tensorcanon.LazyFile {self.path!r}: {state}>"


_MISSING = object()


def digest_text(q: lazyindex.QuickIndex) -> str:
    from ..format import digest

    return digest.to_text(q.digest, q.algorithm)


def open(path: str | os.PathLike | bytes, *, map_location: Any = None, verify: bool = True,
         limits: Limits = DEFAULT, storage_options: Any = None) -> LazyFile:
    """Open a saved file (a path, or its bytes) for lazy, per-tensor access by path (or stored name).

    Before returning, checks that the manifest is the one the file's digest
    covers; each tensor read is then proven on its own (its table row, header
    entry and bytes, hashed the first time it is read), and the rest of the
    file is checked in full the first time something needs all of it (see
    :class:`LazyFile`). With ``verify=False`` the whole file is checked at
    open and tensor bytes are never hashed. Reading 1 tensor of 1,000 reads
    and hashes only its bytes. A URL (``s3://bucket/key``, with ``storage_options``
    as for :func:`tensorcanon.load`) reads the header, then each tensor's bytes
    by ranged reads when it is first read.

    Example::

        with tensorcanon.open("ckpt.safetensors") as f:
            w = f['$["model"]["fc.weight"]']
            print(len(f), f.keys()[:3])   # these check the whole file first
    """
    name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    with reader.naming(name):  # (its errors name the file)
        return LazyFile(path, map_location=map_location, verify=verify, limits=limits,
                        storage_options=storage_options)


__all__ = ["open", "LazyFile"]
