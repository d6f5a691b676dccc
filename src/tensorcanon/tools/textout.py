"""Text the command line prints: file names that are not UTF-8 escaped one way everywhere, and
tables that fit a terminal's width (``inspect``)."""

from __future__ import annotations

import os
import shutil
from typing import Any, TextIO

from ..format import digest, text as format_text

__all__ = ["escaped", "printable", "message", "utf8", "table", "fit_table", "terminal_width"]


def escaped(text: str) -> str:
    """``text`` as valid UTF-8: the bytes of a file name that are not UTF-8 (which Python holds as
    surrogate escapes, ``\\udcff``) become ``\\xff``, the same escape everywhere (stdout, stderr,
    JSON)."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that no file name decodes to
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def printable(text: str, stream: Any) -> str:
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


def message(text: str, stream: Any) -> str:
    """An error or warning line for ``stream``: as :func:`printable`, and within each of its lines
    every control or format character (ESC, CR, a CSI, U+202E...) escaped (``format/text.printable``):
    a message quotes paths and names from files, which must not move the cursor, erase a line or
    print a line of their own. The message's own line breaks are kept."""
    return printable("\n".join(format_text.printable(line) for line in text.split("\n")), stream)


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


def _fit(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters by an ellipsis in its middle (both ends stay readable)."""
    if len(text) <= width:
        return text
    keep = max(width - 3, 2)
    head = (keep + 1) // 2
    return text[:head] + "..." + text[len(text) - (keep - head):]


_TYPE_ROOM, _SHAPE_ROOM, _PATH_MIN, _LAST_MIN = 16, 16, 16, len("DIGEST / VALUE")


def fit_table(rows: list[list[str]], width: int) -> tuple[list[list[str]], set[int], str | None]:
    """Cut the cells of inspect's table (header first) so that its lines fit ``width`` columns.

    TYPE keeps the last part of a dotted name (``AttributeDict``, not its module), SHAPE is cut
    in the middle; PATH gets the room left, before DIGEST / VALUE, and is cut keeping its tail (the
    informative end: ``$["sta...layers.0.weight"]``); a digest that does not fit loses its algorithm
    prefix, then its end (``ffde60cb...``), a value its end; a DEVICE column that holds one device
    only is left out (``(rows, right-aligned columns, note)``: the note names that device). When
    even the shortest cells do not fit, lines are as short as they can be."""
    body = rows[1:]
    for cells in body:
        cells[1] = _fit(cells[1].rsplit(".", 1)[-1], _TYPE_ROOM)
        cells[3] = _fit(cells[3], _SHAPE_ROOM)
    fixed = sum(max(len(r[i]) for r in rows) for i in range(1, 6))
    room = width - fixed - 2 * (len(rows[0]) - 1)  # for PATH and DIGEST / VALUE
    path_w = max(len(r[0]) for r in rows)
    last_w = max(len(r[6]) for r in rows)
    if path_w + last_w <= room:
        return rows, {5}, None
    devices = {r[4] for r in body} - {""}
    note = None
    if len(devices) <= 1:  # one device for every tensor: said once, above the table, not on each row
        note = f"every tensor on {next(iter(devices))}" if devices else None
        rows = [r[:4] + r[5:] for r in rows]
        room += len("DEVICE") + 2
    path_room = max(min(path_w, room - min(last_w, _LAST_MIN)), min(path_w, _PATH_MIN))
    last_room = max(room - path_room, _LAST_MIN)
    for cells in rows[1:]:
        cells[0] = _keep_tail(cells[0], path_room)
        cells[-1] = _clip_value(cells[-1], last_room)
    return rows, {len(rows[0]) - 2}, note


def _keep_tail(text: str, width: int) -> str:
    """``text`` in ``width`` characters: a short head, ``...``, and as much of its end as fits."""
    if len(text) <= width:
        return text
    head = min(max(width // 5, 2), 8)
    tail = max(width - head - 3, 1)
    return text[:head] + "..." + text[len(text) - tail:]


def _clip_value(text: str, width: int) -> str:
    """The DIGEST / VALUE cell in ``width`` characters (a digest first loses its ``xxh3-128:``)."""
    if len(text) <= width:
        return text
    algorithm, colon, rest = text.partition(":")
    if colon and algorithm in digest.ALGORITHMS:
        text = rest
    return text if len(text) <= width else text[: max(width - 3, 1)] + "..."


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
