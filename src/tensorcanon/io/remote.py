"""tensorcanon files in object storage: the file objects the reader and the writer use for a URL.

:class:`RemoteFile` is a read-only, seekable file over ranged reads of one object
(storage.ObjectReader). Read sequentially (``load``, ``verify``) it keeps up to
:data:`AHEAD` bytes in flight ahead of the reader, fetched in parallel pieces of
:data:`PIECE` bytes; read at random (``tensorcanon.open``) it fetches what is asked
and, while reads stay sequential, half as much again as has been read in a row,
so reading one tensor of a large file fetches little more than its header and
that tensor (at most half as much again).

:class:`ObjectWriter` is the writer's target for an S3 object. writer.write fills
a seekable target in one pass: a header of known size is reserved, every tensor
is hashed and written, then the header is written over the reserved bytes. An
object store cannot seek, but a multipart upload's parts can be sent in any
order: the first part (the header, and enough data for S3's 5 MiB minimum) is
held in memory while the later parts are uploaded as they fill, at most
:data:`IN_FLIGHT` at a time, and it is sent last. The object appears when the
upload completes; any error aborts it. Memory: the first part, the part being
filled and ``IN_FLIGHT`` parts being sent (each with what the HTTP client holds
of it), whatever the size of the file: about 100 MiB measured, for 64 MiB as for
512 MiB (benchmarks/remote_bench.py).

Stores without multipart uploads get the writer's sequential target
(storage.Store.writer): a hashing pass, then the header and the data.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO, TypeVar

from ..format.errors import FileAccessError, FormatError, TensorCanonError, UsageError
from . import storage, writer

__all__ = ["RemoteFile", "ObjectWriter", "save", "open_object", "open_binary", "size", "read_bytes"]

PIECE = 16 << 20       # bytes per ranged read
AHEAD = 64 << 20       # bytes read ahead of a sequential reader
READERS = 8            # ranged reads in flight at once
PART = 8 << 20         # bytes per uploaded part (S3: 5 MiB at least, 10,000 parts at most)
IN_FLIGHT = 4          # parts uploading at once
MAX_PARTS = 10_000
_T = TypeVar("_T")


class RemoteFile(io.RawIOBase):
    """A seekable, read-only binary file over ranged reads of one object (see the module docstring)."""

    def __init__(self, obj: storage.ObjectReader, *, sequential: bool = True) -> None:
        super().__init__()
        self._obj = obj
        self.name = obj.url
        self.size = obj.size
        self.sequential = sequential
        self._pos = 0
        self._window: collections.deque[tuple[int, int, Future[bytes]]] = collections.deque()
        self._run_start = 0  # where the current run of sequential reads began
        self._pool: ThreadPoolExecutor | None = None

    @property
    def requested(self) -> int:
        """Bytes asked of the store so far (prefetched ones included)."""
        return self._obj.requested

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if self.closed:
            raise ValueError("I/O operation on closed file")
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, b: Any) -> int:
        if self.closed:
            raise ValueError("I/O operation on closed file")
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), self.size - self._pos))
        if n:
            self._fill(self._pos, out[:n])
            self._pos += n
        return n

    def _submit(self, lo: int, hi: int) -> Future[bytes]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READERS, thread_name_prefix="tensorcanon-fetch")
        return self._pool.submit(self._obj.fetch, lo, hi)

    def _fill(self, pos: int, out: memoryview) -> None:
        end = pos + len(out)
        w = self._window
        if not w or pos < w[0][0] or pos > w[-1][1]:  # not where the last reads were: start afresh here
            self._drop()
            self._run_start = hi = pos
        else:
            hi = w[-1][1]
        ahead = AHEAD if self.sequential else min(AHEAD, (pos - self._run_start) // 2)
        target = min(self.size, end + ahead)
        while hi < target:  # read ahead in whole pieces; at random, no further than the target
            top = min(self.size if self.sequential else target, hi + PIECE)
            w.append((hi, top, self._submit(hi, top)))
            hi = top
        while w and w[0][1] <= pos:
            w.popleft()
        at = pos
        for lo, top, fut in w:
            if lo >= end:
                break
            data = fut.result()  # (exactly top - lo bytes, or an error: ObjectReader.fetch)
            a, b = max(at, lo), min(end, top)
            out[a - pos : b - pos] = data[a - lo : b - lo]
            at = b
            if at >= end:
                break

    def _drop(self) -> None:
        for _, _, fut in self._window:
            fut.cancel()
        self._window.clear()

    def close(self) -> None:
        if not self.closed:
            self._drop()
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None
            self._obj.close()
        super().close()


class ObjectWriter(io.RawIOBase):
    """A write-once, one-pass target for writer.write over an S3 multipart upload.

    Writes append. A write before the end lands in the first part, held in
    memory until :meth:`commit` (writer.write fills in the header that way); a
    write there past what is held is a :class:`TensorCanonError`. :meth:`commit`
    makes the object visible (one PUT when everything fits in the first part),
    :meth:`abort` drops what was sent.
    """

    def __init__(self, upload: storage.Upload, *, hold: int, part_size: int = PART,
                 in_flight: int = IN_FLIGHT) -> None:
        super().__init__()
        self._upload = upload
        self._part_size = part_size
        self._head_size = max(part_size, hold)
        self._head = bytearray()
        self._buf = bytearray(part_size)
        self._filled = 0
        self._number = 1  # the last part number given out; part 1 is the held first part
        self._pos = 0
        self._end = 0
        self._slots = threading.Semaphore(in_flight)
        self._pool = ThreadPoolExecutor(in_flight, thread_name_prefix="tensorcanon-upload")
        self._futures: list[Future[None]] = []
        self._lock = threading.Lock()
        self._failed: BaseException | None = None
        self.parts = 0  # parts sent (the first one included, once sent)

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._end}[whence]
        if not 0 <= base + offset <= self._end:
            raise TensorCanonError(f"internal error: seek to {base + offset} in an upload of {self._end} bytes")
        self._pos = base + offset
        return self._pos

    def write(self, b: Any) -> int:
        data = memoryview(b).cast("B")
        n = len(data)
        if self._failed is not None:
            raise self._failed
        if self._pos < self._end:  # writing back: only into the held first part
            if self._pos + n > len(self._head):
                raise TensorCanonError("internal error: writing back into a part already uploaded")
            self._head[self._pos : self._pos + n] = data
            self._pos += n
            return n
        if len(self._head) < self._head_size:
            k = min(n, self._head_size - len(self._head))
            self._head += data[:k]
            data = data[k:]
        while len(data):
            k = min(len(data), self._part_size - self._filled)
            self._buf[self._filled : self._filled + k] = data[:k]
            self._filled += k
            data = data[k:]
            if self._filled == self._part_size:
                self._send(bytes(self._buf))  # bytes: the S3 client sends them without another copy
                self._filled = 0
        self._pos = self._end = self._end + n
        return n

    def _send(self, buf: bytes, number: int | None = None) -> None:
        """Upload ``buf`` as the next part, waiting while IN_FLIGHT parts are uploading."""
        if number is None:
            self._number += 1
            number = self._number
        if number > MAX_PARTS:
            raise TensorCanonError(f"internal error: more than {MAX_PARTS} parts")
        self._slots.acquire()
        if self._failed is not None:
            self._slots.release()
            raise self._failed
        self._futures.append(self._pool.submit(self._part, number, buf))

    def _part(self, number: int, buf: bytes) -> None:
        try:
            if self._failed is None:
                self._upload.part(number, buf)
                with self._lock:
                    self.parts += 1
        except BaseException as e:
            if self._failed is None:
                self._failed = e
            raise
        finally:
            self._slots.release()

    def commit(self) -> None:
        """Make the object visible: every byte written, as one object."""
        try:
            if self._number == 1:  # nothing sent yet: one PUT
                self._upload.store.put(self._upload.path, bytes(self._head) + bytes(self._buf[: self._filled]))
                self.parts = 1
            else:
                if self._filled:
                    self._send(bytes(self._buf[: self._filled]))
                self._send(bytes(self._head), 1)
                for fut in self._futures:
                    fut.result()
                self._upload.complete()
        finally:
            self._pool.shutdown(wait=True)
            self._release()
        super().close()

    def abort(self) -> None:
        """Drop every part sent; the previous object at the URL, if any, is untouched."""
        if self._failed is None:
            self._failed = TensorCanonError("the upload was aborted")
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._upload.abort()
        self._release()
        super().close()

    def _release(self) -> None:
        self._head = self._buf = bytearray()
        self._futures.clear()

    def close(self) -> None:
        if not self.closed:
            self.abort()  # closing without commit() keeps nothing


def part_size(total: int) -> int:
    """The part size for an object of ``total`` bytes: :data:`PART`, or more for objects so
    large that S3's 10,000 parts would not hold them (rounded up to a MiB)."""
    need = -(-total // (MAX_PARTS - 10))
    return max(PART, -(-need // (1 << 20)) << 20)


def save(p: writer.Plan, loc: storage.Location) -> str:
    """Write the planned file to the object at ``loc``, atomically; its digest. Refused where the URL
    is a sharded checkpoint's prefix (storage.refuse_shadowing): the object would make it ambiguous."""
    store, path = storage.open_store(loc.url, loc.options)
    storage.refuse_shadowing(store, path)
    return save_plan(p, store, path)


def save_plan(p: writer.Plan, store: storage.Store, path: str,
              check: Callable[[str], object] | None = None) -> str:
    """Write the planned file to object ``path`` of ``store`` atomically; its digest. ``check(digest)``
    runs once every byte is written and before the object is committed: raising there keeps nothing."""
    hold = len(p.header()[0])  # the header's size: fixed, since digests have a fixed size

    def fill(f: BinaryIO) -> str:
        result = writer.write(p, f)
        if check is not None:
            check(result)
        return result

    return write_object(store, path, fill, hold=hold, total=hold + p.data_size)


def write_object(store: storage.Store, path: str, fill: Callable[[BinaryIO], _T], *, hold: int, total: int) -> _T:
    """Write object ``path`` of ``store`` through ``fill(file)`` (appends; writing back only within the
    first ``hold`` bytes), about ``total`` bytes: visible complete once ``fill`` returns, or never."""
    if store.multipart:
        target = ObjectWriter(store.upload(path), hold=hold, part_size=part_size(total))
        try:
            result = fill(target)  # type: ignore[arg-type]  # a binary file, as writer needs
            target.commit()
        except BaseException as e:
            target.abort()
            if isinstance(e, FileAccessError):
                raise type(e)(f"{e}; nothing was written: the previous object there, if any, is unchanged",
                              filename=e.filename) from None
            raise
        return result
    with store.writer(path) as f:
        return fill(f)


def open_object(loc: storage.Location) -> tuple[RemoteFile, Any]:
    """The object at ``loc`` for reading: its :class:`RemoteFile` (which the caller closes), and
    the file object to read (the same one, or ``loc.wrap``'s wrapper around it)."""
    if not loc.is_object and storage.names_checkpoint(loc):  # (both: refused there as ambiguous)
        raise FormatError(f"{loc.display!r} is a sharded checkpoint (a prefix holding its index), not a file: "
                          "load it with tensorcanon.dcp.load_unsharded(url, storage_options=...); "
                          "tensorcanon.verify and the command line read it as it is")
    store, path = storage.open_store(loc.url, loc.options)
    fh = RemoteFile(store.reader(path), sequential=loc.sequential)
    return fh, (loc.wrap(fh, fh.size) if loc.wrap is not None else fh)


@contextlib.contextmanager
def open_binary(loc: storage.Location) -> Iterator[RemoteFile]:
    """The object at ``loc`` as a seekable binary file, closed on exit."""
    fh, _ = open_object(loc)
    with fh:
        yield fh


def size(loc: storage.Location) -> int:
    store, path = storage.open_store(loc.url, loc.options)
    return store.size(path)


def read_bytes(loc: storage.Location) -> bytes:
    """The whole object (for formats read whole anyway: .pt, .npz, .npy)."""
    with open_binary(loc.but(sequential=True)) as fh:
        return fh.read()


def location(f: Any, storage_options: Any = None) -> storage.Location | None:
    """``f`` as a :class:`storage.Location` when it names an object in a store, else None."""
    f = storage.resolve(f, storage_options)
    return f if isinstance(f, storage.Location) else None


def refuse_mmap(loc: storage.Location) -> UsageError:
    return UsageError(f"mmap=True needs a local file to map, and {loc.display!r} is an object in a store; "
                      "load it with mmap=False, or tensorcanon.open() to read tensors one at a time")
