"""What ``tensorcanon diff`` prints: a :class:`~tensorcanon.tools.diff.DiffResult` as lines a person
reads (docs/CLI.md, "diff").

Each difference is one line where it fits the width: the terminal's (``$COLUMNS``), or
:data:`PIPED_WIDTH` columns when the output is a file or a pipe. A line that does not fit keeps
what matters: the two values are cut around the place where they first differ (so both sides
never show the same text), a long path keeps its end (the key that names the value), and what
is still too long (a tensor's statistics) continues on indented lines rather than being cut.
Every piece of text that comes from a file goes through :func:`textout.printable` (no terminal
control character, newline or bidi override reaches the terminal). The JSON (``--json``) is the
result's ``to_dict()`` as it is.
"""

from __future__ import annotations

import textwrap
from typing import Any

from .diff import Difference, DiffResult, plural
from .textout import around, printable, terminal_width

__all__ = ["PIPED_WIDTH", "width", "fit", "lines", "show"]

PIPED_WIDTH = 120
"""The width of the lines written to a file or a pipe (a terminal's own width otherwise)."""
MIN_WIDTH = 40
CONTINUED = "    "  # the indent of a line that continues a difference
_PATH_ROOM = 3  # a long path keeps at most 1/_PATH_ROOM of the line (and at least _PATH_MIN columns)
_PATH_MIN = 24
_SIDE_MIN = 12  # each value keeps at least this many columns


def width(stream: Any) -> int:
    """The columns to fit lines to: the terminal's (or ``$COLUMNS``), else :data:`PIPED_WIDTH`."""
    columns = terminal_width(stream)
    return PIPED_WIDTH if columns is None else max(columns, MIN_WIDTH)


def _keep_tail(text: str, room: int) -> str:
    """``text`` in ``room`` characters: its first characters, ``...``, and as much of its end as fits."""
    if len(text) <= room:
        return text
    head = min(max(room // 5, 2), 8)
    return text[:head] + "..." + text[len(text) - max(room - head - 3, 1):]


def _pair(d: Difference) -> tuple[str, str, str, bool] | None:
    """``(text before the values, a, b, one side only)`` of a difference that shows two values (or
    one: added, removed), all printable; None for the others (statistics, ties, random states)."""
    if d.kind == "added" and d.b is not None:
        return "added in B: ", "", printable(d.b), True
    if d.kind == "removed" and d.a is not None:
        return "only in A: ", printable(d.a), "", True
    if d.kind == "items" and d.first is not None:
        leaf = d.innermost()
        where = f"{d.count} of {d.total} items differ; first at {printable(leaf.path[len(d.path):]) or '(here)'}: "
        if leaf.kind == "value" and leaf.a is not None and leaf.b is not None:
            return where, printable(leaf.a), printable(leaf.b), False
        inner = _pair(leaf)
        return None if inner is None else (where + inner[0], *inner[1:])
    if d.kind in ("values", "alias", "rng", "digest", "items") or d.a is None or d.b is None:
        return None
    return f"{d.kind} ", printable(d.a), printable(d.b), False


def fit(d: Difference, columns: int, indent: str = "") -> list[str]:
    """The lines of one difference in ``columns`` columns: one where it fits (its two values cut
    around where they differ, then its path shortened to its end if need be), else the whole
    difference continued on indented lines."""
    full = printable(d.path)
    line = f"{indent}{full}: {printable(d.body())}"
    if len(line) <= columns:
        return [line]
    short = _keep_tail(full, max(columns // _PATH_ROOM, _PATH_MIN))
    pair = _pair(d)
    if pair is not None:
        for path in dict.fromkeys((full, short)):  # (the whole path first)
            line = _paired(indent, path, pair, columns)
            if len(line) <= columns:
                return [line]
        line = _paired(indent, full if len(full) + len(indent) < columns // 2 else short, pair, columns)
    else:
        line = f"{indent}{full if len(full) + len(indent) < columns // 2 else short}: {printable(d.body())}"
    return wrap(line, columns, indent + CONTINUED)


def _paired(indent: str, path: str, pair: tuple[str, str, str, bool], columns: int) -> str:
    """A difference of two values (or one) on one line, the values cut to the room left."""
    before, a, b, one = pair
    head = f"{indent}{path}: {before}"
    room = columns - len(head) - (0 if one else len(" -> "))
    if one:
        return head + _clip(a or b, max(room, _SIDE_MIN))
    a, b = around(a, b, max(room // 2 - 6, _SIDE_MIN))
    return f"{head}{a} -> {b}"


def _clip(text: str, room: int) -> str:
    return text if len(text) <= room else text[: max(room - 3, 1)] + "..."


def wrap(line: str, columns: int, indent: str = CONTINUED) -> list[str]:
    """``line`` on as many lines as it takes, broken after its clauses (``; ``) where it can, the
    lines after the first indented: a tensor's statistics stay whole and readable."""
    out: list[str] = []
    current = ""
    for clause in line.split("; "):
        piece = clause if not current else f"{current}; {clause}"
        if len(piece) <= columns or not current:
            current = piece
            continue
        out.append(current + ";")
        current = indent + clause
    out.append(current)
    fitted: list[str] = []
    for text in out:  # a clause longer than the line itself: broken between words
        fitted += [text] if len(text) <= columns else textwrap.wrap(
            text, columns, subsequent_indent=indent, break_on_hyphens=False)
    return fitted


def lines(result: DiffResult, columns: int, indent: str = "", limit: int | None = None,
          skip: Difference | None = None) -> list[str]:
    """The differences of ``result`` (all, or the first ``limit``, without ``skip``), then its notes
    (what differs outside the content: devices), each fitted to ``columns``."""
    shown = [d for d in result.differences if d is not skip]
    rest = 0
    if limit is not None and len(shown) > limit:
        shown, rest = shown[:limit], len(shown) - limit
    out = [line for d in shown for line in fit(d, columns, indent)]
    if rest:
        out.append(f"{indent}... and {plural(rest, 'more difference', 'more differences')}")
    for note in result.notes:
        out += fit(Difference(note.path, note.kind, note.a, f"{note.b} (placement: the digest does not cover it)"),
                   columns, indent)
    return out


def show(result: DiffResult, formats: list[str], names: list[str], out: Any) -> None:
    """``tensorcanon diff``'s report on ``out`` (the command line's writer): the JSON document with
    ``--json``, else the files compared, one line per difference and the summary."""
    data = result.to_dict()
    data["formats"] = formats
    out.json(data)
    columns = width(out.stdout)
    for side, name, fmt in zip("AB", names, formats, strict=True):
        out.line(_keep_tail(f"{side}: {printable(name)} ({fmt})", columns))
    for line in lines(result, columns):
        out.line(line)
    for line in wrap(printable(result.summary()), columns):
        out.line(line)
