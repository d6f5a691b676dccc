"""Text the command line prints: file names that are not UTF-8 escaped one way everywhere, a file's
control characters escaped, tables, a terminal's width (``inspect`` fits its table to it:
tools/inspectview.py)."""

from __future__ import annotations

import os
import re
import shutil
from typing import Any, TextIO

__all__ = ["escaped", "printable", "encodable", "CONTROLS", "utf8", "table", "terminal_width"]


def escaped(text: str) -> str:
    """``text`` as valid UTF-8: the bytes of a file name that are not UTF-8 (which Python holds as
    surrogate escapes, ``\\udcff``) become ``\\xff``, the same escape everywhere (stdout, stderr,
    JSON)."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that no file name decodes to
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
"""The characters of a file's strings that a report never prints as they are: C0 and C1 controls
and DEL (an ESC starts a terminal's control sequences, a CR rewrites the line), and the Unicode
bidi overrides and isolates (U+202E shows the text after it reversed)."""
_UNSAFE = re.compile(r"[\\\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match[str]) -> str:
    n = ord(m.group())
    return "\\\\" if n == 0x5C else f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}"


def printable(text: str) -> str:
    """A string read from a file (a key, a value, metadata) as a text report prints it: each
    character of :data:`CONTROLS` escaped (ESC as ``\\x1b``, CR as ``\\x0d``, U+202E as
    ``\\u202e``) and a backslash doubled, so that a file cannot move the cursor, clear the screen,
    rewrite a line or reverse text, and every backslash printed starts an escape."""
    return _UNSAFE.sub(_escape, text)


def encodable(text: str, stream: Any) -> str:
    """``text`` as ``stream`` can write it: escaped as :func:`escaped` does, and characters its
    encoding lacks (an ASCII terminal's) as backslash escapes, never a UnicodeEncodeError."""
    text = escaped(text)
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        text = text.encode(encoding, "backslashreplace").decode(encoding)
    except LookupError:
        pass
    return text


def utf8(v: Any) -> Any:
    """A JSON-ready object with every string :func:`escaped` (keys included)."""
    if isinstance(v, str):
        return escaped(v)
    if isinstance(v, dict):
        return {(escaped(k) if isinstance(k, str) else k): utf8(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [utf8(x) for x in v]
    return v


def table(rows: list[list[str]], right: set[int] | frozenset[int] = frozenset()) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        out.append("  ".join(cells).rstrip())
    return out


def terminal_width(stream: TextIO) -> int | None:
    """The width to fit a table to: the terminal's (or $COLUMNS), None when writing to a file or pipe."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        if not stream.isatty():
            return None
    except (AttributeError, ValueError):
        return None
    return shutil.get_terminal_size().columns
