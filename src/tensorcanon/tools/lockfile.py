"""Lockfiles: the expected digest of every artifact, in a text file made for review.

A lockfile pins what a pipeline must produce; CI re-hashes the artifacts and
compares (``tensorcanon lock`` / ``tensorcanon check``). Version 2 is::

    tensorcanon-lock 2
    xxh3-128:5d0c0e6d0bd3b8c7cf4ee0a6a3c9f1a2 1288 models/base.safetensors
    xxh3-128:9a1f...                          73104 models/head.pt

- the first line names the format and its version;
- then one line per file: digest, size in bytes, path, separated by single
  spaces (the path is the rest of the line, so it may hold spaces);
- paths are relative to the lockfile's folder, with ``/`` separators, and the
  lines are sorted by path (as UTF-8 bytes), so a change is a one-line diff.

The digest is the file's content digest: for a tensorcanon file the digest
it records (re-hashed to be sure); for a plain safetensors, ``.pt``, ``.npz``
or ``.npy`` file the digest tensorcanon would give its content
(:func:`tensorcanon.fingerprint` of what it loads), which is also the digest
of ``tensorcanon convert`` output. A sharded checkpoint directory
(tensorcanon.dcp) is one entry: its logical digest, and the size of its
consolidated file, both independent of the world size it was saved with.

An object in a store is locked by its URL (``s3://bucket/ckpt/base.safetensors``),
written as it was given (a URL holding a password or a signature is refused: give
credentials through the environment or ``storage_options``); ``check`` reads it
from the store again.

What a line may name is decided in one place (:func:`target`): a path inside the lockfile's
folder (after following symlinks, so ``..``, an absolute path, a ``file://``/``local://`` URL or
a symlink cannot leave it), nothing else. A lockfile is input like any file: one from a pull
request or a download must not make ``check`` read ``/etc``, or send requests to a host it
names. ``allow`` (``--allow`` on the command line) widens the scope explicitly: each item is a
folder (lines may then also name files under it) or a URL prefix such as ``s3://bucket/ckpt``
(lines may name objects under it: same scheme, same bucket or host, under that prefix).
``make_lock`` applies the same rule to the local files it locks (the URLs it is given are what
it was asked for); every lockfile operation ends within ``timeout`` seconds.

The lockfile version says which file-format version those computed digests
use: a version-1 lockfile (written before format version 2) holds format-1
fingerprints, and :func:`check_lock` computes format-1 fingerprints to check
it, so existing lockfiles keep passing. New lockfiles are version 2.

Example::

    entries = lockfile.make_lock(["ckpt/*.safetensors"], "tensors.lock")
    lockfile.write_lock(entries, "tensors.lock")
    bad = [r for r in lockfile.check_lock("tensors.lock") if r.status != "ok"]
"""

from __future__ import annotations

import contextlib
import errno as _errno
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..format import container, digest as _digest, manifest
from ..format.errors import (
    FileAccessError,
    FormatError,
    MissingFileError,
    TensorCanonError,
    UsageError,
)
from ..format.limits import DEFAULT, Limits
from ..io import reader, storage, writer

__all__ = ["HEADER", "VERSION", "LockEntry", "CheckResult", "content_digest", "collect", "Scope", "target",
           "make_lock", "format_lock", "parse_lock", "read_lock", "write_lock", "check_lock", "TIMEOUT"]

VERSION = 3
HEADER = f"tensorcanon-lock {VERSION}"
#: Lockfile version -> the file-format version of the fingerprints it records.
FORMAT_OF = {1: 1, 2: 2, 3: 3}
#: Suffixes picked up when a folder is given to :func:`collect`.
SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".npz", ".npy")

#: Seconds a whole ``make_lock`` or ``check_lock`` may take by default (``timeout=`` changes it).
TIMEOUT = 3600.0
#: The largest lockfile read (bytes): a lockfile is text, about 100 bytes a line.
MAX_LOCKFILE_BYTES = 64 << 20
#: The most lines (files) one lockfile may list: checking it holds one result per line in memory.
MAX_LOCKFILE_LINES = 1_000_000

Wrap = Callable[[Any, int], Any]
_T = TypeVar("_T")
_R = TypeVar("_R")


@dataclass(frozen=True, slots=True)
class LockEntry:
    """One line of a lockfile."""

    path: str      # relative to the lockfile's folder, "/"-separated
    digest: str
    size: int

    def line(self) -> str:
        return f"{self.digest} {self.size} {self.path}"


