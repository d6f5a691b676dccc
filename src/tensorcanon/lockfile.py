"""``tensorcanon.lockfile``, the documented import path of :mod:`tensorcanon.tools.lockfile`."""

from .tools.lockfile import (
    HEADER,
    TIMEOUT,
    VERSION,
    CheckResult,
    LockEntry,
    Scope,
    check_lock,
    collect,
    content_digest,
    format_lock,
    make_lock,
    parse_lock,
    read_lock,
    target,
    write_lock,
)

__all__ = ["HEADER", "VERSION", "LockEntry", "CheckResult", "content_digest", "collect", "Scope", "target",
           "make_lock", "format_lock", "parse_lock", "read_lock", "write_lock", "check_lock", "TIMEOUT"]
