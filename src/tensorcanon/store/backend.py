"""Where a store's objects live: a local folder, or a prefix of an fsspec store (``s3://``, ``memory://``).

Both give the same few operations on names relative to the root (``tags/a.safetensors``):
``get`` (a whole object, its size bounded first), ``blob`` (an object to read ranges of, or
map), ``put`` (an object made visible complete or not at all: a temp file renamed over the
name locally, one PUT or a completed multipart upload in a store), ``listing`` (names under a
prefix, with sizes and modification times), ``delete``, ``exists``. Every failure is the
library's :class:`FileAccessError` (a :class:`MissingFileError` for a missing object)
naming the object, with no credential in it (storage.py).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterable
from typing import Any

from ..format.errors import FileAccessError, FormatError, MissingFileError, TensorCanonError, UsageError
from ..io import storage
from . import layout

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def host() -> str:
    """This machine's name as a marker may hold it (``[A-Za-z0-9_-]``, at most 64 characters)."""
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:64]
    return name or "host"


#: fsyncs run on this many threads at once (the file system commits them together).
SYNC_THREADS = 16
_SYNC: list[Any] = []
if hasattr(os, "register_at_fork"):  # a forked child has none of its parent's threads: it makes its own pool
    os.register_at_fork(after_in_child=_SYNC.clear)


def _sync_pool() -> Any:
    if not _SYNC:
        from concurrent.futures import ThreadPoolExecutor

        _SYNC.append(ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="tensorcanon-store-sync"))
    return _SYNC[0]


def _finished() -> Any:
    """A future already done: a step of :meth:`Local.settle` with nothing left to wait for."""
    from concurrent.futures import Future

    f: Future[None] = Future()
    f.set_result(None)
    return f


def _fsync_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _inside(root: str, path: str) -> bool:
    """Whether local ``path`` is the folder ``root`` or lies under it, symlinks resolved."""
    try:
        root, there = os.path.realpath(root), os.path.realpath(path)
    except ValueError as e:  # (a NUL byte: no such path can be written)
        raise UsageError(f"cannot write to {path!r}: {e}; a path holds no NUL byte") from None
    return there == root or there.startswith(root.rstrip(os.sep) + os.sep)


