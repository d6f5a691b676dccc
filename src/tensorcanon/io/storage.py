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
import errno
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO

from ..format.errors import FileAccessError, FormatError, MissingFileError, TensorCanonError, UsageError
from ..format.redact import redact as _redact
from . import fetch

__all__ = ["Location", "Store", "ObjectReader", "Upload", "is_url", "resolve", "redact", "open_store",
           "names_checkpoint", "refuse_shadowing", "written_over", "REDIRECTS_OPTION"]

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*(://|::)")
EXTRA_HINT = "pip install s3fs for s3:// (with fsspec: the [s3] extra of tensorcanon), or fsspec and the " \
             "protocol's own fsspec package for other protocols (the [fsspec] extra)"


def is_url(f: Any) -> bool:
    """True for a ``str`` that is a URL of an fsspec protocol (``file://`` included); paths are not."""
    return isinstance(f, str) and "://" in f and _SCHEME.match(f) is not None


def local_path(url: str) -> str | None:
    """The local path a plain ``file://`` URL names (``file:///tmp/a`` is ``/tmp/a``), else None."""
    if url.startswith("file://") and "::" not in url:
        return url[len("file://"):]
    return None


def local_target(url: str) -> str | None:
    """The local path an fsspec URL finally reads and writes: a ``file://`` or ``local://`` URL,
    alone or last in a chain (``simplecache::file:///tmp/a`` writes ``/tmp/a``), else None."""
    last = url.rsplit("::", 1)[-1]
    return last[len("local://"):] if last.startswith("local://") else local_path(last)


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
    #: True once the URL is known to name an object, not a checkpoint (:func:`names_checkpoint`
    #: said so, or the sharded reader named it from a checkpoint's index): not asked again.
    is_object: bool = False

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


def names_checkpoint(loc: Location) -> bool:
    """Whether a URL names a sharded checkpoint (a prefix that holds ``index.safetensors``) rather
    than an object: the one decision that the API (load, verify, open, read_metadata, diff) and the
    command line (verify, hash, inspect, lock, check) all take from here.

    A URL that names both (``s3://bkt/model`` is an object, and ``s3://bkt/model/index.safetensors``
    exists) is refused with a :class:`UsageError`: reading either one would make the other's content
    pass for it (verify one thing, load another). A URL ending in ``/`` names the prefix only, a
    URL with a query (presigned, ``?versionId=``) the object only. A
    URL the store cannot look up (no such bucket, no access) is not a checkpoint: reading it as an
    object then says what is wrong.
    """
    from ..format.sharding import INDEX_NAME

    store, path = open_store(loc.url, loc.options)
    folder = path.rstrip("/")
    if "?" in path:  # a query (a presigned URL, s3's ?versionId=) names one object: no prefix under it
        return False
    with store.errors("look up", path):  # the store as it is now, not as a listing cached in this process saw it
        store.fs.invalidate_cache(path)
    try:
        if not store.exists(f"{folder}/{INDEX_NAME}"):
            return False
        if loc.url.endswith("/"):
            return True
        is_file = bool(store.call("look up", path, "isfile", path)) or _memory_file(store.fs, path)
    except FileAccessError as e:
        if isinstance(e, MissingFileError) or e.errno != errno.ETIMEDOUT:
            return False
        raise  # a store past its deadline: not a fact about the URL
    if is_file:
        shown = loc.display
        raise UsageError(
            f"{shown!r} is ambiguous: it is an object, and also the prefix of a sharded checkpoint (it holds "
            f"{shown.rstrip('/')}/{INDEX_NAME}). tensorcanon refuses to guess which one is meant, as verifying "
            f"one and loading the other would pass one's content off as the other's. To read the checkpoint, "
            f"end the URL with '/' ({shown.rstrip('/')}/); to read the object, copy it to a key that is not a "
            "checkpoint's prefix (or remove the stale one)")
    return True


def refuse_shadowing(store: Store, path: str) -> None:
    """Refuse (:class:`UsageError`, naming both URLs) to write an object at ``path`` of ``store``
    where a sharded checkpoint's prefix of that name exists (``s3://b/model`` where
    ``s3://b/model/index.safetensors`` does): the object would make the URL name both, which
    :func:`names_checkpoint` and so every reader refuses. ``tensorcanon.save`` and ``consolidate``
    ask it before they write an object (docs/STORAGE.md)."""
    from ..format.sharding import INDEX_NAME

    folder = path.rstrip("/")
    index = f"{folder}/{INDEX_NAME}"
    if "?" in path or not folder:
        return
    with store.errors("look up", path):
        store.fs.invalidate_cache(folder)
    if store.exists(index):
        url = store.url(path).rstrip("/")  # (as the caller wrote it)
        raise UsageError(
            f"cannot write {url!r}: {url + '/'!r} is a sharded checkpoint (it holds {url}/{INDEX_NAME}), and an "
            f"object at {url!r} would make that URL name both, which every reader refuses as ambiguous; write the "
            "object under another name, or remove the checkpoint first")


def _where(f: str | os.PathLike[str], options: Mapping[str, Any] | None) -> tuple[str, str]:
    """Where a path or URL leads, to tell whether two name one thing: ``("", local path)`` for a local
    file (a path, a ``file://`` URL, a URL of a local filesystem such as ``local://``), else
    ``(protocol, the object's path in its store, without a trailing "/")``."""
    name = os.fspath(f)
    if not is_url(name):
        return "", name
    path = local_path(name)
    if path is not None:
        return "", path
    store, path = open_store(name, options)
    local = store.local()
    if local is not None and local is store.fs:
        return "", local._strip_protocol(path)
    return store.protocol, path.rstrip("/")


def written_over(out: str | os.PathLike[str], inputs: list | tuple, options: Mapping[str, Any] | None = None) -> Any:
    """The first of ``inputs`` (paths or URLs) that writing ``out`` would replace, or None: for local
    files the same file (device and inode, io/regular.same_file: by name, ``./x`` or ``x``, a
    symlink, a hard link, a ``file://`` or ``local://`` URL), for objects the same object of one
    store (``memory://a``, ``memory:///a`` and ``memory://a/`` are one). The one check that every
    command which writes an output makes against its inputs (consolidate, convert, diverge --html)."""
    from .regular import same_file

    kind, where = _where(out, options)
    for given in inputs:
        other_kind, other = _where(given, options)
        if other_kind != kind:
            continue
        if kind == "" and same_file(where, [other]) is not None:
            return given
        if kind != "" and where == other:
            return given
    return None


def exists(f: str | os.PathLike[str], options: Mapping[str, Any] | None = None) -> bool:
    """Whether something is at a path (a file, a folder, a dangling symlink) or at a URL (an object,
    or a prefix): what a command that writes only over nothing, unless told to (convert without
    --force), asks first."""
    kind, where = _where(f, options)
    if kind == "":
        return os.path.lexists(where)
    store, path = open_store(os.fspath(f), options)
    with store.errors("look up", path):
        store.fs.invalidate_cache(path)
    return store.exists(path)


def _memory_file(fs: Any, path: str) -> bool:
    """True for an object of fsspec's in-memory filesystem at ``path`` (older fsspec reports a path
    that is both an object and a folder there as a folder only)."""
    files = getattr(fs, "store", None) if type(fs).__name__ == "MemoryFileSystem" else None
    return isinstance(files, dict) and fs._strip_protocol(path) in files


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
        #: Seconds one request to the store may take, from sending it to its answer's last byte (fetch.py).
        self.deadline, options = fetch.deadline_of(options)
        self._secrets = _secrets(options)
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
        if isinstance(e.__cause__, FileAccessError):  # fsspec's http wraps what a request raised
            return e.__cause__
        if isinstance(e, _expired_types()) or (isinstance(e, OSError) and e.errno == errno.EINVAL
                                                and "pre-condition" in str(e)):  # S3's If-Match refused
            return FileAccessError(
                f"cannot {doing} {url!r}: the object was replaced while it was being read (its ETag or "
                "version changed between two ranged reads); read it again", filename=url)
        # (hidden before it is cut short: a cut could leave half a password that no rule recognizes)
        reason = self.scrub(redact(str(e).strip().splitlines()[0] if str(e).strip() else ""))[:300]
        reason = f"{type(e).__name__}: {reason}" if reason else type(e).__name__
        cause = e.__cause__
        if isinstance(e, FileNotFoundError) and isinstance(cause, OSError) and not isinstance(cause, FileNotFoundError):
            # fsspec's http says "not found" for a server it could not reach: say what happened
            reason = self.scrub(redact(str(cause).strip().splitlines()[0] if str(cause).strip() else ""))[:300]
            return FileAccessError(f"cannot {doing} {url!r}: the store could not be reached ({type(cause).__name__}"
                                   f"{': ' + reason if reason else ''})", filename=url)
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

    # ------------------------------------------------------------------ requests
    @property
    def is_async(self) -> bool:
        """True for a filesystem whose requests run on an event loop (s3fs, http, gcsfs, adlfs):
        each one then runs under :attr:`deadline`."""
        return bool(getattr(self.fs, "async_impl", False)) and getattr(self.fs, "loop", None) is not None

    def bounded(self, doing: str, path: str, coro: Callable[..., Any], *args: Any, what: str = "",
                **kwargs: Any) -> Any:
        """``await coro(*args, **kwargs)`` on the filesystem's event loop, stopped at :attr:`deadline`
        (a :class:`FileAccessError` naming the URL and how to raise it)."""
        from fsspec.asyn import FSTimeoutError, sync  # type: ignore[import-untyped,unused-ignore]

        start = time.monotonic()
        with self.errors(doing, path):
            try:
                return sync(self.fs.loop, coro, *args, timeout=self.deadline, **kwargs)
            except (FSTimeoutError, TimeoutError):
                if time.monotonic() - start < self.deadline * 0.9:  # the client's own timeout, not the deadline
                    url = self.url(path)
                    raise FileAccessError(f"cannot {doing} {url!r}: the store's client timed out (its own timeout, "
                                          "set in storage_options) before an answer came", filename=url,
                                          errno=errno.ETIMEDOUT) from None
                raise fetch.late(doing, self.url(path), self.deadline, what) from None

    def call(self, doing: str, path: str, name: str, *args: Any, **kwargs: Any) -> Any:
        """The filesystem's method ``name``: its coroutine ``_name`` under the deadline where the
        filesystem is asynchronous; the method in a thread waited for until the deadline where it
        wraps an asynchronous one (``simplecache::s3://…``); else the method itself (a local or
        in-memory filesystem)."""
        coro = getattr(self.fs, f"_{name}", None) if self.is_async else None
        if coro is not None:
            return self.bounded(doing, path, coro, *args, **kwargs)
        method = getattr(self.fs, name)
        if self.wraps_network():
            return self.waited(doing, path, method, *args, **kwargs)
        with self.errors(doing, path):
            return method(*args, **kwargs)

    def wraps_network(self) -> bool:
        """True for a filesystem that wraps an asynchronous (network) one: a cache chain."""
        fs, seen = getattr(self.fs, "fs", None), 0
        while fs is not None and seen < 8:
            if getattr(fs, "async_impl", False):
                return True
            fs, seen = getattr(fs, "fs", None), seen + 1
        return False

    def waited(self, doing: str, path: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)`` in a daemon thread, waited for until the deadline. Past it, the
        call is left to finish (or not) on its own, and a :class:`FileAccessError` says so: a
        filesystem that cannot be cancelled cannot hold the caller."""
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["value"] = method(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                out["error"] = e

        worker = threading.Thread(target=run, name="tensorcanon-store", daemon=True)
        worker.start()
        worker.join(self.deadline)
        if worker.is_alive():
            raise fetch.late(doing, self.url(path), self.deadline)
        with self.errors(doing, path):
            if "error" in out:
                raise out["error"]
            return out["value"]

    def s3(self, doing: str, path: str, method: str, what: str = "", **kwargs: Any) -> Any:
        """One S3 API call (s3fs's ``_call_s3``, its retries included) under the deadline."""
        return self.bounded(doing, path, self.fs._call_s3, method, what=what, **kwargs)

    def local(self) -> Any:
        """The local filesystem under this one (``local://``, or a chain such as
        ``simplecache::local://``), or None: reads of it go through the regular-file guard."""
        from fsspec.implementations.local import LocalFileSystem  # type: ignore[import-untyped,unused-ignore]

        fs, seen = self.fs, 0
        while fs is not None and seen < 8:
            if isinstance(fs, LocalFileSystem):
                return fs
            fs, seen = getattr(fs, "fs", None), seen + 1
        return None

    # ------------------------------------------------------------------ objects
    def info(self, path: str) -> dict[str, Any]:
        """The store's description of the object at ``path`` (``size``, ``type``, often ``ETag``)."""
        info = self.call("read", path, "info", path)
        if info.get("type") == "directory":
            raise FileAccessError(f"cannot read {self.url(path)!r}: it is a directory (a prefix), not an object",
                                  filename=self.url(path))
        return dict(info)

    def size(self, path: str) -> int:
        return claimed_size(self.info(path), self.url(path))

    def exists(self, path: str) -> bool:
        return bool(self.call("look up", path, "exists", path))

    def isdir(self, path: str) -> bool:
        return bool(self.call("look up", path, "isdir", path))

    def find(self, path: str) -> list[str]:
        """Every object under the prefix ``path``, sorted."""
        return sorted(self.call("list", path, "find", path))

    def glob(self, pattern: str) -> list[str]:
        """The objects a glob pattern matches (``**`` recurses), sorted."""
        found = self.call("list", pattern, "glob", pattern, detail=True)
        return sorted(p for p, info in found.items() if info.get("type") != "directory")

    def delete(self, path: str) -> None:
        self.call("delete", path, "rm_file", path)

    def reader(self, path: str) -> ObjectReader:
        """Ranged reads of the object at ``path``, pinned to the version seen now where the store can."""
        return ObjectReader(self, path)

    def put(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Write the whole object at once: it becomes visible complete, or not at all."""
        if self.multipart:
            bucket, key, _ = self.fs.split_path(path)
            self.s3("write", path, "put_object", Bucket=bucket, Key=key, Body=bytes(data))
        else:
            self.call("write", path, "pipe_file", path, bytes(data))
        with self.errors("write", path):
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
    follow, options = _redirects_of(options)
    probe = Store(_Named(url), options)
    _, fs_options = fetch.deadline_of(options)  # (tensorcanon's own option: not fsspec's)
    if not follow and url.split("://", 1)[0].lower() in ("http", "https"):
        client = dict(fs_options.get("client_kwargs") or {})
        client["trace_configs"] = [*client.get("trace_configs", ()), _no_redirects()]
        fs_options = {**fs_options, "client_kwargs": client}
    try:
        fs, path = _one_fs(url, fs_options) if _bracketed_colons_only(url) else url_to_fs(url, **fs_options)
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


#: The storage option that, set to False, makes an HTTP(S) store refuse redirects instead of
#: following them (lockfile checks set it: an allowed host must not send a read to another host).
REDIRECTS_OPTION = "tensorcanon_follow_redirects"


def _redirects_of(options: Mapping[str, Any] | None) -> tuple[bool, dict[str, Any] | None]:
    """``(follow redirects?, the options without REDIRECTS_OPTION)``."""
    if not options or REDIRECTS_OPTION not in options:
        return True, dict(options) if options is not None else None
    rest = dict(options)
    follow = rest.pop(REDIRECTS_OPTION)
    if not isinstance(follow, bool):
        raise UsageError(f"storage_options[{REDIRECTS_OPTION!r}] must be True or False, not {follow!r}")
    return follow, rest


_NO_REDIRECTS: list[Any] = []


def _no_redirects() -> Any:
    """An aiohttp trace config that stops a request at its first redirect, before the next request
    is sent, with a :class:`FileAccessError` naming where it pointed (one instance: fsspec caches
    filesystems by their options)."""
    if not _NO_REDIRECTS:
        import aiohttp  # type: ignore[import-not-found,unused-ignore]

        async def refuse(session: Any, ctx: Any, params: Any) -> None:
            url, to = redact(str(params.url)), redact(str(params.response.headers.get("Location", "")))
            raise FileAccessError(
                f"cannot read {url!r}: the server answered HTTP {params.response.status}, a redirect to "
                f"{to[:200]!r}, which is not followed here (a lockfile's --allow/allow= names the hosts and "
                "prefixes that may be read: lock the URL it points to, if that is the one meant)", filename=url)

        config = aiohttp.TraceConfig()
        config.on_request_redirect.append(refuse)
        config.freeze()
        _NO_REDIRECTS.append(config)
    return _NO_REDIRECTS[0]


def _bracketed_colons_only(url: str) -> bool:
    """True for a URL whose every ``::`` is inside ``[...]`` (an IPv6 host, ``http://[::1]:8000/x``):
    fsspec would read it as a chain (``::`` joins the URLs of one), so it is opened as one URL."""
    return "::" in url and "::" not in re.sub(r"\[[^\]/]*\]", "", url)


def _one_fs(url: str, options: Mapping[str, Any]) -> tuple[Any, str]:
    """The filesystem of one (not chained) URL and the path in it, as fsspec's url_to_fs makes them."""
    from fsspec import get_filesystem_class  # type: ignore[import-untyped,unused-ignore]

    cls = get_filesystem_class(url.split("://", 1)[0])
    kwargs = {**cls._get_kwargs_from_urls(url), **options}
    fs = cls(**kwargs)
    return fs, fs._strip_protocol(url)


class _Named:
    """Stands for a filesystem not made yet, so that its errors can name the URL (open_store)."""

    protocol = "url"

    def __init__(self, url: str) -> None:
        self._url = url

    def unstrip_protocol(self, path: str) -> str:
        return self._url


#: Sizes a store reports above this many bytes are proven before anything is allocated for them
#: (ObjectReader): a claim below it can cost at most this much memory that the object does not back.
PROVE_ABOVE = 1 << 20


def claimed_size(info: Mapping[str, Any], url: str) -> int:
    """The size a store reports for an object, checked to be a byte count (not proven: see ObjectReader)."""
    size = info.get("size")
    if isinstance(size, str) and size.strip().isdigit() and len(size.strip()) <= 20:
        size = int(size)
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size < 1 << 63:
        raise FileAccessError(f"cannot read {url!r}: the store reports no usable size for it ({size!r:.40}); "
                              "tensorcanon reads objects whose size the store states", filename=url)
    return size


class ObjectReader:
    """Ranged reads of one object, from one version of it where the store allows.

    ``size`` and ``tag`` (the ETag or version, when the store gives one) are taken when it
    is made. The size is the store's claim, as a header's sizes are a file's: before
    anything is allocated for it, a claim over :data:`PROVE_ABOVE` bytes is proven by
    reading the object's last byte (a store that says 1 TiB of a 1.4 KB object fails
    there, a :class:`FormatError` as for the same bytes read locally), and every read's
    answer must hold exactly the bytes asked: more is a :class:`FileAccessError` (and is
    not read past one byte more, fetch.py), fewer a :class:`FormatError` (the object ends
    before the size it was said to have). Reads of an s3 object carry ``If-Match: <ETag>``,
    so a read after the object was replaced fails instead of returning bytes of the new
    version; other stores read whatever the object holds at the time, and the digests catch
    a mix. Every request runs under the store's deadline (:attr:`Store.deadline`). An
    object of a local filesystem (``local://``) is read from a descriptor that the
    regular-file guard opened (regular.open_fd): never a FIFO or a device.
    :meth:`fetch` may be called from several threads at once.
    """

    def __init__(self, store: Store, path: str) -> None:
        self.store = store
        self.path = path
        self.url = store.url(path)
        self.requested = 0  # bytes asked of the store so far
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._read: Callable[[int, int], bytes]
        local = store.local()
        if local is not None and local is store.fs:
            self._open_local(local._strip_protocol(path))
            return
        if local is not None:  # a chain over local files (simplecache::local://): the guard first
            from .regular import open_fd

            os.close(open_fd(local._strip_protocol(path)))
        with store.errors("read", path):
            # The object as it is now, not as a listing cached in this process saw it.
            store.fs.invalidate_cache(path)
        details = store.info(path)
        self.size = claimed_size(details, self.url)
        self.tag = details.get("ETag") or details.get("VersionId") or details.get("generation")
        self._read = self._reader(details)
        if self.size > PROVE_ABOVE:
            self.fetch(self.size - 1, self.size)  # the claim proven: the store holds its last byte

    def _open_local(self, name: str) -> None:
        from .regular import open_fd

        self._fd = open_fd(name)
        self.size = os.fstat(self._fd).st_size
        self.tag = None
        fd = self._fd
        self._read = lambda start, end: os.pread(fd, end - start, start)

    def _reader(self, details: Mapping[str, Any]) -> Callable[[int, int], bytes]:
        """How bytes ``[start, end)`` are asked of this store: bounded where fetch.py knows it."""
        store, path = self.store, self.path
        if store.multipart and hasattr(store.fs, "_call_s3"):  # S3 (s3fs): one version, bounded answers
            bucket, key, version_id = store.fs.split_path(path)
            if not version_id and getattr(store.fs, "version_aware", False):
                version_id = details.get("VersionId")
            etag = details.get("ETag")
            return lambda start, end: store.bounded(
                "read", path, fetch.s3_range, store.fs, self.url, bucket, key, start, end, version_id=version_id,
                etag=etag, what=f" (bytes {start} to {end - 1})")
        if store.is_async and hasattr(store.fs, "set_session") and hasattr(store.fs, "encode_url"):  # HTTP(S)
            return lambda start, end: store.bounded(
                "read", path, fetch.http_range, store.fs, path, start, end, self.size,
                what=f" (bytes {start} to {end - 1})")
        return lambda start, end: bytes(store.call("read", path, "cat_file", path, start=start, end=end))

    def fetch(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object: exactly those, or an error (see the class docstring)."""
        if end <= start:
            return b""
        with self._lock:
            self.requested += end - start
        if self._fd is not None:
            with self.store.errors("read", self.path):
                data = self._read(start, end)
        else:
            data = self._read(start, end)
        if len(data) > end - start:
            raise fetch.wrong_length(self.url, start, end, f"more than {end - start}")
        if len(data) < end - start:
            raise FormatError(
                f"{self.url!r} ends before the {self.size} bytes its store reported: a read of bytes {start} "
                f"to {end - 1} got {len(data)}; the store's size is wrong, or the object was replaced while "
                "being read (read it again)", offset=start + len(data))
        return bytes(data)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


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
                out = self.store.s3("write", self.path, "create_multipart_upload", Bucket=self.bucket, Key=self.key)
                self._id = str(out["UploadId"])
            return self._id

    def part(self, number: int, data: bytes | bytearray) -> None:
        """Send part ``number`` (1 to 10,000)."""
        upload_id = self._upload_id()
        out = self.store.s3("write", self.path, "upload_part", Bucket=self.bucket, Key=self.key, UploadId=upload_id,
                            PartNumber=number, Body=data, what=f" (part {number}, {len(data)} bytes)")
        with self._lock:
            self._parts[number] = out["ETag"]

    def complete(self) -> None:
        """Make the object visible, made of every part sent, in part-number order."""
        upload_id = self._upload_id()
        parts = [{"PartNumber": n, "ETag": tag} for n, tag in sorted(self._parts.items())]
        self.store.s3("write", self.path, "complete_multipart_upload", Bucket=self.bucket, Key=self.key,
                      UploadId=upload_id, MultipartUpload={"Parts": parts})
        with self.store.errors("write", self.path):
            self.store.fs.invalidate_cache(self.path)

    def abort(self) -> None:
        """Drop the upload (best effort: an upload that cannot be aborted stays invisible, and a
        bucket lifecycle rule (AbortIncompleteMultipartUpload) removes its parts later)."""
        with self._lock:
            upload_id, self._id = self._id, None
        if upload_id is not None:
            with contextlib.suppress(Exception):  # (under the deadline too: a stalled store cannot hold it)
                self.store.s3("delete", self.path, "abort_multipart_upload", Bucket=self.bucket, Key=self.key,
                              UploadId=upload_id)
