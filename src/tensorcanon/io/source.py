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
import ctypes
import errno
import functools
import mmap
import os
import sys
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from ..format import tensorbytes
from ..format.errors import FileAccessError, FormatError, UsageError
from . import storage
from .regular import directory_error, open_fd, open_path

__all__ = ["Source", "opened", "of_object", "map_file", "map_bytes", "open_fd", "open_path", "directory_error"]

if TYPE_CHECKING:
    import torch


class Source:
    """Exact reads from a binary file object or a bytes-like object.

    ``pos`` and ``size`` count from where the file starts (a file object's
    position when the Source was made). ``size`` is None for a stream whose
    length cannot be known (a pipe). A Source over bytes, a memory map or a
    seekable file also reads at any offset (:meth:`seek`).
    """

    def __init__(self, f: BinaryIO | None = None, data: Any = None, name: str | None = None,
                 mapped: torch.Tensor | None = None, span: tuple[int, int] | None = None,
                 keep: Any = None) -> None:
        self.f = f
        self.name = name
        self.data: memoryview | None = None if data is None else memoryview(data).cast("B")
        # A file mapped by map_file: a uint8 tensor over the whole mapping (``data`` views it),
        # so that tensors can view the file's bytes too (Source.tensor).
        self.mapped = mapped
        # A mapped file, either way: (address, length) of its mapping, for populate and shrunk;
        # ``keep`` holds a byte map (map_bytes) that ``data`` views, to close it on release.
        self.span = span if span is not None or mapped is None else (mapped.data_ptr(), mapped.numel())
        self._keep = keep
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
    def file_base(self) -> int:
        """Where this Source's offset 0 is in the underlying file object (its position when made)."""
        return self._base

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
            chunk = self._read_some(n)
            while chunk is not None and len(chunk) < n:
                more = self._read_some(n - len(chunk))
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
        got = self.fill(buf)
        if got < len(buf):
            raise FormatError(f"file ends inside the {what}: {len(buf) - got} bytes missing", offset=self.pos)

    def fill(self, buf: memoryview) -> int:
        """Read up to ``len(buf)`` bytes into ``buf``, as many as the file still has; the count.

        For a caller that reads many tensors at once and names the one the file
        ends inside when it comes up short.
        """
        n = len(buf)
        if self.data is not None:
            got = max(0, min(n, len(self.data) - self.pos))
            buf[:got] = self.data[self.pos : self.pos + got]
        else:
            got = 0
            readinto = getattr(self.f, "readinto", None)
            while got < n:
                k = readinto(buf[got:]) if readinto is not None else self._read_into(buf[got:])
                if not k:
                    break
                got += k
        self.pos += got
        return got

    def _read_some(self, n: int) -> bytes | None:
        """``f.read(n)``, checked: bytes of at most ``n`` (None: a non-blocking stream has none yet)."""
        chunk = self.f.read(n)  # type: ignore[union-attr]
        if chunk is None:
            return None
        if not isinstance(chunk, (bytes, bytearray, memoryview)):
            raise UsageError(f"the file object's read() returned {type(chunk).__name__}, not bytes: "
                             "open the file in binary mode ('rb')")
        if len(chunk) > n:
            raise UsageError(f"the file object's read({n}) returned {len(chunk)} bytes, more than asked: "
                             "it is not a binary file object")
        return bytes(chunk)

    def _read_into(self, buf: memoryview) -> int:
        """``readinto`` for a file object that has only ``read`` (gzip-like wrappers, mocks)."""
        chunk = self._read_some(len(buf))
        if not chunk:
            return 0
        buf[: len(chunk)] = chunk
        return len(chunk)

    def view(self, offset: int, n: int) -> memoryview | None:
        """The ``n`` bytes at ``offset`` without a copy, when the Source holds them in memory."""
        if self.data is None or offset + n > len(self.data):
            return None
        return self.data[offset : offset + n]

    def tensor(self, offset: int, n: int) -> torch.Tensor | None:
        """A uint8 tensor viewing the ``n`` bytes at ``offset`` of a mapped file (no copy), else None.

        The view keeps the mapping alive: it outlives this Source and the file's closing.
        """
        if self.mapped is None or offset + n > self.mapped.numel():
            return None
        return self.mapped[offset : offset + n]

    def populate(self, offset: int, n: int) -> bool:
        """Map the pages of bytes ``offset`` to ``offset + n`` of a mapped file in one call, as
        reading them would (Linux's ``MADV_POPULATE_READ``; the GIL is released meanwhile).

        False where that cannot be done (no map, another system, a kernel before 5.14, a
        file cut short under the map): reading the bytes then maps their pages as usual.
        For a thread that helps another read a large tensor of the map (reader.py).
        """
        if self.span is None or n <= 0 or offset < 0 or offset + n > self.span[1]:
            return False
        madvise = _madvise()
        if madvise is None:
            return False
        base = self.span[0]  # the start of the mapping: page-aligned
        lo = (base + offset) & ~(_PAGE - 1)
        return madvise(lo, base + offset + n - lo, _MADV_POPULATE_READ) == 0

    def shrunk(self) -> bool:
        """True when the mapped file is now shorter than its map: another process truncated it,
        and reading the lost pages would kill the process with SIGBUS.

        Asks Linux whether the map's last page can still be read (``MADV_POPULATE_READ``,
        5.14 and later); False where that cannot be known (no map, another system, an
        older kernel). A file cut short after this check, while its pages are read, still
        raises SIGBUS: the check narrows that window to one read, it does not close it.
        """
        if self.span is None or not self.span[1]:
            return False
        madvise = _madvise()
        if madvise is None:
            return False
        last = (self.span[0] + self.span[1] - 1) & ~(_PAGE - 1)
        return madvise(last, _PAGE, _MADV_POPULATE_READ) != 0 and ctypes.get_errno() == errno.EFAULT

    def release(self) -> None:
        """Drop this Source's view of its bytes; a mapping is unmapped once no tensor views it."""
        if self.data is not None:
            self.data.release()
            self.data = None
        self.mapped = None
        self.span = None
        keep, self._keep = self._keep, None
        if keep is not None:
            with contextlib.suppress(BufferError):  # views of it remain (tensors): unmapped with the last
                keep.close()