class Local:
    """A store in a local folder. Objects are written to ``tmp/`` and renamed into place (after an
    fsync), so that a crash leaves every name either absent or complete; names are never followed
    through a symlink."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.is_local = True

    def display(self, rel: str = "") -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def path(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/"))

    def _error(self, e: OSError, doing: str, rel: str) -> FileAccessError:
        where = self.display(rel)
        if isinstance(e, FileNotFoundError):
            return MissingFileError(f"cannot {doing} {where!r}: no such file", filename=where)
        if e.errno == errno.ELOOP:
            return FileAccessError(f"cannot {doing} {where!r}: it is a symbolic link, which a store never "
                                   "follows (every name of a store is a regular file inside its root)",
                                   filename=where, errno=e.errno)
        return FileAccessError(f"cannot {doing} {where!r}: {e.strerror or e}", filename=where, errno=e.errno)

    def folders_real(self, rel: str, *, whole: bool = False) -> None:
        """Raise unless every folder between the root and ``rel`` (``rel`` itself too when ``whole``)
        is a real folder: a symlinked ``tags/``, ``blobs/…`` or ``tmp/`` would let a hostile store
        send reads, and gc's deletions, outside its root. A missing folder passes (the caller's own
        open or listing says so)."""
        import stat

        parts = rel.split("/") if whole else rel.split("/")[:-1]
        path = self.root
        for part in parts:
            path = os.path.join(path, part)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                return
            except OSError as e:
                raise self._error(e, "read", os.path.relpath(path, self.root)) from None
            if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
                what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a folder"
                raise FileAccessError(f"cannot use {path!r}: it is {what}, where a store has a folder of its own "
                                      "(a store never follows a link out of its root); remove it, or restore the "
                                      "store from a copy", filename=path, errno=errno.ELOOP)

    def root_exists(self) -> bool:
        return os.path.isdir(self.root)

    def holds(self, path: str) -> bool:
        """Whether local ``path`` lies inside the store's folder (symlinks resolved): a file written
        there is among the store's objects, where gc deletes what it does not know."""
        return _inside(self.root, path)

    def exists(self, rel: str) -> bool:
        return os.path.lexists(self.path(rel))

    def open_fd(self, rel: str) -> int:
        """A descriptor of the regular file ``rel`` (never a symlink, FIFO or device)."""
        import stat

        name = self.path(rel)
        self.folders_real(rel)
        try:
            fd = os.open(name, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise self._error(e, "read", rel) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # (a folder or FIFO where a store holds a file: damage)
                raise FormatError(f"cannot read {name!r}: not a regular file, which every object of a store is")
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def get(self, rel: str, limit: int) -> bytes:
        fd = self.open_fd(rel)
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise FormatError(f"{self.display(rel)!r} is {size} bytes, more than the {limit} such an "
                                  "object may hold")
            return os.pread(fd, size, 0) if size else b""
        finally:
            os.close(fd)

    def blob(self, rel: str) -> Blob:
        fd = self.open_fd(rel)
        return Blob(self.display(rel), os.fstat(fd).st_size, fd=fd, rel=rel)

    def ensure(self) -> None:
        for rel in (layout.BLOBS, layout.PACKS, layout.TAGS, layout.PENDING, layout.GC, layout.TMP):
            try:
                os.makedirs(self.path(rel), exist_ok=True)
            except OSError as e:
                raise self._error(e, "create", rel) from None
            self.folders_real(rel, whole=True)

    def put(self, rel: str, pieces: Iterable[Any], total: int, *, durable: bool = True,
            later: list | None = None) -> None:
        """Write ``pieces`` as object ``rel``: a temp file in ``tmp/``, flushed (and fsynced when
        ``durable``), then renamed over the name. Folders are made only where they are missing
        (a failed rename says so), not checked at every write. ``later`` (with ``durable=False``):
        the file's fsync starts at once on another thread and is added to ``later``, for
        :meth:`settle` to wait for (with the fsyncs of the folders that name the files)."""
        target = self.path(rel)
        folder = os.path.dirname(target)
        self.folders_real(rel)
        self.folders_real(layout.TMP, whole=True)
        tmp_folder = self.path(layout.TMP)
        try:
            try:
                fd, tmp = tempfile.mkstemp(prefix=f"{host()}.{os.getpid()}.", suffix=".tmp", dir=tmp_folder)
            except FileNotFoundError:
                os.makedirs(tmp_folder, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=f"{host()}.{os.getpid()}.", suffix=".tmp", dir=tmp_folder)
        except OSError as e:
            raise self._error(e, "write", rel) from None
        try:
            with os.fdopen(fd, "wb", buffering=0) as f:
                for piece in pieces:
                    view = memoryview(piece).cast("B")
                    done = 0
                    while done < len(view):
                        done += f.write(view[done:]) or 0
                if durable:
                    os.fsync(f.fileno())
                elif later is not None:
                    later.append((_sync_pool().submit(_fsync_close, os.dup(f.fileno())), folder, rel))
            os.chmod(tmp, 0o644)
            try:
                os.replace(tmp, target)
            except FileNotFoundError:  # its folder does not exist yet
                os.makedirs(folder, exist_ok=True)
                os.replace(tmp, target)
        except BaseException as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if isinstance(e, OSError) and not isinstance(e, TensorCanonError):
                raise self._error(e, "write", rel) from None
            raise
        if durable:
            self.sync_dir(folder)

    def appender(self) -> LocalAppender:
        """A new object written piece by piece (a temp file in ``tmp/``), named when it is finished."""
        return LocalAppender(self)

    def sync(self, rels: list[str]) -> None:
        """Make objects written with ``durable=False`` durable: every file and the folders that name
        them fsynced, on several threads at once (the file system commits them together)."""
        if not rels:
            return

        def one(path: str, folder: bool) -> None:
            try:
                fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
            except OSError:
                return  # (gone: deleted by a collection, which only deletes what no tag needs)
            try:
                os.fsync(fd)
            except OSError as e:
                if not folder:
                    raise self._error(e, "write", os.path.relpath(path, self.root)) from None
            finally:
                os.close(fd)

        files = [self.path(r) for r in rels]
        folders = sorted({os.path.dirname(f) for f in files})
        if len(files) + len(folders) <= 2:
            for f in files:
                one(f, False)
            for d in folders:
                one(d, True)
            return
        pool = _sync_pool()
        for f in [pool.submit(one, f, False) for f in files] + [pool.submit(one, d, True) for d in folders]:
            f.result()

    def settle(self, later: list) -> None:
        """Wait for the fsyncs :meth:`put` started (``later``), then fsync every folder naming those
        files (and every folder added to ``later`` by :meth:`LocalAppender.finish` or
        :meth:`root_later`), at once: the objects are then durable."""
        folders = set()
        first: BaseException | None = None
        for job, folder, rel in later:
            folders.add(folder)
            try:
                job.result()
            except OSError as e:
                first = first or self._error(e, "write", rel)
        if first is not None:
            raise first
        pool = _sync_pool()
        for f in [pool.submit(self.sync_dir, d) for d in sorted(folders)]:
            f.result()

    def root_later(self, later: list) -> None:
        """Have :meth:`settle` fsync the root folder too (where the marker and the folders are named)."""
        later.append((_finished(), self.root, layout.MARKER))

    def sync_dir(self, folder: str) -> None:
        try:
            fd = os.open(folder, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def listing(self, prefix: str) -> dict[str, tuple[int, float]]:
        """Every regular file under ``prefix``: relative name -> (size, modification time)."""
        out: dict[str, tuple[int, float]] = {}
        top = self.path(prefix)
        self.folders_real(prefix.rstrip("/"), whole=True)
        if not os.path.isdir(top):
            return out
        for folder, _dirs, files in os.walk(top):  # (os.walk never follows symlinked folders)
            for f in files:
                full = os.path.join(folder, f)
                try:
                    st = os.lstat(full)
                except OSError:
                    continue
                import stat

                if stat.S_ISREG(st.st_mode):
                    rel = os.path.relpath(full, self.root).replace(os.sep, "/")
                    out[rel] = (st.st_size, st.st_mtime)
        return out

    def irregular(self, prefix: str) -> list[str]:
        """The names directly in folder ``prefix`` that are neither regular files nor links (a folder
        or FIFO where a record belongs): :meth:`listing` leaves them out, yet a reader must not take
        them for absent (``Store.tags`` lists them, so that reading them reports the damage). A link
        is not part of the store: never listed, never followed."""
        import stat

        top = self.path(prefix)
        self.folders_real(prefix.rstrip("/"), whole=True)
        try:
            entries = list(os.scandir(top))
        except OSError:
            return []
        out = []
        for entry in entries:
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError:
                continue
            if not stat.S_ISREG(mode) and not stat.S_ISLNK(mode):
                out.append(os.path.relpath(entry.path, self.root).replace(os.sep, "/"))
        return out

    def delete(self, rel: str) -> bool:
        self.folders_real(rel)
        try:
            os.unlink(self.path(rel))
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            raise self._error(e, "delete", rel) from None

    def mtime(self, rel: str) -> float | None:
        try:
            return os.lstat(self.path(rel)).st_mtime
        except OSError:
            return None

    def now(self) -> float:
        return time.time()


class Remote:
    """A store under a prefix of an fsspec filesystem (storage.Store: deadlines, redacted errors)."""

    def __init__(self, url: str, options: Any) -> None:
        self.url = url.rstrip("/")
        self.store, self.prefix = storage.open_store(self.url, options)
        self.prefix = self.prefix.rstrip("/")
        self.is_local = False

    def display(self, rel: str = "") -> str:
        return storage.redact(f"{self.url}/{rel}" if rel else self.url)

    def path(self, rel: str) -> str:
        return f"{self.prefix}/{rel}"

    def root_exists(self) -> bool:
        return self.store.exists(self.path(layout.MARKER))

    def holds(self, path: str) -> bool:
        """As :meth:`Local.holds`: a local path is one of this store's objects only where its URL
        names a local folder through fsspec (``local:///data/store``, ``simplecache::file://…``)."""
        root = storage.local_target(self.url)
        return root is not None and _inside(root, path)

    def exists(self, rel: str) -> bool:
        return self.store.exists(self.path(rel))

    def get(self, rel: str, limit: int) -> bytes:
        reader = self.store.reader(self.path(rel))
        try:
            if reader.size > limit:
                raise FormatError(f"{self.display(rel)!r} is {reader.size} bytes, more than the {limit} such "
                                  "an object may hold")
            return reader.fetch(0, reader.size)
        finally:
            reader.close()

    def blob(self, rel: str) -> Blob:
        reader = self.store.reader(self.path(rel))
        return Blob(self.display(rel), reader.size, reader=reader, rel=rel)

    def ensure(self) -> None:
        return None  # object stores have no folders

    def sync(self, rels: list[str]) -> None:
        return None  # an object is durable once its PUT (or its multipart upload) completed

    def settle(self, later: list) -> None:
        return None  # (nothing is started later: every PUT is durable when it returns)

    def root_later(self, later: list) -> None:
        return None

    def appender(self) -> RemoteAppender:
        """A new object gathered piece by piece, and PUT (or uploaded in parts) under its name when finished."""
        return RemoteAppender(self)

    def put(self, rel: str, pieces: Iterable[Any], total: int, *, durable: bool = True,
            later: list | None = None) -> None:
        from ..io import remote

        path = self.path(rel)
        if total <= remote.PART:
            data = b"".join(bytes(memoryview(p).cast("B")) for p in pieces)
            self.store.put(path, data)
            return

        def fill(f: Any) -> None:
            for piece in pieces:
                f.write(memoryview(piece).cast("B"))

        remote.write_object(self.store, path, fill, hold=0, total=total)

    def irregular(self, prefix: str) -> list[str]:
        """Object storage holds only objects (:meth:`Local.irregular`)."""
        return []

    def listing(self, prefix: str) -> dict[str, tuple[int, float]]:
        top = self.path(prefix)
        with self.store.errors("list", top):
            self.store.fs.invalidate_cache(top)
        try:
            found = self.store.call("list", top, "find", top, detail=True)
        except MissingFileError:
            return {}
        out: dict[str, tuple[int, float]] = {}
        base = self.prefix + "/"
        for path, info in found.items():
            if info.get("type") == "directory" or not path.startswith(base):
                continue
            try:
                size = storage.claimed_size(info, self.display(path[len(base):]))
            except FileAccessError:
                continue
            out[path[len(base):]] = (size, _mtime(info))
        return out

    def delete(self, rel: str) -> bool:
        try:
            self.store.delete(self.path(rel))
            return True
        except MissingFileError:
            return False

    def mtime(self, rel: str) -> float | None:
        try:
            info = self.store.call("look up", self.path(rel), "info", self.path(rel))
        except MissingFileError:
            return None
        return _mtime(info)

    def now(self) -> float:
        return time.time()


class LocalAppender:
    """An object of a local store written piece by piece into a temp file of ``tmp/`` (small pieces
    gathered into larger writes); :meth:`finish` fsyncs it, renames it to its name and fsyncs the
    folder (durable when it returns). :meth:`start_sync` starts its fsync on another thread at once,
    for :meth:`finish` to wait for."""

    _GATHER = 1 << 20

    def __init__(self, b: Local) -> None:
        self._b = b
        self._buf = bytearray()
        self._synced: Any = None
        b.folders_real(layout.TMP, whole=True)
        folder = b.path(layout.TMP)
        try:
            try:
                self._fd, self._tmp = tempfile.mkstemp(prefix=f"{host()}.{os.getpid()}.", suffix=".tmp", dir=folder)
            except FileNotFoundError:
                os.makedirs(folder, exist_ok=True)
                self._fd, self._tmp = tempfile.mkstemp(prefix=f"{host()}.{os.getpid()}.", suffix=".tmp", dir=folder)
        except OSError as e:
            raise b._error(e, "write", layout.TMP) from None

    def write(self, piece: Any) -> None:
        view = memoryview(piece).cast("B")
        if len(view) + len(self._buf) <= self._GATHER:
            self._buf += view
            return
        self._flush()
        self._write(view)

    def _flush(self) -> None:
        if self._buf:
            self._write(memoryview(self._buf))
            self._buf = bytearray()

    def _write(self, view: memoryview) -> None:
        done = 0
        try:
            while done < len(view):
                done += os.write(self._fd, view[done:])
        except OSError as e:
            raise self._b._error(e, "write", os.path.relpath(self._tmp, self._b.root)) from None

    def start_sync(self) -> None:
        self._flush()
        self._synced = _sync_pool().submit(os.fsync, self._fd)

    def finish(self, rel: str, later: list | None = None) -> None:
        """Fsync, rename to ``rel``, fsync its folder (``later``: the folder is added to ``later``
        instead, for :meth:`Local.settle` to fsync with the others)."""
        b = self._b
        target = b.path(rel)
        try:
            b.folders_real(rel)
            self._flush()
            synced, self._synced = self._synced, None
            if synced is not None:
                synced.result()
            else:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            os.chmod(self._tmp, 0o644)
            try:
                os.replace(self._tmp, target)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.replace(self._tmp, target)
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError) and not isinstance(e, TensorCanonError):
                raise b._error(e, "write", rel) from None
            raise
        if later is not None:
            later.append((_finished(), os.path.dirname(target), rel))
        else:
            b.sync_dir(os.path.dirname(target))

    def abort(self) -> None:
        synced, self._synced = self._synced, None
        if synced is not None:
            with contextlib.suppress(OSError):
                synced.result()
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(self._tmp)
        except OSError:
            pass


class RemoteAppender:
    """An object of object storage gathered piece by piece (the pieces are kept, not copied) and
    written whole under its name by :meth:`finish`: one PUT, or a completed multipart upload."""

    def __init__(self, b: Remote) -> None:
        self._b = b
        self._pieces: list[Any] = []
        self._size = 0

    def write(self, piece: Any) -> None:
        view = memoryview(piece).cast("B")
        self._pieces.append(view)
        self._size += len(view)

    def start_sync(self) -> None:
        return None  # (a PUT is durable when it returns)

    def finish(self, rel: str, later: list | None = None) -> None:
        pieces, self._pieces = self._pieces, []
        self._b.put(rel, pieces, self._size)

    def abort(self) -> None:
        self._pieces = []


def _mtime(info: Any) -> float:
    """A modification time from what a store says of an object (s3: LastModified; memory: created)."""
    for key in ("LastModified", "mtime", "created", "last_modified", "updated"):
        v = info.get(key)
        if v is None:
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        ts = getattr(v, "timestamp", None)
        if callable(ts):
            try:
                return float(ts())
            except (TypeError, ValueError, OverflowError, OSError):
                continue
    return 0.0


class Blob:
    """One object opened for reading, or one blob inside a pack (:meth:`part`): its size, ranged
    reads, and (local files) a read-only map. ``start``: where it begins in the object ``rel``."""

    def __init__(self, where: str, size: int, *, fd: int | None = None, reader: Any = None, rel: str = "",
                 start: int = 0, parent: Blob | None = None) -> None:
        self.where = where
        self.size = size
        self.fd = fd
        self.reader = reader
        self.rel = rel
        self.start = start
        self._parent = parent
        self._map: mmap.mmap | None = None
        self._lock = threading.Lock()
        self._owns = False

    def part(self, start: int, size: int, where: str, *, owns: bool = False) -> Blob:
        """Bytes ``[start, start + size)`` of this object as a blob of its own, reading through this
        one, which must stay open while the part is used: closing the part closes this object only
        where it ``owns`` it."""
        part = Blob(where, size, fd=self.fd, reader=self.reader, rel=self.rel, start=self.start + start, parent=self)
        part._owns = owns
        return part

    def read(self, start: int, end: int) -> bytes:
        end = min(end, self.size)
        if end <= start:
            return b""
        if self.fd is not None:
            try:
                data = os.pread(self.fd, end - start, self.start + start)
            except OSError as e:
                raise FileAccessError(f"cannot read {self.where!r}: {e.strerror or e}", filename=self.where) from None
            if len(data) != end - start:
                raise FormatError(f"{self.where!r} ended at byte {start + len(data)} while being read "
                                  f"(it was {self.size} bytes when opened)", offset=start + len(data))
            return data
        return bytes(self.reader.fetch(self.start + start, self.start + end))

    def readinto(self, start: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``start`` (a local file: straight into ``out``)."""
        if self.fd is None:
            out[:] = self.read(start, start + len(out))
            return
        done = 0
        while done < len(out):
            try:
                n = os.preadv(self.fd, [out[done:]], self.start + start + done)
            except OSError as e:
                raise FileAccessError(f"cannot read {self.where!r}: {e.strerror or e}", filename=self.where) from None
            if not n:
                raise FormatError(f"{self.where!r} ended at byte {start + done} while being read "
                                  f"(it was {self.size} bytes when opened)", offset=start + done)
            done += n

    def whole(self) -> Any:
        """Every byte of the blob: a view of a read-only map of a local file, else the bytes fetched."""
        if self._parent is not None and self.fd is not None:
            return memoryview(self._parent.whole())[self.start - self._parent.start :][: self.size]
        if self._parent is not None:
            return self.read(0, self.size)
        if self.fd is not None and self.size:
            with self._lock:
                if self._map is None:
                    try:
                        self._map = mmap.mmap(self.fd, self.size, access=mmap.ACCESS_READ)
                    except (OSError, ValueError) as e:
                        raise FileAccessError(f"cannot map {self.where!r}: {e}", filename=self.where) from None
            return self._map
        return self.read(0, self.size)

    def close(self) -> None:
        if self._parent is not None:  # (a part: its object is closed by whoever opened it)
            self.fd = self.reader = None
            parent, self._parent = self._parent, None
            if self._owns and parent is not None:
                parent.close()
            return
        m, self._map = self._map, None
        if m is not None:
            try:
                m.close()
            except BufferError:  # views of it remain; unmapped with the last one
                pass
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)
        r, self.reader = self.reader, None
        if r is not None:
            r.close()


def open_backend(root: Any, storage_options: Any) -> Local | Remote:
    """The backend of a store root: a folder (a path or ``file://`` URL), or any other URL."""
    resolved = storage.resolve(os.fspath(root) if isinstance(root, os.PathLike) else root, storage_options)
    if isinstance(resolved, storage.Location):
        return Remote(resolved.url, resolved.options)
    if not isinstance(resolved, str):
        from ..format.errors import UsageError

        raise UsageError(f"a store's root is a folder or a URL, not {type(root).__name__}")
    return Local(resolved)
