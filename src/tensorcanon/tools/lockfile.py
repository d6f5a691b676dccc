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

import glob
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..format import digest as _digest, manifest
from ..format.errors import FormatError, IntegrityError, MissingFileError, TensorCanonError, UsageError
from ..format.limits import DEFAULT, Limits
from ..io import storage, writer

__all__ = ["HEADER", "VERSION", "LockEntry", "CheckResult", "content_digest", "collect",
           "make_lock", "format_lock", "parse_lock", "read_lock", "write_lock", "check_lock"]

VERSION = 2
HEADER = f"tensorcanon-lock {VERSION}"
#: Lockfile version -> the file-format version of the fingerprints it records.
FORMAT_OF = {1: 1, 2: 2}
#: Suffixes picked up when a folder is given to :func:`collect`.
SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".npz", ".npy")

Wrap = Callable[[Any, int], Any]


@dataclass(frozen=True)
class LockEntry:
    """One line of a lockfile."""

    path: str      # relative to the lockfile's folder, "/"-separated
    digest: str
    size: int

    def line(self) -> str:
        return f"{self.digest} {self.size} {self.path}"


@dataclass(frozen=True)
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
            matches = [m for m in glob.glob(pattern, recursive=True)
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
    if storage.is_url(path):  # an object in a store: its URL
        rel = path
        if any(c in rel for c in "\n\r") or rel != rel.strip(" "):
            raise FormatError(f"URL {rel!r} cannot be written in a lockfile (line break or edge spaces)")
        return rel
    rel = os.path.relpath(os.path.abspath(path), base).replace(os.sep, "/")
    if any(c in rel for c in "\n\r") or rel != rel.strip(" "):
        raise FormatError(f"path {rel!r} cannot be written in a lockfile (line break or edge spaces)")
    return rel


def make_lock(patterns: Iterable[str], lock_path: str | os.PathLike, *, wrap: Wrap | None = None,
              limits: Limits = DEFAULT, storage_options: Any = None) -> list[LockEntry]:
    """Hash every file the patterns name and return the lockfile's entries (not yet written).

    ``storage_options`` are used for patterns that are URLs (objects in a store)."""
    lock_path = os.fspath(lock_path)
    base = os.path.dirname(os.path.abspath(lock_path))
    entries = []
    for path in collect(patterns, exclude=lock_path, storage_options=storage_options):
        rel = _relative(path, base)
        options = storage_options if storage.is_url(path) else None
        try:
            d, _ = content_digest(path, wrap=wrap, limits=limits, storage_options=options)
            size = _size(path, limits, options) if storage.is_url(path) else None
        except TensorCanonError as e:  # a file that cannot be locked: say which
            raise FormatError(f"cannot lock {rel}: {e}") from e
        entries.append(LockEntry(rel, d, _size(path, limits) if size is None else size))
    return sorted(entries, key=lambda e: e.path.encode("utf-8"))


def format_lock(entries: Iterable[LockEntry]) -> str:
    """The lockfile text: header line, then entries sorted by path."""
    ordered = sorted(entries, key=lambda e: e.path.encode("utf-8"))
    return "".join(line + "\n" for line in [HEADER, *(e.line() for e in ordered)])


def write_lock(entries: Iterable[LockEntry], lock_path: str | os.PathLike) -> None:
    """Write the lockfile atomically (a temp file beside it, then a rename)."""
    lock_path = os.fspath(lock_path)
    text = format_lock(entries).encode("utf-8")
    writer.replace_atomically(lock_path, lambda f, tmp: f.write(text))


def parse_lock(text: str, where: str = "lockfile") -> list[LockEntry]:
    """Parse lockfile text. Raises :class:`FormatError` naming the line that is wrong."""
    return _parse(text, where)[1]


def _parse(text: str, where: str) -> tuple[int, list[LockEntry]]:
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    lines = [line[:-1] if line.endswith("\r") else line for line in lines]
    headers = {f"tensorcanon-lock {v}": v for v in FORMAT_OF}
    if not lines or lines[0] not in headers:
        first = lines[0][:40] if lines else ""
        if first.startswith("tensorcanon-lock "):
            raise FormatError(
                f"{where}: lockfile version {first.split(' ', 1)[1]!r} is not supported (this "
                f"tensorcanon reads versions {', '.join(map(str, FORMAT_OF))}); upgrade tensorcanon"
            )
        raise FormatError(f"{where}: not a tensorcanon lockfile: line 1 must be {HEADER!r}, found {first!r}")
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
        raw = fh.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{lock_path}: not UTF-8 text (byte {e.start})") from None
    return _parse(text, lock_path)


def check_lock(lock_path: str | os.PathLike, *, wrap: Wrap | None = None,
               limits: Limits = DEFAULT, storage_options: Any = None, workers: int = 1) -> list[CheckResult]:
    """Re-hash every file a lockfile lists; one :class:`CheckResult` per entry, in order.

    ``storage_options`` are used for the entries that are URLs (objects in a store). With
    ``workers`` > 1, that many files are hashed at once, on threads (reading and hashing release
    the GIL): the results are the same, in the same order."""
    lock_path = os.fspath(lock_path)
    base = os.path.dirname(os.path.abspath(lock_path))
    version, entries = _read(lock_path)

    def check(entry: LockEntry) -> CheckResult:
        if storage.is_url(entry.path) and storage.local_path(entry.path) is None:
            return _check_url(entry, version, wrap, limits, storage_options)
        return _check_local(entry, os.path.join(base, *entry.path.split("/")), version, wrap, limits)

    if workers <= 1 or len(entries) < 2:
        return [check(entry) for entry in entries]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(workers, len(entries)), thread_name_prefix="tensorcanon-check") as pool:
        return list(pool.map(check, entries))


def _check_local(entry: LockEntry, path: str, version: int, wrap: Wrap | None, limits: Limits) -> CheckResult:
    """How the file at ``path`` compares with its lockfile entry."""
    if not os.path.exists(path):  # (a FIFO or a device is there: "unreadable", below)
        return CheckResult(entry, "missing", message="file not found")
    size = os.path.getsize(path) if os.path.isfile(path) else None
    try:
        size = _size(path, limits)
        found, _ = content_digest(path, wrap=wrap, limits=limits, format_version=FORMAT_OF[version])
    except (TensorCanonError, OSError) as e:
        status = "corrupt" if isinstance(e, IntegrityError) else "unreadable"
        return CheckResult(entry, status, None, size, str(e))
    return _compared(entry, found, size)


def _compared(entry: LockEntry, found: str, size: int | None) -> CheckResult:
    """The verdict on a file or object whose digest and size were read: ``ok`` or ``mismatch``."""
    problems = []
    if found != entry.digest:
        problems.append(f"digest {found}, expected {entry.digest}")
    if size != entry.size:
        problems.append(f"size {size}, expected {entry.size}")
    return CheckResult(entry, "mismatch" if problems else "ok", found, size, "; ".join(problems))


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
        status = "corrupt" if isinstance(e, IntegrityError) else "unreadable"
        return CheckResult(entry, status, None, size, str(e))
    return _compared(entry, found, size)