_PAGE = mmap.PAGESIZE
_MADV_POPULATE_READ = 22  # <linux/mman.h>, Linux 5.14 and later


@functools.cache
def _madvise() -> Any:
    """libc's ``madvise`` (a ctypes function, which releases the GIL while it runs) on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def map_file(name: str) -> Source:
    """A Source over a private, copy-on-write memory map of the file at ``name``.

    The map is held by a torch storage, as ``torch.load(mmap=True)`` holds
    its own: it stays mapped while any tensor viewing it is alive (however
    long after the Source is released), and is unmapped when the last goes.
    No file descriptor stays open. Writes to a tensor that views the map copy
    the page touched (the file never changes); another process that changes
    the file in place changes the pages this process has not written to, and
    one that truncates it makes reading the lost pages fail with SIGBUS
    (docs/SECURITY.md, "Memory-mapped reading"). Files that tensorcanon
    saves are replaced by a rename, which leaves a map of the old file
    intact.
    """
    import torch  # the Source module stays importable without torch for the rest

    with open_path(name) as fh:
        st = os.fstat(fh.fileno())
        if not st.st_size:  # nothing to map; the header check reports the empty file
            return Source(data=b"", name=name)
        # Map the file this descriptor opened, not whatever the path names a moment later.
        by_fd = f"/proc/self/fd/{fh.fileno()}"
        target = by_fd if os.path.exists(by_fd) else name
        try:
            # (filename, shared, nbytes) positionally: the keyword names changed across torch versions
            storage = torch.UntypedStorage.from_file(target, False, st.st_size)
        except RuntimeError as e:
            raise FileAccessError(f"cannot map {name!r}: {e}", filename=name) from None
        if target is name:
            now = os.stat(name)
            if (now.st_ino, now.st_dev, now.st_size) != (st.st_ino, st.st_dev, st.st_size):
                raise FileAccessError(f"cannot map {name!r}: it was replaced while being opened; "
                                      "open it again", filename=name)
    mapped = tensorbytes.host_empty(0, torch.uint8).set_(cast(torch.UntypedStorage, storage))  # (its stub says less)
    return Source(data=mapped.numpy(), name=name, mapped=mapped)


def map_plain(name: str) -> Source:
    """A Source over a private, copy-on-write memory map of the file at ``name``, as map_file's,
    for a reader that copies what it reads out of the map (tensorcanon.open): its bytes
    (:meth:`Source.view`), not tensors that view them, and no descriptor kept.

    Made with libc's ``mmap`` where there is one (Linux, macOS), which costs a few microseconds
    where a torch storage over the file (map_file) cost 55 µs, and several hundred right after a
    garbage collection; elsewhere, map_file. The map is released with the last view of its
    bytes (the Source's own, released by :meth:`Source.release`, or any slice of it still held),
    never while one exists."""
    calls = _libc_map()
    if calls is None:
        return map_file(name)
    with open_path(name) as fh:
        size = os.fstat(fh.fileno()).st_size
        if not size:  # nothing to map; the header check reports the empty file
            return Source(data=b"", name=name)
        address = calls[0](None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fh.fileno(), 0)
        if address is None or address == _MAP_FAILED:
            e = ctypes.get_errno()
            raise FileAccessError(f"cannot map {name!r}: {os.strerror(e)}", filename=name, errno=e)
    held = (ctypes.c_char * size).from_address(address)
    unmap = weakref.finalize(held, calls[1], address, size)  # unmapped when nothing views it any more
    unmap.atexit = False  # (at exit the process's end unmaps it: no view is left dangling meanwhile)
    return Source(data=held, name=name, span=(address, size))


_MAP_FAILED = ctypes.c_void_p(-1).value


@functools.cache
def _libc_map() -> tuple[Any, Any] | None:
    """libc's ``mmap`` and ``munmap`` (ctypes functions, which release the GIL while they run),
    or None off Linux and macOS or where they cannot be found."""
    if not (sys.platform.startswith("linux") or sys.platform == "darwin"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mmap_fn, munmap_fn = libc.mmap, libc.munmap
    except (OSError, AttributeError):
        return None
    mmap_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    mmap_fn.restype = ctypes.c_void_p
    munmap_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    munmap_fn.restype = ctypes.c_int
    return mmap_fn, munmap_fn


def map_bytes(name: str) -> Source:
    """A Source over a read-only memory map of the file at ``name``, without torch: its bytes
    (:meth:`Source.view`), not tensors that view them. What the readers of a sharded checkpoint's
    rank files use, with or without torch: they hash the bytes where they lie and copy out what
    they load. Private and copy-on-write, as map_file's. The map is released with the Source, or
    with the last view of it still held."""
    with open_path(name) as fh:
        size = os.fstat(fh.fileno()).st_size
        if not size:  # nothing to map; the header check reports the empty file
            return Source(data=b"", name=name)
        try:
            mm = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:
            raise FileAccessError(f"cannot map {name!r}: {e}", filename=name) from None
    anchor = ctypes.c_char.from_buffer(mm)  # (writable: a private map) for its address
    span = (ctypes.addressof(anchor), size)
    del anchor  # (it holds the map's buffer: release it, or the map could not be closed)
    return Source(data=mm, name=name, span=span, keep=mm)


@contextlib.contextmanager
def opened(f: Any, *, use_mmap: bool = False, tensors: bool = True) -> Iterator[Source]:
    """A :class:`Source` for a path, a binary file object or a bytes-like object.

    A path is opened (and closed on exit); with ``use_mmap`` it is memory-mapped
    (:func:`map_file`), so the Source can hand out views of its bytes
    (:meth:`Source.view`) and tensors that view them (:meth:`Source.tensor`);
    with ``tensors=False`` too, views of its bytes only, without torch (:func:`map_bytes`).
    A URL (``s3://…``, or a :class:`~tensorcanon.io.storage.Location`) is read by
    ranged reads of the object (remote.py); a ``file://`` URL is a path.
    """
    if isinstance(f, storage.Location) or storage.is_url(f):
        f = storage.resolve(f)
        if isinstance(f, storage.Location):
            from . import remote

            if use_mmap:
                raise remote.refuse_mmap(f)
            held, obj = remote.open_object(f)
            with held:
                yield Source(obj, name=held.name)
            return
    if isinstance(f, (bytes, bytearray, memoryview)):
        yield Source(data=f)
        return
    if isinstance(f, (str, os.PathLike)):
        name = os.fspath(f)
        if use_mmap:
            src = map_file(name) if tensors else map_bytes(name)
            try:
                yield src
            finally:
                src.release()
            return
        with open_path(name) as fh:
            yield Source(fh, name=name)
        return
    if hasattr(f, "read"):
        yield Source(f)
        return
    raise UsageError(f"expected a path, a binary file object or bytes, not {type(f).__name__}")


def of_object(loc: storage.Location) -> Source:
    """A Source over the object at ``loc`` (ranged reads), for a caller that closes ``src.f`` itself (lazy.py)."""
    from . import remote

    fh, obj = remote.open_object(loc)
    return Source(obj, name=fh.name)
