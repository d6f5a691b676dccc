"""Ranged reads that take from a store only what was asked, and the deadline on every request.

A store's answers are claims, as a file header's sizes are: :class:`storage.ObjectReader`
checks each answer's length against what it asked, and the functions here stop reading
an answer once it holds one byte more than asked, so an answer of 256 MiB to a read of
16 MiB costs 16 MiB and a byte, not 272 MiB, before it is refused. S3 (s3fs) and HTTP
(fsspec's http) are read that way, with the ``Content-Length`` of the answer checked
before its body is read; other filesystems' reads are checked once read.

Every request to a store whose filesystem is asynchronous (s3fs, http, gcsfs, adlfs: the
network ones) runs under one deadline, counted from when it is sent to the last byte of its
answer, the client's own retries included (:func:`deadline_of`): a store that stalls or
trickles (3 bytes a second never trips a per-read timeout) is stopped there.
"""

from __future__ import annotations

import errno
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from ..format.errors import FileAccessError, UsageError

__all__ = ["DEADLINE_S", "DEADLINE_OPTION", "DEADLINE_ENV", "deadline_of", "s3_range", "http_range"]

#: The default deadline of one request to a store, in seconds: from sending it to the last byte
#: of its answer (16 MiB for a ranged read: 56 KB/s at least), the client's retries included.
DEADLINE_S = 300.0
#: The storage option that sets it (taken out of the options before they go to fsspec) ...
DEADLINE_OPTION = "tensorcanon_deadline"
#: ... and the environment variable (for the command line), which the option overrides.
DEADLINE_ENV = "TENSORCANON_STORAGE_DEADLINE"


def deadline_of(options: Mapping[str, Any] | None) -> tuple[float, dict[str, Any]]:
    """``(deadline in seconds, the options without it)``: from ``options[DEADLINE_OPTION]``, else
    the environment variable :data:`DEADLINE_ENV`, else :data:`DEADLINE_S`."""
    rest = dict(options or {})
    given: Any = rest.pop(DEADLINE_OPTION, None)
    where = f"storage_options[{DEADLINE_OPTION!r}]"
    if given is None and os.environ.get(DEADLINE_ENV, "").strip():
        given, where = os.environ[DEADLINE_ENV].strip(), f"the environment variable {DEADLINE_ENV}"
    if given is None:
        return DEADLINE_S, rest
    try:
        seconds = float(given)
        ok = not isinstance(given, bool) and math.isfinite(seconds) and seconds > 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise UsageError(f"{where} must be a number of seconds above 0 (the deadline of one request to the "
                         f"store), not {given!r}")
    return seconds, rest


def late(doing: str, url: str, deadline: float, what: str = "") -> FileAccessError:
    """The error for a request that did not finish within the deadline."""
    return FileAccessError(
        f"cannot {doing} {url!r}: the store did not finish answering within the deadline of {deadline:g} s "
        f"for one request{what} (a store that stalls, or sends its answer too slowly, is stopped there). "
        f"If the store is only slow, raise the deadline: storage_options={{{DEADLINE_OPTION!r}: SECONDS}}, "
        f"or the environment variable {DEADLINE_ENV}=SECONDS (the command line)", filename=url,
        errno=errno.ETIMEDOUT)


def wrong_length(url: str, start: int, end: int, got: int | str) -> FileAccessError:
    return FileAccessError(
        f"cannot read {url!r}: the store answered a read of bytes {start} to {end - 1} ({end - start} bytes) "
        f"with {got} bytes; tensorcanon takes only what it asked for (a store, proxy or cache that answers "
        "otherwise is misbehaving)", filename=url)


_CONTENT_RANGE = re.compile(r"bytes\s+(\d{1,20})-(\d{1,20})/")