@dataclass(frozen=True, slots=True)
class CheckResult:
    """How one locked file compares.

    ``status`` is ``ok``; ``mismatch`` (digest or size differ); ``missing``;
    ``corrupt`` (its bytes do not match the digests it records) or
    ``unreadable`` (not a file tensorcanon reads).
    """

    entry: LockEntry
    status: str
    digest: str | None = None   # what was found (None when missing or unreadable)
    size: int | None = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def content_digest(path: str | os.PathLike | storage.Location, *, verify: bool = True, wrap: Wrap | None = None,
                   limits: Limits = DEFAULT, format_version: int = manifest.VERSION,
                   storage_options: Any = None) -> tuple[str, str]:
    """``(digest, format)`` of a file; see the module docstring for which digest.

    With ``verify=True`` a tensorcanon file is re-hashed completely
    (:func:`tensorcanon.verify`); with ``verify=False`` its recorded digest is
    read from the manifest. Other formats are always loaded and hashed, as a
    file of format ``format_version`` would record them. A URL is read from its
    store (with ``storage_options``), streamed, without a local copy.
    """
    from ..io import reader
    from .diff import detect_format, load_file

    loc = storage.resolve(path, storage_options)
    if isinstance(loc, storage.Location) and _checkpoint(loc):  # a sharded checkpoint's directory URL
        from ..sharded import layout, tools

        return tools.content_digest(loc, verify=verify, limits=limits), layout.FORMAT
    if isinstance(loc, storage.Location):
        fmt = detect_format(loc)
        if fmt == "tensorcanon":
            with reader.open_file(loc.but(sequential=verify, wrap=wrap if verify else None), limits) as cf:
                recorded = cf.verify() if verify else cf.digest
                if recorded is None:  # detect_format saw a manifest, but the object changed since
                    raise FormatError(f"{loc} changed while it was read: it no longer holds a tensorcanon manifest")
                return recorded, fmt
        loaded = load_file(loc, limits=limits, wrap=wrap, stored=True)
        return writer.fingerprint(writer.plan(loaded.value, None, limits, version=format_version)), fmt
    return _local_digest(os.fspath(loc), verify, wrap, limits, format_version)


def _local_digest(path: str, verify: bool, wrap: Wrap | None, limits: Limits, format_version: int) -> tuple[str, str]:
    from ..io import reader
    from ..io.source import open_path
    from .diff import detect_format, load_file

    if os.path.isdir(path):  # a sharded checkpoint: its logical digest
        from ..sharded import layout, tools

        return tools.content_digest(path, verify=verify, limits=limits), layout.FORMAT
    fmt = detect_format(path)
    if fmt == "tensorcanon":
        with open_path(path) as fh:
            f = wrap(fh, os.fstat(fh.fileno()).st_size) if wrap and verify else fh
            with reader.open_file(f, limits) as cf:
                recorded = cf.verify() if verify else cf.digest
                if recorded is None:  # detect_format saw a manifest, but the file changed since
                    raise FormatError(f"{path} changed while it was read: it no longer holds a tensorcanon manifest")
                return recorded, fmt
    loaded = load_file(path, limits=limits, wrap=wrap, stored=True)  # (plain safetensors: no torch)
    return writer.fingerprint(writer.plan(loaded.value, None, limits, version=format_version)), fmt


# --------------------------------------------------------------------------- what a line may name


