"""A tag read as a file: the load side of ``tensorcanon.Store`` (store.py).

``Store.load``, ``Store.verify`` and ``Store.export`` (and tensorcanon.dcp, through
``Store._header_file``) read a tag as the file ``tensorcanon.save`` writes for its object, through
io/reader.CheckedFile. This module holds what presents that file: :class:`_TagFile`, its header
from the tag's record and its data section from the tag's blobs (read in place where a blob is
stored raw, else decoded once and checked against its digest, the blobs after it decoding ahead on
a small pool of threads), and the state one load shares between its blobs: :class:`_Bases` (delta
bases several blobs name, decoded once) and :class:`_Buffers` (decode buffers reused), with the
bounds on both (AHEAD..., BUFFERS, SHARED_BASES). Finding, opening and decoding one blob stays on
``Store`` (``_open_blob``, ``_decode``, ``_decode_checked``), which this module calls through the
store it is given; store.py imports this module, never the other way round, not even for type
checking (an annotation is an import too: tests/test_layers.py): :class:`_Blobs` declares what is
used of ``Store``, and mypy checks ``Store`` against it where store.py makes a :class:`_TagFile`.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import io
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from ..format import digest, tensorbytes
from ..format.errors import FormatError, IntegrityError, MissingFileError, TensorCanonError
from ..io import placement, reader, writer
from . import backend, layout

#: A load decodes the compressed blobs after the one being read on this many threads, ...
AHEAD_THREADS = 2
#: ... at most this many blobs at once, and no more than AHEAD_BYTES of them (their decoded bytes;
#: one is always allowed): memory is bounded by the tensors being returned plus this.
AHEAD = 4
AHEAD_BYTES = 256 << 20
#: A blob decoded ahead this large or larger also decodes its planes on the codec's two threads
#: (a few large tensors keep both cores busy); smaller ones decode on their own thread.
AHEAD_SPLIT = 32 << 20
#: At most this many bytes of a load's dead decode buffers are kept for its next blobs (_Buffers).
BUFFERS = 64 << 20
#: A delta base that two or more blobs of one load name (tensors of equal bytes at an earlier
#: step, and their chains) is decoded once and kept until its last user is decoded, at most this
#: many bytes of such bases at once; beyond it, a base is decoded again for each user (_Bases).
SHARED_BASES = 256 << 20


_AHEAD: list[ThreadPoolExecutor] = []
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_AHEAD.clear)


def _ahead_pool() -> ThreadPoolExecutor:
    if not _AHEAD:
        _AHEAD.append(ThreadPoolExecutor(AHEAD_THREADS, thread_name_prefix="tensorcanon-store-load"))
    return _AHEAD[0]


class _Shared:
    """One delta base shared by several blobs of a load: its decoded bytes (a future, since two
    threads may want it at once), what it was checked to be, and how many users are left."""

    def __init__(self, prefix: bytes, depth: int, size: int, users: int) -> None:
        self.prefix, self.depth, self.size, self.left = prefix, depth, size, users
        self.bytes: Future[np.ndarray] = Future()


class _Bases:
    """The delta bases one load decodes once for several blobs. ``users`` counts, for each base,
    the distinct blobs of the load that name it (found by reading the chain's headers before any
    byte is decoded); a base with two or more is decoded (and checked against its digest, as
    always) by its first user and kept, at most ``limit`` bytes of such bases at once, until its
    last user is decoded. A base beyond the limit, or one whose decoding failed, is decoded by
    each user on its own (so each raises its own error)."""

    def __init__(self, users: dict[bytes, int], limit: int,
                 heads: dict[tuple[str, int, int], layout.BlobHeader] | None = None) -> None:
        self.heads = heads if heads is not None else {}  # (the headers the chain walk parsed: _open_blob)
        self._users = users
        self._limit = limit
        self._held = 0
        self._got: dict[bytes, _Shared] = {}
        self._lock = threading.Lock()

    def get(self, raw: bytes, prefix: bytes, depth: int, size: int,
            make: Callable[[], np.ndarray]) -> np.ndarray | None:
        """Base ``raw`` decoded as ``make()`` decodes it (its prefix and depth checked there), shared;
        None where it is not shared (the caller decodes it, and gives its buffer back)."""
        with self._lock:
            e = self._got.get(raw)
            mine = e is None
            if e is None:
                users = self._users.get(raw, 0)
                if users < 2 or self._held + size > self._limit:
                    return None
                e = self._got[raw] = _Shared(prefix, depth, size, users)
                self._held += size
            elif e.prefix != prefix or e.depth != depth:  # (not the base this delta needs: its own error)
                return None
        if mine:
            try:
                e.bytes.set_result(make())
            except BaseException as err:
                self._drop(raw, e)
                e.bytes.set_exception(err)
                raise
        try:
            return e.bytes.result()
        except Exception:  # noqa: BLE001 (its first user failed: this one decodes it, and fails, on its own)
            return None

    def done(self, raw: bytes) -> None:
        """One user of shared base ``raw`` is decoded: the last lets it go. (Its buffer is not
        reused: a blob decoded twice in one load, as a base over the limit is, asks for its base
        more often than counted, and may still be reading it.)"""
        with self._lock:
            e = self._got.get(raw)
            if e is None:
                return
            e.left -= 1
            if e.left > 0:
                return
        self._drop(raw, e)

    def _drop(self, raw: bytes, e: _Shared) -> None:
        with self._lock:
            if self._got.get(raw) is e:
                del self._got[raw]
                self._held -= e.size


class _Buffers:
    """Decode buffers of one load, kept for reuse once their bytes are dead (a delta's base once
    the delta is decoded, a tensor's decoded bytes once copied out): a fresh buffer costs a page
    fault per page on first write, as much as interleaving its planes. Buffers are reused only for
    blobs of their exact size, and at most ``limit`` bytes of them are kept."""

    def __init__(self, limit: int) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._held = 0
        self._limit = limit
        self._lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        with self._lock:
            found = self._free.get(n)
            if found:
                self._held -= n
                return found.pop()
        return np.empty(n, dtype=np.uint8)

    def give(self, a: np.ndarray) -> None:
        with self._lock:
            if self._held + a.nbytes <= self._limit:
                self._free.setdefault(a.nbytes, []).append(a)
                self._held += a.nbytes


def _prefixed(e: TensorCanonError, prefix: str) -> TensorCanonError:
    """``e`` with its message prefixed (to re-raise it with the tag named), its attributes kept."""
    if e.args and isinstance(e.args[0], str):
        e.args = (prefix + e.args[0], *e.args[1:])
    return e


class _Blobs(Protocol):
    """What this module uses of a ``Store`` (store.py): the backend, and each blob found, opened,
    decoded and checked against its digest (the methods of that name on ``Store``)."""

    @property
    def _b(self) -> backend.Local | backend.Remote: ...

    def _damage_note(self) -> str: ...

    def _open_blob(self, raw: bytes, handles: dict[str, backend.Blob] | None = None, *, share: bool = False,
                   heads: dict[tuple[str, int, int], layout.BlobHeader] | None = None,
                   ) -> tuple[backend.Blob, layout.BlobHeader]: ...

    def _decode(self, raw: bytes, prefix: bytes | None = None, depth: int | None = None,
                handles: dict[str, backend.Blob] | None = None, *, pool: bool = True,
                bufs: _Buffers | None = None, bases: _Bases | None = None) -> np.ndarray: ...

    def _decode_checked(self, raw: bytes, h: layout.BlobHeader, data: Any, where: str,
                        handles: dict[str, backend.Blob] | None = None, *, pool: bool = True,
                        bufs: _Buffers | None = None, out: Any = None, bases: _Bases | None = None) -> np.ndarray: ...

    def _check_decoded(self, raw: bytes, h: layout.BlobHeader | bytes, data: Any, where: str) -> None: ...


class _TagFile(io.RawIOBase):
    """A tag as the file ``tensorcanon.save`` writes: the header from its record, the data section
    from its blobs, read at any offset. A raw blob of a local store is read straight into the
    caller's buffer; any other is decoded (and checked against its digest) once, when first read.
    :meth:`values` (``Store.load``) decodes compressed blobs straight into the tensors it returns."""

    def __init__(self, store: _Blobs, tag: str, header: bytes, size: int) -> None:
        super().__init__()
        self._s = store
        self.tag = tag
        self._header = header
        self.size = size
        self._pos = 0
        self._rows: list[Any] = []
        self._begins: list[int] = []
        self._opened: dict[bytes, tuple[backend.Blob, layout.BlobHeader]] = {}
        self._handles: dict[str, backend.Blob] = {}  # the packs its blobs are read from, each opened once
        self._decoded: tuple[bytes, np.ndarray] | None = None
        self._coded: list[bytes] = []  # the compressed blobs, each once, in data order of first use
        self._at: dict[bytes, int] = {}  # a compressed blob -> its place in _coded
        self._ahead: dict[bytes, Future[np.ndarray]] = {}  # blobs after the one read, decoding on other threads
        self._dropped: list[Future[np.ndarray]] = []  # decoded ahead, then passed by: close waits for them
        self._bufs = _Buffers(BUFFERS)
        self._bases = _Bases({}, SHARED_BASES)
        self._started: set[bytes] = set()  # blobs decoded (or decoding) already: not decoded ahead again
        self._jobs: list[Future[Any]] = []  # tensors decoding into their memory (values): close waits for them
        self.peak = (0, 0)  # the most blobs, and bytes, values() had decoding ahead at once

    def _named(self, e: TensorCanonError, path: str) -> TensorCanonError:
        """``e``, a blob's own error (which names only the blob), prefixed with the tag and the
        tensor's ``path``, once."""
        if not (e.args and str(e.args[0]).startswith(f"tag {self.tag!r}")):
            _prefixed(e, f"tag {self.tag!r}, tensor {path}: ")
        return e

    def attach(self, rows: list[Any], path: Callable[[int], str] | None = None) -> None:
        """The tag's table rows (proven by CheckedFile): every blob is opened and its header
        checked against its row before any byte of data is read or allocated. ``path(index)``: a
        row's tensor path, named (with the tag) by the error of a blob whose header is refused
        (tensorcanon.dcp passes none: it names the chunk itself)."""
        order = sorted((r for r in rows if r.end > r.begin), key=lambda r: r.begin)
        self._rows = order
        self._begins = [r.begin for r in order]
        for r in order:
            if r.digest in self._opened:
                continue
            try:
                blob, h = self._s._open_blob(r.digest, self._handles, share=True)
            except MissingFileError:
                raise IntegrityError(f"tag {self.tag!r}: the blob of tensor {r.name!r} ({layout.show(r.digest)}) "
                                     "is missing from the store; the tag cannot be loaded (delete it, or save it "
                                     f"again){self._s._damage_note()}", expected=layout.show(r.digest)) from None
            except TensorCanonError as e:
                if path is None:
                    raise
                raise self._named(e, path(r.index)) from None
            self._opened[r.digest] = (blob, h)
            expected = digest.tensor_prefix(r.dtype.name, r.shape)
            if h.prefix != expected:
                raise IntegrityError(f"tag {self.tag!r}: the blob of tensor {r.name!r} ({blob.where!r}) holds a "
                                     f"{h.prefix.decode()} tensor, not {expected.decode()}; the store is damaged",
                                     expected=expected.decode(), actual=h.prefix.decode())
        for r in order:
            if self._opened[r.digest][1].codec != layout.RAW and r.digest not in self._at:
                self._at[r.digest] = len(self._coded)
                self._coded.append(r.digest)
        heads: dict[tuple[str, int, int], layout.BlobHeader] = {}
        self._bases = _Bases(self._base_users(heads), SHARED_BASES, heads)

    def _base_users(self, heads: dict[tuple[str, int, int], layout.BlobHeader]) -> dict[bytes, int]:
        """For each delta base below the tag's blobs, how many distinct blobs of the load name it:
        each chain's headers read (no byte decoded), each link once. A header that cannot be read,
        or that does not fit its delta, ends the walk of its chain: the decoding raises its error.
        The headers of packed blobs parsed here go to ``heads``, for their decoding."""
        users: collections.Counter[bytes] = collections.Counter()
        walked: set[bytes] = set()
        for raw in self._coded:
            h = self._opened[raw][1]
            while h.codec in layout.DELTAS and h.base is not None:
                b = h.base
                users[b] += 1
                if b in walked:
                    break
                walked.add(b)
                try:
                    blob, bh = self._s._open_blob(b, self._handles, share=True, heads=heads)
                    blob.close()
                except TensorCanonError:
                    break
                if bh.prefix != h.prefix or bh.depth != h.depth - 1:
                    break
                h = bh
        return {b: n for b, n in users.items() if n > 1}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), self.size - self._pos))
        done = 0
        while done < n:
            done += self._fill(self._pos + done, out[done:n])
        self._pos += n
        return n

    def _fill(self, pos: int, out: memoryview) -> int:
        """Copy bytes at ``pos`` into ``out``, up to the end of the piece holding ``pos``; the count."""
        hl = len(self._header)
        if pos < hl:
            k = min(len(out), hl - pos)
            out[:k] = self._header[pos : pos + k]
            return k
        off = pos - hl
        i = bisect.bisect_right(self._begins, off) - 1
        r = self._rows[i]
        k = min(len(out), r.end - off)
        blob, h = self._opened[r.digest]
        if h.codec == layout.RAW:
            blob.readinto(h.payload + off - r.begin, out[:k])
        else:
            data = self._data(r.digest)
            out[:k] = data.data[off - r.begin : off - r.begin + k]
        return k

    def _data(self, raw: bytes) -> np.ndarray:
        """Blob ``raw`` decoded and checked; the compressed blobs after it in data order decode on
        other threads meanwhile (zstd, numpy and xxhash release the GIL), at most AHEAD of them and
        AHEAD_BYTES of their bytes. Each is waited for when it is read, so an error is raised when
        its tensor is reached, as reading in order on one thread would raise it."""
        if self._decoded is None or self._decoded[0] != raw:
            if self._decoded is not None:  # (copied out, or written, by every caller already)
                self._bufs.give(self._decoded[1])
            self._decoded = None
            i = self._at[raw]
            for d in [d for d in self._ahead if self._at[d] < i]:  # (passed by: read out of order)
                f = self._ahead.pop(d)
                if not f.cancel():
                    self._dropped = [g for g in self._dropped if not g.done()] + [f]
            ahead = self._ahead.pop(raw, None)
            self._started.add(raw)
            self._top_up(i)
            data = ahead.result() if ahead is not None else \
                self._s._decode(raw, handles=self._handles, bufs=self._bufs, bases=self._bases)
            self._decoded = (raw, data)
        return self._decoded[1]

    def _top_up(self, i: int) -> None:
        """Start decoding the compressed blobs after the ``i``-th, within AHEAD and AHEAD_BYTES."""
        held = sum(self._opened[d][1].size for d in self._ahead)
        for d in self._coded[i + 1 : i + 1 + AHEAD]:
            if d in self._started:  # (decoding ahead now, or read once already: a tensor read again)
                continue
            size = self._opened[d][1].size
            if len(self._ahead) >= AHEAD or (self._ahead and held + size > AHEAD_BYTES):
                break
            self._ahead[d] = _ahead_pool().submit(self._s._decode, d, None, None, self._handles,
                                                  pool=size >= AHEAD_SPLIT, bufs=self._bufs, bases=self._bases)
            self._started.add(d)
            held += size

    def _decode_into(self, raw: bytes, out: Any, pool: bool) -> None:
        """Blob ``raw`` (opened by :meth:`attach`) decoded into ``out`` and checked against its digest."""
        blob, h = self._opened[raw]
        self._s._decode_checked(raw, h, blob.whole(), f"blob {blob.where!r}", self._handles, pool=pool,
                                bufs=self._bufs, out=out, bases=self._bases)

    def values(self, cf: reader.CheckedFile, map_location: Any, mmap: bool) -> list[Any]:
        """Every tensor of the tag, by table index, checked against its digest. A compressed blob of
        a CPU tensor is decoded straight into the memory of the tensor returned (no copy, and its
        check against its digest is the tensor's), on the read-ahead threads, at most AHEAD blobs
        and AHEAD_BYTES of them ahead of the tensor waited for; the others are read as
        ``tensorcanon.load`` reads a file (``mmap``: a raw local blob is mapped, see :meth:`mapped`).
        Tensors are taken in data order, so the error raised is that of the first bad one."""
        values: list[Any] = [None] * len(cf.rows)
        order = self._rows
        jobs: dict[int, tuple[Future[Any], Any]] = {}  # position in order -> (decoding, its tensor)
        first: dict[bytes, int] = {}  # blob -> the position whose tensor it is decoded into
        views: dict[bytes, Any] = {}  # blob -> the bytes of that tensor, once decoded and checked
        held = 0
        nxt = 0

        def decodable(r: Any) -> bool:
            return (self._opened[r.digest][1].codec != layout.RAW and r.dtype.torch is not None
                    and r.kind in ("tensor", "parameter")
                    and (placement.stays_on_cpu(r.kind, r.device, map_location)
                         or getattr(placement.target(r.device, map_location), "type", None) == "cpu"))

        def fresh(r: Any) -> tuple[Any, Any]:
            """A new tensor for row ``r`` and a writable byte view of it; where torch cannot make it
            of its dtype through numpy (bfloat16, bool...), its bytes, retyped by ``typed``."""
            made = tensorbytes.empty_tensor(r.dtype, r.shape, r.kind)
            return made if made is not None else tensorbytes.empty_buffer(r.nbytes, r.kind)

        def typed(r: Any, buf: Any) -> Any:
            if buf.dtype == r.dtype.torch and tuple(buf.shape) == r.shape:
                return buf
            return tensorbytes.finish(buf, r.dtype, r.shape, r.kind, r.name)  # (bool bytes checked there)

        def submit(j: int) -> bool:
            nonlocal held
            r = order[j]
            if r.digest in first or not decodable(r):
                return True
            if jobs and (len(jobs) >= AHEAD or held + r.nbytes > AHEAD_BYTES):
                return False
            ready = fresh(r)
            first[r.digest] = j
            self._started.add(r.digest)
            f = _ahead_pool().submit(self._decode_into, r.digest, ready[1], r.nbytes >= AHEAD_SPLIT)
            self._jobs.append(f)
            jobs[j] = (f, ready)
            held += r.nbytes
            return True

        for i, r in enumerate(order):
            nxt = max(nxt, i)
            while nxt < len(order) and submit(nxt):
                nxt += 1
            self.peak = max(self.peak[0], len(jobs)), max(self.peak[1], held)
            job = jobs.pop(i, None)
            if job is not None:
                f, (value, view) = job
                held -= r.nbytes
                try:
                    f.result()
                    value = typed(r, value)
                except TensorCanonError as e:
                    raise self._named(e, cf.tensor_path(r.index)) from None
                views[r.digest] = view  # (a later row of this blob copies it)
            elif r.digest in views and decodable(r):
                ready = fresh(r)
                ready[1][:] = views[r.digest]  # (a tensor whose bytes another row holds, checked: copied)
                value = typed(r, ready[0])
            else:
                try:
                    value = self.mapped(r, map_location, cf) if mmap else None
                    if value is None:
                        value = cf.read(r.index, map_location=map_location)
                except (FormatError, IntegrityError) as e:  # (a blob's own errors name only the blob)
                    raise self._named(e, cf.tensor_path(r.index)) from None
                values[r.index] = value
                continue
            values[r.index] = placement.as_recorded(value, r, map_location, functools.partial(cf.tensor_path, r.index))
        for r in cf.rows:  # (tensors with no bytes)
            if values[r.index] is None and not r.nbytes:
                values[r.index] = cf.read(r.index, map_location=map_location)
        return values

    def mapped(self, r: Any, map_location: Any, cf: reader.CheckedFile) -> Any:
        """Tensor ``r`` as a view of a private map of its raw local blob (hashed in place first), or None."""
        if not r.nbytes:
            return None
        opened = self._opened.get(r.digest)
        if opened is None or opened[1].codec != layout.RAW or opened[0].fd is None or r.dtype.torch is None:
            return None
        if not placement.stays_on_cpu(r.kind, r.device, map_location):
            device = placement.target(r.device, map_location)
            if device is not None and device.type != "cpu":
                return None
        from ..io.source import map_file

        blob, h = opened
        b = self._s._b
        assert isinstance(b, backend.Local)
        src = map_file(b.path(blob.rel))  # (a loose blob, or the pack holding it)
        try:
            view = src.tensor(blob.start + h.payload, h.size)
            data = src.view(blob.start + h.payload, h.size)
            if view is None or data is None:
                return None
            self._s._check_decoded(r.digest, h, data, f"blob {blob.where!r}")
            tensorbytes.check_bool(view, r.dtype, r.name)
            value = tensorbytes.viewed(view, r.dtype, r.shape, r.kind)
        finally:
            src.release()
        if value is None:
            return None
        return placement.as_recorded(value, r, map_location, lambda: cf.tensor_path(r.index))

    def write_to(self, f: Any, cf: reader.CheckedFile) -> None:
        """Write the whole file to ``f``: the header, then every tensor in data order, each checked
        against its digest (and a bool tensor's bytes against 0 and 1) before it is written."""
        def check_bool(data: Any, r: Any) -> None:  # (as a load and tensorcanon.verify of the file would)
            try:
                tensorbytes.check_bool(data, r.dtype, r.name)
            except FormatError as e:
                raise self._named(e, cf.tensor_path(r.index)) from None

        writer._write_all(f, self._header)
        hashers = digest.Hashers(layout.ALGORITHM)
        for r in self._rows:
            h = hashers(r.dtype.name, r.shape)
            blob, bh = self._opened[r.digest]
            if bh.codec == layout.RAW:
                buf = bytearray(min(r.nbytes, 16 << 20))
                view = memoryview(buf)
                at = 0
                while at < r.nbytes:
                    k = min(len(view), r.nbytes - at)
                    blob.readinto(bh.payload + at, view[:k])
                    h.update(view[:k])
                    if r.dtype.name == "bool":
                        check_bool(buf if k == len(buf) else bytearray(view[:k]), r)
                    writer._write_all(f, view[:k])
                    at += k
                got = h.digest()
                if got != r.digest:
                    raise IntegrityError(f"tag {self.tag!r}: blob {blob.where!r} of tensor {cf.tensor_path(r.index)} "
                                         f"hashes to {layout.show(got)}, not {layout.show(r.digest)}; the blob is "
                                         "damaged", path=cf.tensor_path(r.index), expected=layout.show(r.digest),
                                         actual=layout.show(got))
            else:
                try:
                    data = self._data(r.digest)  # (checked against its digest when decoded)
                except (FormatError, IntegrityError) as e:  # (a blob's own errors name only the blob)
                    raise self._named(e, cf.tensor_path(r.index)) from None
                check_bool(data, r)
                writer._write_all(f, data.data)
        if not self._rows and len(self._header) != self.size:
            raise FormatError(f"tag {self.tag!r}: its header describes no data but the file would be {self.size} bytes")

    def close(self) -> None:
        for blob, _ in self._opened.values():
            blob.close()
        self._opened.clear()
        self._decoded = None
        ahead = list(self._ahead.values()) + self._dropped + self._jobs
        self._ahead, self._dropped, self._jobs = {}, [], []
        for f in ahead:
            f.cancel()
        for f in ahead:
            with contextlib.suppress(Exception):  # (they read through the packs opened here: let them end first)
                f.result()
        self._bufs = _Buffers(0)
        for pack in self._handles.values():
            pack.close()
        self._handles.clear()
        super().close()