def check_range(url: str, start: int, end: int, content_range: Any) -> None:
    """An answer's ``Content-Range`` (when it has one) must start where the read asked and not
    go past its end: bytes from elsewhere in the object are refused before they are read."""
    if not isinstance(content_range, str):
        return
    m = _CONTENT_RANGE.match(content_range.strip())
    if m is None or int(m.group(1)) != start or int(m.group(2)) > end - 1:
        raise FileAccessError(
            f"cannot read {url!r}: the store answered a read of bytes {start} to {end - 1} with the range "
            f"{content_range[:60]!r}; tensorcanon takes only what it asked for (a store, proxy or cache that "
            "answers otherwise is misbehaving)", filename=url)


async def _at_most(read: Callable[[int], Any], n: int) -> bytes:
    """What ``await read(k)`` gives until it ends, but never more than ``n + 1`` bytes (one more
    than asked: enough to know the answer is too long)."""
    buf = bytearray()
    while len(buf) <= n:
        chunk = await read(n + 1 - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


async def s3_range(fs: Any, url: str, bucket: str, key: str, start: int, end: int, *,
                   version_id: str | None = None, etag: str | None = None) -> bytes:
    """Bytes ``[start, end)`` of an S3 object, of the version ``etag`` names (``If-Match``, as s3fs
    reads): its answer's ``Content-Length`` checked before its body is read, and at most one byte
    more than asked read of the body."""
    kw: dict[str, Any] = {"Range": f"bytes={start}-{end - 1}"}
    if etag and not getattr(fs, "local_expiry_check", False):
        kw["IfMatch"] = etag
    if version_id:
        kw["VersionId"] = version_id
    try:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, **kw)
    except OSError as e:  # s3fs's InvalidRange (416): the range starts past the object's end
        if e.errno == errno.EINVAL and "range" in str(e).lower() and "pre-condition" not in str(e):
            return b""
        raise
    body = resp["Body"]
    try:
        length = resp.get("ContentLength")
        if isinstance(length, int) and length > end - start:  # (fewer: ObjectReader.fetch says what ended)
            raise wrong_length(url, start, end, length)
        check_range(url, start, end, resp.get("ContentRange"))
        if etag and getattr(fs, "local_expiry_check", False) and resp.get("ETag") != etag:
            raise FileAccessError(f"cannot read {url!r}: the object was replaced while it was being read (its "
                                  "ETag changed between two ranged reads); read it again", filename=url)
        return await _at_most(body.read, end - start)
    finally:
        body.close()


async def http_range(fs: Any, url: str, start: int, end: int, size: int) -> bytes:
    """Bytes ``[start, end)`` of an HTTP(S) object by a ranged GET: a ``206`` answer (or a ``200``
    holding the whole object, when the whole object was asked), its ``Content-Length`` checked
    before its body is read, and at most one byte more than asked read of the body."""
    kwargs = dict(getattr(fs, "kwargs", None) or {})
    headers = dict(kwargs.pop("headers", None) or {})
    headers["Range"] = f"bytes={start}-{end - 1}"
    headers.setdefault("Accept-Encoding", "identity")  # the object's own bytes: Content-Length counts them
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), headers=headers, **kwargs) as r:
        if r.status == 416:  # the range starts past the end: the object is shorter than it was said to be
            return b""
        fs._raise_not_found_for_status(r, url)
        if r.status != 206 and not (r.status == 200 and start == 0 and end == size):
            raise FileAccessError(
                f"cannot read {url!r}: the server answered a ranged read with HTTP {r.status}, not 206 (partial "
                "content): it does not serve byte ranges, which reading a tensorcanon file from it needs; "
                "download it and read the local file", filename=url)
        if r.status == 206:
            check_range(url, start, end, r.headers.get("Content-Range"))
        length = r.headers.get("Content-Length")
        if length is not None:
            text = length.strip()
            n = int(text) if text.isdigit() and len(text) <= 20 else -1  # (a header of 5,000 digits: no int)
            if n < 0 or n > end - start:  # (fewer: ObjectReader.fetch says what ended)
                raise wrong_length(url, start, end, n if n >= 0 else repr(text[:30]))
        return await _at_most(r.content.read, end - start)
