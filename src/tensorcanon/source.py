"""Where a file's bytes come from: a path, a binary file object, bytes, or a memory map.

A :class:`Source` reads exactly the bytes asked for (a short read is a
:class:`~tensorcanon.FormatError` naming the field that ran out and the byte
offset), keeps the offset for error messages, and knows the size of what it
reads when that can be known. :func:`opened` turns whatever a caller passed
(a path, a file object, bytes) into a Source, mapping the operating system's
errors to the library's own.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from typing import Any, BinaryIO, Iterator

from .errors import FileAccessError, FormatError, MissingFileError, UsageError


class Source:
    """Exact reads from a binary file object or a bytes-like object.

    ``pos`` and ``size`` count from where the file starts (a file object's
    position when the Source was made). ``size`` is None for a stream whose
    length cannot be known (a pipe). A Source over bytes, a memory map or a
    seekable file also reads at any offset (:meth:`seek`).
    """

    def __init__(self, f: BinaryIO | None = None, data: Any = None, name: str | None = None) -> None:
        self.f = f
        self.name = name
        self.data: memoryview | None = None if data is None else memoryview(data).cast("B")
        self.pos = 0
        self.size: int | None = None
        self._base = 0
        if self.data is not None:
            self.size = len(self.data)
            return
        try:
            if f is not None and f.seekable():
                self._base = f.tell()
                self.size = f.seek(0, os.SEEK_END) - self._base
                f.seek(self._base)
        except (AttributeError, OSError):
            self.size = None

    @property
    def random_access(self) -> bool:
        """True when :meth:`seek` works (bytes, a memory map or a seekable file)."""
        return self.size is not None

    def seek(self, offset: int) -> None:
        """Continue reading at ``offset`` (from the start of the file)."""
        if not self.random_access:
            raise UsageError("reading a tensor out of order needs a path, bytes or a seekable file, "
                             "not a stream; use load() to read every tensor in file order")
        if self.data is None:
            self.f.seek(self._base + offset)  # type: ignore[union-attr]
        self.pos = offset

    def read(self, n: int, what: str) -> bytes:
        """The next ``n`` bytes; a :class:`FormatError` naming ``what`` if the file ends first."""
        if self.data is not None:
            chunk: bytes | None = bytes(self.data[self.pos : self.pos + n])
        else:
            chunk = self.f.read(n)  # type: ignore[union-attr]
            while chunk is not None and len(chunk) < n:
                more = self.f.read(n - len(chunk))  # type: ignore[union-attr]
                if not more:
                    break
                chunk += more
        if chunk is None or len(chunk) != n:
            got = 0 if chunk is None else len(chunk)
            raise FormatError(f"file ends inside the {what}: needed {n} bytes, found {got}",
                              offset=self.pos + got)
        self.pos += n
        return chunk

    def readinto(self, buf: memoryview, what: str) -> None:
        """Fill ``buf`` with the next ``len(buf)`` bytes (see :meth:`read`)."""
        n = len(buf)
        if self.data is not None:
            if self.pos + n > len(self.data):
                raise FormatError(f"file ends inside the {what}", offset=len(self.data))
            buf[:] = self.data[self.pos : self.pos + n]
            self.pos += n
            return
        done = 0
        while done < n:
            got = self.f.readinto(buf[done:])  # type: ignore[union-attr]
            if not got:
                raise FormatError(f"file ends inside the {what}: {n - done} bytes missing",
                                  offset=self.pos + done)
            done += got
        self.pos += n

    def view(self, offset: int, n: int) -> memoryview | None:
        """The ``n`` bytes at ``offset`` without a copy, when the Source holds them in memory."""
        if self.data is None or offset + n > len(self.data):
            return None
        return self.data[offset : offset + n]

    def release(self) -> None:
        """Drop this Source's view of its bytes (a memory map can then be closed)."""
        if self.data is not None:
            self.data.release()
            self.data = None


def _os_error(e: OSError, path: str, doing: str) -> FileAccessError:
    if isinstance(e, FileNotFoundError):
        return MissingFileError(f"cannot {doing} {path!r}: no such file", filename=path, errno=errno.ENOENT)
    if isinstance(e, PermissionError):
        return FileAccessError(f"cannot {doing} {path!r}: permission denied; check the file's permissions",
                               filename=path, errno=e.errno)
    return FileAccessError(f"cannot {doing} {path!r}: {e.strerror or e}", filename=path, errno=e.errno)


def open_path(path: str | os.PathLike, doing: str = "read", what: str = "a tensorcanon file") -> BinaryIO:
    """``open(path, "rb", buffering=0)`` with the library's errors (a folder is a FormatError)."""
    name = os.fspath(path)
    try:
        return open(name, "rb", buffering=0)
    except IsADirectoryError:
        raise FormatError(f"{name!r} is a directory, not {what}") from None
    except OSError as e:
        raise _os_error(e, name, doing) from None


@contextlib.contextmanager
def opened(f: Any, *, use_mmap: bool = False) -> Iterator[Source]:
    """A :class:`Source` for a path, a binary file object or a bytes-like object.

    A path is opened (and closed on exit); with ``use_mmap`` it is memory-mapped
    read-only, so the Source can hand out views of its bytes (:meth:`Source.view`).
    """
    if isinstance(f, (bytes, bytearray, memoryview)):
        yield Source(data=f)
        return
    if isinstance(f, (str, os.PathLike)):
        name = os.fspath(f)
        with open_path(name) as fh:
            if not use_mmap:
                yield Source(fh, name=name)
                return
            size = os.fstat(fh.fileno()).st_size
            if not size:  # mmap refuses empty files; the header check reports them
                yield Source(data=b"", name=name)
                return
            try:
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            except OSError as e:
                raise _os_error(e, name, "map") from None
            src = Source(data=mm, name=name)
            try:
                yield src
            finally:
                src.release()
                mm.close()
        return
    if hasattr(f, "read"):
        yield Source(f)
        return
    raise UsageError(f"expected a path, a binary file object or bytes, not {type(f).__name__}")