class Scope:
    """Where the lines of one lockfile may point: its folder, and what ``allow`` adds.

    ``allow`` items are folders (local paths, relative to the current folder) or URL prefixes
    (``s3://bucket/prefix``: objects of that scheme and bucket or host, under that prefix)."""

    def __init__(self, base: str, allow: Iterable[str | os.PathLike] = ()) -> None:
        self.base = base
        self.folders = [os.path.realpath(base)]
        self.urls: list[str] = []
        for item in allow:
            text = os.fspath(item)
            if not isinstance(text, str) or not text:
                raise UsageError(f"allow: {text!r} is not a folder or a URL prefix")
            if storage.is_url(text) and _url_local_path(text) is None:
                if storage.redact(text) != text:
                    raise UsageError(f"allow: {storage.redact(text)!r} holds a password or a signature; "
                                     "give credentials through the environment or storage_options")
                if "::" in text or any(seg in (".", "..") for seg in text.split("://", 1)[1].split("/")):
                    raise UsageError(f"allow: {text!r} must be a plain URL prefix (no '::' chain, no '.' "
                                     "or '..' segments)")
                self.urls.append(text.rstrip("/") + "/")
            else:
                path = _url_local_path(text) or text
                self.folders.append(os.path.realpath(path))

    def hint(self) -> str:
        return ("a lockfile's lines may name files inside its own folder only, unless more is allowed "
                "explicitly: `tensorcanon check --allow FOLDER_OR_URL_PREFIX LOCKFILE` "
                "(Python: check_lock(..., allow=[...]))")

    def local(self, path: str) -> bool:
        """True when ``path`` (followed through symlinks) lies in the folder or an allowed one."""
        real = os.path.realpath(path)
        return any(real == f or real.startswith(f.rstrip(os.sep) + os.sep) for f in self.folders)

    def url(self, url: str) -> bool:
        """True when the URL is under an allowed prefix, without '.', '..' or '::' to leave it."""
        if "::" in url or "\x00" in url:
            return False
        rest = url.split("://", 1)[1]
        segments = rest.split("?", 1)[0].split("#", 1)[0].split("/")
        if any(_unquoted(seg) in (".", "..") for seg in segments):
            return False
        return any((url.rstrip("/") + "/").startswith(prefix) for prefix in self.urls)


def _unquoted(segment: str) -> str:
    return re.sub(r"%2[eE]", ".", segment)


def _url_local_path(url: str) -> str | None:
    """The local path of a ``file://`` or ``local://`` URL (both read local files), else None."""
    for scheme in ("file://", "local://"):
        if url.startswith(scheme) and "::" not in url:
            return url[len(scheme):]
    return None


def target(line_path: str, scope: Scope, where: str = "lockfile", limits: Limits = DEFAULT) -> str:
    """The file (a local path) or object (a URL) a lockfile line names, or :class:`FormatError`
    when the line names something outside ``scope`` (see the module docstring). This is the one
    place that decides what a lockfile line may name; for a sharded checkpoint directory, that
    is every file its digest reads (the index, and each rank file the index names)."""
    def refuse(why: str) -> FormatError:
        return FormatError(f"{where}: the line for {storage.redact(line_path)!r} {why}; {scope.hint()}")

    if "\x00" in line_path:
        raise refuse("holds a NUL character")
    if storage.is_url(line_path):
        local = _url_local_path(line_path)
        if local is None:
            if not scope.url(line_path):
                raise refuse("names an object in a store outside the allowed URL prefixes "
                             f"({', '.join(scope.urls) or 'none'})")
            return line_path
        path = local  # a file:// or local:// URL: an absolute path, under the same rule as one
    elif os.path.isabs(line_path) or line_path.startswith("/"):
        path = line_path
    else:
        path = os.path.join(scope.base, *line_path.split("/"))
    if not scope.local(path):
        raise refuse("names a file outside the lockfile's folder (an absolute path, '..' or a symlink "
                     "leading out of it)")
    if os.path.isdir(path):  # a sharded checkpoint: its index and rank files are read, so judged too
        from ..sharded import layout, tools

        if not scope.local(os.path.join(path, layout.INDEX_NAME)):
            raise refuse(f"is a checkpoint directory whose {layout.INDEX_NAME} is a symlink leading out of "
                         "the lockfile's folder")
        try:
            names = tools.files(path, limits)
        except (TensorCanonError, OSError):  # no index or a damaged one: reading it says what is wrong
            return path
        outside = [os.path.basename(n) for n in names if not scope.local(n)]
        if outside:
            raise refuse(f"is a checkpoint directory whose file {outside[0]!r} leads out of the lockfile's "
                         "folder (a symlink)")
    return path


