"""Text the command line prints: file names that are not UTF-8 escaped one way everywhere, text
from files made safe for a terminal (:func:`printable`), and tables that fit a terminal's width
(``inspect``)."""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, TextIO

from ..format.text import printable  # the one rule for text from files (format/text.py)

__all__ = ["escaped", "printable", "terminal_safe", "for_stream", "message", "CONTROLS", "json_escape", "json_safe",
           "json_escaped", "json_for_stream", "json_text", "around", "plural", "utf8", "table", "terminal_width"]

CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u2028\u2029]")
"""C0 and C1 controls, DEL, the bidi overrides and isolates and the line separators: the characters
no output of the command line holds as they are (:func:`json_escaped` escapes these and every other
character :func:`printable` escapes)."""


def json_escape(m: re.Match[str]) -> str:
    """The JSON escape of the one character ``m`` matched (``\\u202e``)."""
    return f"\\u{ord(m.group()):04x}"


def _json_escapes(ch: str) -> str:
    n = ord(ch)
    if n > 0xFFFF:  # JSON escapes a character beyond the BMP as its UTF-16 surrogate pair
        n -= 0x10000
        return f"\\u{0xD800 + (n >> 10):04x}\\u{0xDC00 + (n & 0x3FF):04x}"
    return f"\\u{n:04x}"


def json_escaped(text: str) -> str:
    """Text already in JSON's syntax (a path's keys, ``$["a\\u001b"]``) with every character
    :func:`printable` escapes (what ``str.isprintable`` calls unprintable: controls, bidi and other
    format characters, the line separators U+2028 and U+2029, a lone surrogate) written as a JSON
    escape, ``\\u2028``: the same JSON, safe on a terminal (``inspect``'s paths)."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _json_escapes(ch) for ch in text)


def json_safe(text: str) -> str:
    """JSON text (``json.dumps(ensure_ascii=False)`` escapes only C0 controls in strings) with every
    character :func:`printable` escapes but the newlines between values (C1 controls, DEL, bidi
    overrides, isolates and marks, the line separators U+2028 and U+2029, other format characters)
    written as a JSON escape (:func:`json_escaped`, line by line): the same JSON value, which a
    terminal it is shown on cannot reorder, recolour or break into lines (every ``--json`` of the
    command line: :func:`json_text`, and ``inspect --json``, written as it walks)."""
    return "\n".join(line if line.isprintable() else json_escaped(line) for line in text.split("\n"))


def json_text(obj: Any) -> str:
    """``obj`` as the JSON a ``--json`` prints: indented, file names that are not UTF-8 escaped
    (:func:`utf8`), no NaN, and :func:`json_safe`."""
    return json_safe(json.dumps(utf8(obj), indent=2, ensure_ascii=False, allow_nan=False))


def escaped(text: str) -> str:
    """``text`` as valid UTF-8: the bytes of a file name that are not UTF-8 (which Python holds as
    surrogate escapes, ``\\udcff``) become ``\\xff``, the same escape everywhere (stdout, stderr,
    JSON)."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that no file name decodes to
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def terminal_safe(text: str) -> str:
    """:func:`printable` for a message (the command line's error and warning lines): the same rule, one
    home (format/text.py)."""
    return printable(text)


def for_stream(text: str, stream: Any) -> str:
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


def json_for_stream(text: str, stream: Any) -> str:
    """JSON text as ``stream`` can write it and stay JSON: a character its encoding lacks (an ASCII
    stdout's ``é``) or a lone surrogate is written as a JSON escape (``\\u00e9``), where
    :func:`for_stream`'s ``\\xe9`` would make the JSON invalid."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
        return text
    except LookupError:
        encoding = "utf-8"
    except UnicodeEncodeError:
        pass

    def fits(ch: str) -> bool:
        try:
            ch.encode(encoding)
        except (UnicodeEncodeError, LookupError):
            return False
        return True

    return "".join(ch if fits(ch) else _json_escapes(ch) for ch in text)


def around(ra: str, rb: str, limit: int) -> tuple[str, str]:
    """Two texts that differ, each cut to about ``limit`` characters (and ``...`` where cut) around the
    first character where they differ, so that the difference stays visible on both sides (``diff``)."""
    if len(ra) <= limit and len(rb) <= limit:
        return ra, rb
    same = 0
    for x, y in zip(ra, rb, strict=False):
        if x != y:
            break
        same += 1
    start = max(0, min(same - limit // 3, max(len(ra), len(rb)) - limit))

    def cut(text: str) -> str:
        if len(text) <= limit and start == 0:
            return text
        piece = text[start:start + limit]
        return ("..." if start else "") + piece + ("..." if start + limit < len(text) else "")

    return cut(ra), cut(rb)


def plural(n: int, noun: str, many: str | None = None) -> str:
    """``1 file``, ``2 files``, ``12,345 files`` (``many``: a plural that is not ``noun + "s"``)."""
    return f"{n:,} {noun if n == 1 else many or noun + 's'}"


def message(text: str, stream: Any) -> str:
    """An error or warning line, or a line of a text report, for ``stream``: within each of its lines every character
    :func:`printable` escapes (ESC, CR, a CSI, U+202E...) escaped, then as :func:`for_stream` writes
    it: a message quotes paths and names from files, which must not move the cursor, erase a line or
    print a line of their own. The message's own line breaks are kept."""
    return for_stream("\n".join(printable(line) for line in text.split("\n")), stream)


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
