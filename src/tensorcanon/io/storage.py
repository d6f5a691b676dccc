"""Object storage: URLs, and the few operations a checkpoint needs from a store, over fsspec.

A URL (``s3://bucket/key``, ``memory://…``, ``gs://…``, any protocol fsspec knows,
``simplecache::s3://…`` chains included) names an object in a store; a local path
or a ``file://`` URL names a local file, which keeps tensorcanon's own code path
(:func:`resolve`). fsspec is an optional extra: without it a URL is a
:class:`~tensorcanon.UsageError` that names the extra to install.

:class:`Store` is what the rest of tensorcanon (and later the sharded reader and the
DCP writer) uses: ranged reads of one version of an object (:meth:`Store.reader`),
write-once puts (:meth:`Store.put`), multipart uploads whose parts may be sent in
any order and in parallel and that become visible only when completed, or are
aborted (:meth:`Store.upload`), a sequential commit-or-discard writer for stores
without multipart uploads (:meth:`Store.writer`), and ``info``, ``exists``,
``find``, ``glob``, ``delete``.

Every failure of the store becomes a :class:`~tensorcanon.FileAccessError` (a
:class:`~tensorcanon.MissingFileError` for a missing object) naming the URL, with
any password or signature in it hidden, and with every string of the
``storage_options`` (keys, secrets, tokens) removed from the message: no error
message of tensorcanon holds a credential. docs/STORAGE.md says what each store
guarantees and what tensorcanon adds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO

from ..format.errors import FileAccessError, MissingFileError, TensorCanonError, UsageError
from ..format.redact import redact as _redact

__all__ = ["Location", "Store", "ObjectReader", "Upload", "is_url", "resolve", "redact", "open_store"]

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*(://|::)")
EXTRA_HINT = "install the extra: pip install 'tensorcanon[s3]' for s3:// (fsspec and s3fs), 'tensorcanon[fsspec]' " \
             "for other fsspec protocols (with that protocol's fsspec package)"


def is_url(f: Any) -> bool:
    """True for a ``str`` that is a URL of an fsspec protocol (``file://`` included); paths are not."""
    return isinstance(f, str) and "://" in f and _SCHEME.match(f) is not None


def local_path(url: str) -> str | None:
    """The local path a plain ``file://`` URL names (``file:///tmp/a`` is ``/tmp/a``), else None."""
    if url.startswith("file://") and "::" not in url:
        return url[len("file://"):]
    return None


def redact(url: str) -> str:
    """``url`` (or any text) as it may be shown: a password in a URL becomes ``***``, and so do
    signature or token parameters of its query (a presigned URL's), even where the URL cannot be
    parsed. The one rule, format/redact.py, which every error message of the library goes through."""
    return _redact(url)


@dataclasses.dataclass(frozen=True, repr=False)
class Location:
    """An object named by a URL, with the ``storage_options`` to reach it.

    ``sequential``: how it will be read, when it is read. True (``load``, ``verify``)
    reads ahead in parallel; False (``tensorcanon.open``, headers) fetches little more
    than what is asked. ``wrap(file, size)`` may wrap the file read (progress bars).
    Its ``repr`` and ``str`` show the URL without credentials, never the options.
    """

    url: str
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    sequential: bool = True
    wrap: Callable[[Any, int], Any] | None = None

    @property
    def display(self) -> str:
        return redact(self.url)

    def __str__(self) -> str:
        return self.display

    def but(self, **changes: Any) -> Location:
        """This Location with fields changed (``loc.but(sequential=False)``)."""
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        return f"Location({self.display!r})"


def resolve(f: Any, storage_options: Mapping[str, Any] | None = None) -> Any:
    """What a public function was given, ready for the reader or writer.

    A URL becomes a :class:`Location` (a plain ``file://`` URL becomes its local path, so
    local files keep their exact code path); a Location gets ``storage_options`` when it
    has none; anything else is returned as it is. ``storage_options`` with a local path
    or a file object is a :class:`UsageError` (a URL typed ``s3:/bucket`` would otherwise
    be saved as a local file).
    """
    if isinstance(f, Location):
        return dataclasses.replace(f, options=storage_options) if storage_options and not f.options else f
    if is_url(f):
        path = local_path(f)
        if path is None:
            return Location(f, dict(storage_options or {}))
        f = path
    if storage_options:
        what = repr(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else type(f).__name__
        raise UsageError(f"storage_options apply to URLs (s3://bucket/key, ...), but {what} is not one")
    return f


# --------------------------------------------------------------------------- errors


#: Options whose values are not credentials, and that an error may show (where the store was).
_SHOWN = frozenset({"endpoint_url", "region_name", "region", "profile", "project"})


def _secrets(options: Mapping[str, Any]) -> list[str]:
    """Every string of 4 characters or more in ``options``, nested ones included (longest first),
    except the values of :data:`_SHOWN` options."""
    found: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, str) and len(v) >= 4:
            found.append(v)
        elif isinstance(v, Mapping):
            for k, x in v.items():
                if k not in _SHOWN:
                    walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(options)
    return sorted(set(found), key=len, reverse=True)


def _expired_types() -> tuple[type[BaseException], ...]:
    """fsspec's (and s3fs's) 'the object changed under an open file' exceptions."""
    found: list[type[BaseException]] = []
    for module in ("fsspec.exceptions", "s3fs.utils"):
        with contextlib.suppress(ImportError):
            cls = getattr(__import__(module, fromlist=["FileExpired"]), "FileExpired", None)
            if isinstance(cls, type):
                found.append(cls)
    return tuple(found)


class Store:
    """One fsspec filesystem, and the operations tensorcanon needs from it (see the module docstring).

    Paths are the filesystem's own (``bucket/key`` for s3); :meth:`url` gives the URL
    of one, as shown in messages (credentials hidden).
    """

    def __init__(self, fs: Any, options: Mapping[str, Any] | None = None,
                 origin: tuple[str, str] | None = None) -> None:
        self.fs = fs
        self._origin = origin  # (path, the URL it was named by): shown as the user wrote it
        self._secrets = _secrets(options or {})
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.protocol = str(protocols[0])
        #: True where :meth:`upload` sends parts in any order and in parallel (S3 multipart uploads).
        self.multipart = "s3" in protocols and hasattr(fs, "call_s3") and hasattr(fs, "split_path")

    def url(self, path: str) -> str:
        if self._origin is not None and path == self._origin[0]:
            return redact(self._origin[1])
        try:
            full = self.fs.unstrip_protocol(path)
        except Exception:  # noqa: BLE001 - only for display: any failure shows the path as given
            full = path
        if "://" not in full:  # memory:// spells some as memory:/path
            full = f"{self.protocol}://{path.lstrip('/')}"
        return redact(full)

    # ------------------------------------------------------------------ errors
    def scrub(self, text: str) -> str:
        """``text`` without any string of the storage options (credentials) in it."""
        for s in self._secrets:
            text = text.replace(s, "***")
        return text

    def error(self, e: BaseException, doing: str, path: str) -> FileAccessError:
        """A tensorcanon error for exception ``e`` of the store while ``doing`` ``path``."""
        url = self.url(path)
        if isinstance(e, FileAccessError):
            return e
        if isinstance(e, _expired_types()):
            return FileAccessError(
                f"cannot {doing} {url!r}: the object was replaced while it was being read (its ETag or "
                "version changed between two ranged reads); read it again", filename=url)
        # (hidden before it is cut short: a cut could leave half a password that no rule recognizes)
        reason = self.scrub(redact(str(e).strip().splitlines()[0] if str(e).strip() else ""))[:300]
        reason = f"{type(e).__name__}: {reason}" if reason else type(e).__name__
        if isinstance(e, FileNotFoundError):
            what = "bucket or folder" if doing == "write" else "object"
            return MissingFileError(f"cannot {doing} {url!r}: no such {what}", filename=url)
        if isinstance(e, PermissionError):
            return FileAccessError(f"cannot {doing} {url!r}: access denied ({reason}); check the credentials "
                                   "(storage_options, or the environment)", filename=url)
        return FileAccessError(f"cannot {doing} {url!r}: {reason}", filename=url)

    @contextlib.contextmanager
    def errors(self, doing: str, path: str) -> Iterator[None]:
        """Turn any failure of the store inside the block into :meth:`error`."""
        try:
            yield
        except TensorCanonError:
            raise
        except Exception as e:  # noqa: BLE001 - a store raises anything (botocore, aiohttp, OSError...)
            raise self.error(e, doing, path) from None

    # ------------------------------------------------------------------ objects
    def info(self, path: str) -> dict[str, Any]:
        """The store's description of the object at ``path`` (``size``, ``type``, often ``ETag``)."""
        with self.errors("read", path):
            info = self.fs.info(path)
        if info.get("type") == "directory":
            raise FileAccessError(f"cannot read {self.url(path)!r}: it is a directory (a prefix), not an object",
                                  filename=self.url(path))
        return dict(info)

    def size(self, path: str) -> int:
        return int(self.info(path)["size"])

    def exists(self, path: str) -> bool:
        with self.errors("look up", path):
            return bool(self.fs.exists(path))

    def isdir(self, path: str) -> bool:
        with self.errors("look up", path):
            return bool(self.fs.isdir(path))

    def find(self, path: str) -> list[str]:
        """Every object under the prefix ``path``, sorted."""
        with self.errors("list", path):
            return sorted(self.fs.find(path))

    def glob(self, pattern: str) -> list[str]:
        """The objects a glob pattern matches (``**`` recurses), sorted."""
        with self.errors("list", pattern):
            return sorted(p for p in self.fs.glob(pattern) if not self.fs.isdir(p))

    def delete(self, path: str) -> None:
        with self.errors("delete", path):
            self.fs.rm_file(path)

    def reader(self, path: str) -> ObjectReader:
        """Ranged reads of the object at ``path``, pinned to the version seen now where the store can."""
        return ObjectReader(self, path)

    def put(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Write the whole object at once: it becomes visible complete, or not at all."""
        with self.errors("write", path):
            if self.multipart:
                bucket, key, _ = self.fs.split_path(path)
                self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=bytes(data))
            else:
                self.fs.pipe_file(path, bytes(data))
            self.fs.invalidate_cache(path)

    def upload(self, path: str) -> Upload:
        """A multipart upload to ``path`` (needs :attr:`multipart`)."""
        if not self.multipart:
            raise UsageError(f"{self.protocol}:// has no multipart uploads; use Store.writer")
        return Upload(self, path)

    @contextlib.contextmanager
    def writer(self, path: str) -> Iterator[BinaryIO]:
        """A file to write the object at ``path`` sequentially: committed (made visible) when the
        block ends, discarded if it raises. Where the store cannot hold a file back until it is
        committed (see docs/STORAGE.md), what it shows meanwhile is the store's own behaviour."""
        from fsspec.implementations.memory import MemoryFile, MemoryFileSystem  # type: ignore[import-untyped,unused-ignore]

        with self.errors("write", path):
            if isinstance(self.fs, MemoryFileSystem):  # its open() publishes the file at once
                f: Any = MemoryFile(self.fs, self.fs._strip_protocol(path))
            else:
                f = self.fs.open(path, "wb", autocommit=False)
        try:
            yield f
            with self.errors("write", path):
                f.close()
                f.commit()
                self.fs.invalidate_cache(path)
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard()
            with contextlib.suppress(Exception):
                if not isinstance(f, MemoryFile):
                    f.close()
            raise


def open_store(url: str, options: Mapping[str, Any] | None = None) -> tuple[Store, str]:
    """The :class:`Store` that holds ``url``, and the object's path in it."""
    try:
        from fsspec.core import url_to_fs  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        raise UsageError(f"{redact(url)!r} is a URL: reading or writing it needs fsspec; {EXTRA_HINT}") from None
    probe = Store(_Named(url), options)
    try:
        fs, path = url_to_fs(url, **dict(options or {}))
    except ImportError as e:
        raise UsageError(f"{redact(url)!r} needs a package fsspec could not import ({probe.scrub(str(e))}); "
                         f"{EXTRA_HINT}") from None
    except ValueError as e:
        if "Protocol not known" in str(e):
            raise UsageError(f"{redact(url)!r}: fsspec knows no such protocol") from None
        raise probe.error(e, "open", url) from None
    except TypeError as e:  # an option the filesystem does not take
        raise UsageError(f"storage_options for {redact(url)!r} were refused: {probe.scrub(str(e))}") from None
    except Exception as e:  # noqa: BLE001 - a filesystem's constructor may raise anything
        raise probe.error(e, "open", url) from None
    return Store(fs, options, (path, url)), path


class _Named:
    """Stands for a filesystem not made yet, so that its errors can name the URL (open_store)."""

    protocol = "url"

    def __init__(self, url: str) -> None:
        self._url = url

    def unstrip_protocol(self, path: str) -> str:
        return self._url


class ObjectReader:
    """Ranged reads of one object, from one version of it where the store allows.

    ``size`` and ``tag`` (the ETag or version, when the store gives one) are taken
    when it is made. Reads of an s3 object carry ``If-Match: <ETag>`` (s3fs does
    this for every file it opens for reading), so a read after the object was
    replaced fails instead of returning bytes of the new version; other stores
    read whatever the object holds at the time, and the digests catch a mix.
    :meth:`fetch` may be called from several threads at once.
    """

    def __init__(self, store: Store, path: str) -> None:
        from fsspec.spec import AbstractBufferedFile  # type: ignore[import-untyped,unused-ignore]

        self.store = store
        self.path = path
        self.url = store.url(path)
        self.requested = 0  # bytes asked of the store so far
        self._lock = threading.Lock()
        with store.errors("read", path):
            # The object as it is now, not as a listing cached in this process saw it (older s3fs
            # pin reads to a cached ETag: a replaced object then read as "replaced while being read").
            store.fs.invalidate_cache(path)
            f = store.fs.open(path, "rb")
            if isinstance(f, AbstractBufferedFile):  # the backend's own ranged read (pinned for s3)
                self._file: Any = f
                self.size = int(f.size)
                details = getattr(f, "details", None) or {}
            else:  # a file object shared by every opener (memory://) or a local one: read by range
                self._file = None
                with contextlib.suppress(Exception):
                    f.close()
                details = store.fs.info(path)
                self.size = int(details["size"])
            if details.get("type") == "directory":
                raise FileAccessError(f"cannot read {self.url!r}: it is a directory (a prefix), not an object",
                                      filename=self.url)
        self.tag = details.get("ETag") or details.get("VersionId") or details.get("generation")

    def fetch(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object (fewer only if it is shorter than it was)."""
        if end <= start:
            return b""
        with self._lock:
            self.requested += end - start
        with self.store.errors("read", self.path):
            if self._file is not None:
                data = self._file._fetch_range(start, end)
            else:
                data = self.store.fs.cat_file(self.path, start=start, end=end)
        return bytes(data)

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            with contextlib.suppress(Exception):
                f.close()


class Upload:
    """One S3 multipart upload: parts sent in any order, from any thread; the object becomes
    visible only when :meth:`complete` succeeds. :meth:`abort` drops every part (the previous
    object at the URL, if any, stays as it was). The upload itself is created with the first
    part. Every part but the last must hold at least 5 MiB (S3's rule)."""

    def __init__(self, store: Store, path: str) -> None:
        self.store = store
        self.path = path
        self.bucket, self.key, _ = store.fs.split_path(path)
        self._id: str | None = None
        self._lock = threading.Lock()
        self._parts: dict[int, str] = {}

    def _upload_id(self) -> str:
        with self._lock:
            if self._id is None:
                with self.store.errors("write", self.path):
                    out = self.store.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key)
                self._id = str(out["UploadId"])
            return self._id

    def part(self, number: int, data: bytes | bytearray) -> None:
        """Send part ``number`` (1 to 10,000)."""
        upload_id = self._upload_id()
        with self.store.errors("write", self.path):
            out = self.store.fs.call_s3("upload_part", Bucket=self.bucket, Key=self.key, UploadId=upload_id,
                                        PartNumber=number, Body=data)
        with self._lock:
            self._parts[number] = out["ETag"]

    def complete(self) -> None:
        """Make the object visible, made of every part sent, in part-number order."""
        upload_id = self._upload_id()
        parts = [{"PartNumber": n, "ETag": tag} for n, tag in sorted(self._parts.items())]
        with self.store.errors("write", self.path):
            self.store.fs.call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self.key,
                                  UploadId=upload_id, MultipartUpload={"Parts": parts})
            self.store.fs.invalidate_cache(self.path)

    def abort(self) -> None:
        """Drop the upload (best effort: an upload that cannot be aborted stays invisible, and a
        bucket lifecycle rule (AbortIncompleteMultipartUpload) removes its parts later)."""
        with self._lock:
            upload_id, self._id = self._id, None
        if upload_id is not None:
            with contextlib.suppress(Exception):
                self.store.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key,
                                      UploadId=upload_id)