def _run_bounded(fn: Callable[[_T], _R], items: Sequence[_T], workers: int, timeout: float,
                 late: Callable[[_T], _R]) -> list[_R]:
    """``fn`` of every item on up to ``workers`` daemon threads; an item not done ``timeout``
    seconds after the start gets ``late(item)`` instead (its thread is left to finish or to end
    with the process: a read that never returns cannot be interrupted). The first exception of
    ``fn`` stops the run and is raised here."""
    if not (timeout > 0):
        raise UsageError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    results: dict[int, _R] = {}
    errors: dict[int, BaseException] = {}
    lock = threading.Condition()
    todo = iter(range(len(items)))
    deadline = time.monotonic() + timeout

    def work() -> None:
        while True:
            with lock:
                i = None if errors else next(todo, None)  # (after a failure, nothing more is started)
            if i is None or time.monotonic() > deadline:
                return
            try:
                r = fn(items[i])
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread, raised there
                with lock:
                    errors[i] = e
                    lock.notify_all()
                continue
            with lock:
                results[i] = r
                lock.notify_all()

    for n in range(max(1, min(workers, len(items)))):
        threading.Thread(target=work, name=f"tensorcanon-lock-{n}", daemon=True).start()
    with lock:
        while not errors and len(results) < len(items):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            lock.wait(min(left, 0.5))
        if errors:
            raise errors[min(errors)]
        out = [results[i] if i in results else late(item) for i, item in enumerate(items)]
        return out


def _timed_out(what: str, timeout: float) -> FileAccessError:
    return FileAccessError(f"{what}: not finished within the timeout of {timeout:g} s (pass a larger "
                           "timeout=, or --timeout on the command line, for larger files or slower stores)",
                           errno=_errno.ETIMEDOUT)


# --------------------------------------------------------------------------- collecting files


def _glob(pattern: str) -> list[str]:
    """The paths a glob matches, ``**`` matching any number of folders, without following
    symlinked folders (``glob.glob`` follows them: a link to its own folder repeats every file
    under it ~40 times, two such links never finish). A symlinked file is matched by its name."""
    parts = pattern.split(os.sep)
    fixed = 0
    while fixed < len(parts) - 1 and not _has_magic(parts[fixed]):
        fixed += 1
    root = os.sep.join(parts[:fixed]) or ("" if not pattern.startswith(os.sep) else os.sep)
    rest = parts[fixed:]
    regex = re.compile(_translate(rest), re.DOTALL)
    top = root or os.curdir
    if not os.path.isdir(top):
        return []
    found = []
    for folder, dirs, names in os.walk(top):  # (os.walk never descends into a symlinked folder)
        dirs.sort()
        rel_folder = os.path.relpath(folder, top)
        for name in sorted(dirs + names):
            rel = name if rel_folder == os.curdir else os.path.join(rel_folder, name)
            if regex.fullmatch(rel):
                found.append(os.path.join(root, rel) if root else rel)
    return found


def _translate(parts: list[str]) -> str:
    """A regular expression for the path components of a glob, relative to its fixed root."""
    out = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            out.append("(?:(?!\\.)[^/]+/)*" if not last else "(?:(?!\\.)[^/]+/)*(?!\\.)[^/]+")
            continue
        piece = _component(part)
        out.append(piece + ("" if last else "/"))
    return "".join(out).replace("/", re.escape(os.sep))


def _component(part: str) -> str:
    """The regular expression of one glob component: ``*`` and ``?`` never cross a separator."""
    out, i = [], 0
    if not part.startswith("."):
        out.append("(?!\\.)")
    while i < len(part):
        c = part[i]
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = part.find("]", i + 2 if part[i + 1:i + 2] in ("!", "]") else i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = part[i + 1:j]
                neg = body.startswith("!")
                body = body[1:] if neg else body
                out.append("[" + ("^/" if neg else "") + body.replace("\\", "\\\\") + "]")
                i = j
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def _has_magic(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def collect(patterns: Iterable[str], exclude: str | None = None, storage_options: Any = None) -> list[str]:
    """The files named by paths, globs (``**`` recurses) and folders, sorted, without repeats.

    A folder contributes every file under it with a suffix in :data:`SUFFIXES`.
    Raises :class:`~tensorcanon.MissingFileError` (a ``FileNotFoundError``) for a path that does
    not exist or a glob that matches nothing, so a typo never produces an empty lockfile.
    Anything else that is not a folder is listed too, a FIFO or a device included: hashing it
    then refuses it, naming it (it is never opened as a stream, which could wait forever).
    A URL (``s3://bucket/ckpt/*.safetensors``, or a prefix ending in ``/``) lists objects
    of its store, named by their URLs.
    """
    found: set[str] = set()
    skip = os.path.abspath(exclude) if exclude else None
    for pattern in patterns:
        if storage.is_url(pattern) and storage.local_path(pattern) is None:
            found.update(_collect_url(pattern, storage_options))
            continue
        pattern = storage.local_path(pattern) or pattern
        if _has_magic(pattern):
            matches = [m for m in _glob(pattern)
                       if (os.path.exists(m) and not os.path.isdir(m)) or _checkpoint(m)]
            if not matches:
                raise MissingFileError(f"no file matches {pattern!r}", filename=pattern)
        elif os.path.isdir(pattern):
            matches = []
            for root, dirs, names in os.walk(pattern):
                if _checkpoint(root):  # a sharded checkpoint is one entry, not its files
                    matches.append(root)
                    dirs[:] = []
                    continue
                matches.extend(os.path.join(root, name) for name in names if name.lower().endswith(SUFFIXES))
            if not matches:
                raise MissingFileError(f"folder {pattern!r} holds no {'/'.join(SUFFIXES)} files", filename=pattern)
        elif os.path.exists(pattern):  # a file, or a FIFO or device that make_lock refuses by name
            if skip is not None and os.path.abspath(pattern) == skip:
                raise UsageError(f"{pattern!r} is both a file to lock and the lockfile to write: writing the "
                                 "lockfile would replace it; choose another output (-o LOCKFILE)")
            matches = [pattern]
        else:
            raise MissingFileError(f"{pattern!r} does not exist", filename=pattern)
        found.update(os.path.abspath(m) for m in matches)
    found.discard(skip)
    return sorted(found)


def _collect_url(pattern: str, storage_options: Any = None) -> list[str]:
    """The URLs of the objects a URL, a URL glob or a URL prefix (ending in ``/``) names."""
    if storage.redact(pattern) != pattern:
        raise UsageError(f"{storage.redact(pattern)!r} holds a password or a signature, which a lockfile would "
                         "record: give credentials through the environment or storage_options instead")
    store, path = storage.open_store(pattern, storage_options)
    prefix = pattern.split("://", 1)[0] + "://"

    def url(p: str) -> str:  # the URL of a path the store listed, spelled as the pattern was
        return prefix + p.lstrip("/") if not p.startswith(prefix) else p

    if _has_magic(path):
        matches = [url(p) for p in store.glob(path)]
        if not matches:
            raise MissingFileError(f"no object matches {pattern!r}", filename=pattern)
        return matches
    if _checkpoint(storage.Location(pattern, dict(storage_options or {}))):  # one entry, not its files
        return [pattern.rstrip("/")]
    if pattern.endswith("/") or store.isdir(path):
        matches = [url(p) for p in store.find(path) if p.lower().endswith(SUFFIXES)]
        if not matches:
            raise MissingFileError(f"{pattern!r} holds no {'/'.join(SUFFIXES)} objects", filename=pattern)
        return matches
    if not store.exists(path):
        raise MissingFileError(f"{pattern!r} does not exist", filename=pattern)
    return [pattern]


def _checkpoint(path: str | storage.Location) -> bool:
    """A sharded checkpoint directory (tensorcanon.dcp): locked as one entry."""
    from ..sharded import tools

    return tools.is_checkpoint(path)


def _size(path: str, limits: Limits = DEFAULT, storage_options: Any = None) -> int:
    """A file's size; for a checkpoint directory, the size of its consolidated file."""
    if storage.is_url(path):
        from ..io import remote

        loc = remote.location(path, storage_options)
        if loc is not None and _checkpoint(loc):
            from ..sharded import tools

            return tools.consolidated_size(loc, limits)
        if loc is not None:
            return remote.size(loc)
    if os.path.isdir(path):
        from ..sharded import tools

        return tools.consolidated_size(path, limits)
    return os.path.getsize(path)


def _relative(path: str, base: str) -> str:
    if storage.is_url(path) and _url_local_path(path) is not None:  # a local file named by a URL
        path = _url_local_path(path) or path
    if storage.is_url(path):  # an object in a store: its URL
        rel = path
        if any(c in rel for c in "\n\r") or rel != rel.strip(" "):
            raise FormatError(f"URL {rel!r} cannot be written in a lockfile (line break or edge spaces)")
        return rel
    rel = os.path.relpath(os.path.abspath(path), base).replace(os.sep, "/")
    if any(c in rel for c in "\n\r") or rel != rel.strip(" "):
        raise FormatError(f"path {rel!r} cannot be written in a lockfile (line break or edge spaces)")
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:  # a name of bytes that are not UTF-8 (held as surrogate escapes)
        shown = rel.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        raise FormatError(f"path '{shown}' cannot be written in a lockfile: its name is not UTF-8 text "
                          "(a lockfile is UTF-8); rename the file") from None
    return rel


def make_lock(patterns: Iterable[str], lock_path: str | os.PathLike, *, wrap: Wrap | None = None,
              limits: Limits = DEFAULT, storage_options: Any = None, allow: Iterable[str | os.PathLike] = (),
              timeout: float = TIMEOUT) -> list[LockEntry]:
    """Hash every file the patterns name and return the lockfile's entries (not yet written).

    ``storage_options`` are used for patterns that are URLs (objects in a store). A local file
    outside the lockfile's folder (followed through symlinks) is refused unless under a folder of
    ``allow``, as :func:`check_lock` would refuse its line (see the module docstring); ``check_lock``
    of URL entries needs their prefix in its ``allow``. Raises ``FileAccessError`` when hashing
    takes longer than ``timeout`` seconds."""
    lock_path = os.fspath(lock_path)
    base = os.path.dirname(os.path.abspath(lock_path))
    scope = Scope(base, allow)
    start = time.monotonic()
    patterns = list(patterns)

    def listed(_: None) -> list[str]:  # (listing a store is bounded by the deadline too)
        return collect(patterns, exclude=lock_path, storage_options=storage_options)

    def late_listing(_: None) -> list[str]:
        raise _timed_out("listing the files to lock", timeout)

    refuse_replacing(lock_path)
    paths = _run_bounded(listed, [None], 1, timeout, late_listing)[0]
    if not paths:
        raise UsageError(f"nothing to lock: the paths given name no file but the lockfile {lock_path!r} itself")
    named = []
    for path in paths:
        rel = _relative(path, base)
        if not storage.is_url(path) or _url_local_path(path) is not None:  # a local file, however named
            target(rel, scope, where=f"cannot lock {path}", limits=limits)
        named.append((path, rel))

    def one(item: tuple[str, str]) -> LockEntry:
        path, rel = item
        options = storage_options if storage.is_url(path) else None
        try:
            d, _ = content_digest(path, wrap=wrap, limits=limits, storage_options=options)
            size = _size(path, limits, options)
        except TensorCanonError as e:  # a file that cannot be locked: say which
            raise FormatError(f"cannot lock {rel}: {e}") from e
        return LockEntry(rel, d, size)

    def late(item: tuple[str, str]) -> LockEntry:
        raise _timed_out(f"cannot lock {item[1]}", timeout)

    entries = _run_bounded(one, named, 1, max(timeout - (time.monotonic() - start), 1e-3), late)
    return sorted(entries, key=lambda e: e.path.encode("utf-8"))


def format_lock(entries: Iterable[LockEntry]) -> str:
    """The lockfile text: header line, then entries sorted by path."""
    ordered = sorted(entries, key=lambda e: e.path.encode("utf-8"))
    return "".join(line + "\n" for line in [HEADER, *(e.line() for e in ordered)])


def refuse_replacing(lock_path: str) -> None:
    """A :class:`UsageError` when ``lock_path`` exists and is not a lockfile (a tensor file named
    as the output by mistake is not replaced)."""
    if not os.path.lexists(lock_path):
        return
    head = b""
    if os.path.isfile(lock_path):
        from ..io.source import open_path

        with contextlib.suppress(TensorCanonError, OSError), open_path(lock_path, what="a lockfile") as fh:
            head = fh.read(len("tensorcanon-lock "))
    if head != b"tensorcanon-lock ":
        raise UsageError(f"{lock_path!r} exists and is not a lockfile: it is not replaced by one; "
                         "choose another output (-o LOCKFILE) or remove it first")


def write_lock(entries: Iterable[LockEntry], lock_path: str | os.PathLike) -> None:
    """Write the lockfile atomically (a temp file beside it, then a rename). An existing file at
    ``lock_path`` is replaced only when it is a lockfile (else :class:`UsageError`)."""
    lock_path = os.fspath(lock_path)
    refuse_replacing(lock_path)
    text = format_lock(entries).encode("utf-8")
    writer.replace_atomically(lock_path, lambda f, tmp: f.write(text))


def parse_lock(text: str, where: str = "lockfile") -> list[LockEntry]:
    """Parse lockfile text. Raises :class:`FormatError` naming the line that is wrong."""
    return _parse(text, where)[1]


def _parse(text: str, where: str) -> tuple[int, list[LockEntry]]:
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) > MAX_LOCKFILE_LINES + 1:
        raise FormatError(f"{where}: {len(lines) - 1} lines of files, more than the {MAX_LOCKFILE_LINES} one "
                          "lockfile may list; split it into several lockfiles")
    lines = [line[:-1] if line.endswith("\r") else line for line in lines]
    headers = {f"tensorcanon-lock {v}": v for v in FORMAT_OF}
    if not lines or lines[0] not in headers:
        first = lines[0][:40] if lines else ""
        if first.startswith("tensorcanon-lock "):
            raise FormatError(
                f"{where}: lockfile version {first.split(' ', 1)[1]!r} is not supported (this "
                f"tensorcanon reads versions {', '.join(map(str, FORMAT_OF))}); upgrade tensorcanon"
            )
        # (what the file holds is not quoted: it may be any file, a secret one included)
        raise FormatError(f"{where}: not a tensorcanon lockfile: line 1 must be {HEADER!r}")
    entries, seen = [], set()
    for number, line in enumerate(lines[1:], start=2):
        parts = line.split(" ", 2)
        if len(parts) != 3 or not _digest.is_text(parts[0]) or not parts[1].isdigit() \
                or not parts[1].isascii() or len(parts[1]) > 20 or not parts[2]:  # 20 digits: < 2**64
            raise FormatError(
                f"{where}, line {number}: expected '<digest> <size> <path>' with a digest like "
                f"'xxh3-128:<32 hex digits>' and a size in bytes, found {line[:80]!r}"
            )
        if parts[2] in seen:
            raise FormatError(f"{where}, line {number}: {parts[2]!r} is listed twice")
        seen.add(parts[2])
        entries.append(LockEntry(parts[2], parts[0], int(parts[1])))
    return headers[lines[0]], entries


def read_lock(lock_path: str | os.PathLike) -> list[LockEntry]:
    """Read and parse a lockfile."""
    return _read(lock_path)[1]


def _read(lock_path: str | os.PathLike) -> tuple[int, list[LockEntry]]:
    from ..io.source import open_path

    lock_path = os.fspath(lock_path)
    with open_path(lock_path, what="a lockfile") as fh:
        raw = fh.read(MAX_LOCKFILE_BYTES + 1)
    tensors = _tensor_file(raw[:9])
    if tensors is not None:  # (a tensor file given where a lockfile goes: say what to run instead)
        raise FormatError(f"{lock_path}: {tensors}, not a lockfile: check takes a lockfile written by "
                          f"`tensorcanon lock`; to check the file itself, use `tensorcanon verify {lock_path}`")
    if len(raw) > MAX_LOCKFILE_BYTES:
        raise FormatError(f"{lock_path}: larger than {MAX_LOCKFILE_BYTES} bytes, not a lockfile "
                          "(a lockfile holds one short line per file)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{lock_path}: not UTF-8 text (byte {e.start})") from None
    return _parse(text, lock_path)


def _tensor_file(head: bytes) -> str | None:
    """What a file that starts with ``head`` is when it is a tensor file (or a trace), not a lockfile:
    the formats of container.foreign_kind, and a safetensors header (a '{' after the 8-byte length)."""
    if head.startswith(b"tensorcanon-lock"):
        return None
    if head[container.LENGTH_SIZE:container.LENGTH_SIZE + 1] == b"{":  # (a length, then a JSON header)
        return "a safetensors file"
    kind = container.foreign_kind(head)
    return kind[0] if kind is not None else None


def check_lock(lock_path: str | os.PathLike, *, wrap: Wrap | None = None,
               limits: Limits = DEFAULT, storage_options: Any = None, workers: int = 1,
               allow: Iterable[str | os.PathLike] = (), timeout: float = TIMEOUT) -> list[CheckResult]:
    """Re-hash every file a lockfile lists; one :class:`CheckResult` per entry, in order.

    Every line must name a file inside the lockfile's folder (followed through symlinks), or
    something ``allow`` adds (folders, and URL prefixes such as ``s3://bucket/ckpt``): else
    :class:`FormatError` names the line, before anything is read (see the module docstring).
    ``storage_options`` are used for the entries that are URLs (objects in a store). With
    ``workers`` > 1, that many files are hashed at once, on threads (reading and hashing release
    the GIL): the results are the same, in the same order. A file not checked within ``timeout``
    seconds of the start is ``unreadable`` ("not finished within the timeout"); a file that
    cannot be read, whatever the reason, is ``unreadable`` while the others are still checked."""
    start = time.monotonic()  # (the one deadline: reading, judging and checking the lines)
    if not (timeout > 0):
        raise UsageError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    lock_path = os.fspath(lock_path)
    base = os.path.dirname(os.path.abspath(lock_path))
    scope = Scope(base, allow)
    version, entries = _read(lock_path)
    late_message = str(_timed_out("checking it", timeout))  # (built once: a million late lines share it)

    def judged(item: tuple[int, LockEntry]) -> str | None:  # every line judged before any file is read
        n, entry = item
        return target(entry.path, scope, where=f"{lock_path}, line {n}", limits=limits)

    def left() -> float:
        return max(timeout - (time.monotonic() - start), 1e-3)

    wheres = _run_bounded(judged, list(enumerate(entries, start=2)), 1, left(), lambda _: None)
    targets = list(zip(entries, wheres, strict=True))

    def check(item: tuple[LockEntry, str | None]) -> CheckResult:
        entry, where = item
        if where is None:  # not judged within the timeout: not read either
            return CheckResult(entry, "unreadable", None, None, late_message)
        try:
            if storage.is_url(where):
                return _check_url(entry, version, wrap, limits, _no_redirects(where, storage_options))
            return _check_local(entry, where, version, wrap, limits)
        except Exception as e:  # noqa: BLE001 - one file's surprise must not stop the others' check
            return CheckResult(entry, "unreadable", None, None, f"{type(e).__name__}: {e}")

    def late(item: tuple[LockEntry, str | None]) -> CheckResult:
        return CheckResult(item[0], "unreadable", None, None, late_message)

    return _run_bounded(check, targets, max(1, workers), left(), late)


def _check_local(entry: LockEntry, path: str, version: int, wrap: Wrap | None, limits: Limits) -> CheckResult:
    """How the file at ``path`` compares with its lockfile entry."""
    if not os.path.exists(path):  # (a FIFO or a device is there: "unreadable", below)
        return CheckResult(entry, "missing", message="file not found")
    size = os.path.getsize(path) if os.path.isfile(path) else None
    try:
        size = _size(path, limits)
        found, _ = content_digest(path, wrap=wrap, limits=limits, format_version=FORMAT_OF[version])
    except (TensorCanonError, OSError) as e:
        status = "corrupt" if reader.is_damage(e) else "unreadable"
        return CheckResult(entry, status, None, size, str(e))
    return _compared(entry, found, size)


def _compared(entry: LockEntry, found: str, size: int | None) -> CheckResult:
    """The verdict on a file or object whose digest and size were read: ``ok`` or ``mismatch``."""
    problems = []
    if _digest.same_content(found, entry.digest) is not True:  # the one rule of equality (format/digest.py)
        problems.append(f"digest {found}, expected {entry.digest}")
    if size != entry.size:
        problems.append(f"size {size}, expected {entry.size}")
    return CheckResult(entry, "mismatch" if problems else "ok", found, size, "; ".join(problems))


def _no_redirects(url: str, storage_options: Any) -> Any:
    """The options to read a URL line with: an HTTP(S) server's redirect is refused (unreadable,
    naming where it pointed), not followed: it could lead to a host the scope does not allow."""
    if url.split("://", 1)[0].lower() not in ("http", "https"):
        return storage_options
    return {**dict(storage_options or {}), storage.REDIRECTS_OPTION: False}


def _check_url(entry: LockEntry, version: int, wrap: Wrap | None, limits: Limits,
               storage_options: Any) -> CheckResult:
    """How the object a lockfile entry names by its URL compares."""
    try:
        size = _size(entry.path, limits, storage_options)
    except MissingFileError:
        return CheckResult(entry, "missing", message="object not found")
    except (TensorCanonError, OSError) as e:
        return CheckResult(entry, "unreadable", None, None, str(e))
    try:
        found, _ = content_digest(entry.path, wrap=wrap, limits=limits, format_version=FORMAT_OF[version],
                                  storage_options=storage_options)
    except (TensorCanonError, OSError) as e:
        status = "corrupt" if reader.is_damage(e) else "unreadable"
        return CheckResult(entry, status, None, size, str(e))
    return _compared(entry, found, size)
