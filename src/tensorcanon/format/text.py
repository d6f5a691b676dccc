"""Text from a file, made safe to show on a terminal or a page: :func:`printable`.

A name, note or path read from a file may hold characters a terminal acts on instead of showing:
ESC (``\\x1b[2K`` erases the line), CR (``\\r`` moves back to its start, so the next text
overwrites what was printed), the C1 controls (``\\x9b`` is a CSI on some terminals), and the
Unicode format characters that reorder what follows (U+202E RIGHT-TO-LEFT OVERRIDE). A report
that prints such a string raw lets the file print what it likes (a fake ``same:`` line).
:func:`printable` writes each of them as a visible escape instead. It lives in the lowest layer
so that every layer's reports use the one rule (tools/textout.py for the command line; the
trace reports of trace/compare.py and trace/page.py, which may not import tools/).
"""

from __future__ import annotations

__all__ = ["printable"]

# Escaped: every character str.isprintable() calls unprintable: Cc (C0 and C1 controls, DEL), Cf
# (format characters: bidirectional overrides and isolates, zero-width characters, the soft hyphen),
# Zl and Zp (line and paragraph separators), Zs but the space (a no-break space looks like one), Cs
# (a lone surrogate: a file name's byte that is not UTF-8, as Python's surrogateescape holds it), Co
# (private use) and Cn (not assigned yet: a later Unicode may make it a format character).
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    n = ord(ch)
    if ch in _SHORT:
        return _SHORT[ch]
    if 0xDC80 <= n <= 0xDCFF:  # surrogateescape's stand-in for the byte n - 0xDC00
        return f"\\x{n - 0xDC00:02x}"
    if n <= 0xFF:
        return f"\\x{n:02x}"
    if n <= 0xFFFF:
        return f"\\u{n:04x}"
    return f"\\U{n:08x}"


def printable(text: str) -> str:
    """``text`` with every character a terminal or a text renderer could act on written as a
    visible escape: ``\\x1b``, ``\\r``, ``\\n``, ``\\t``, ``\\x9b``, ``\\u202e``, ``\\u2028``; a byte of a
    file name that is not UTF-8 (surrogateescape's ``\\udcff``) as ``\\xff``. Everything else,
    backslashes and every printable letter of any script included, is kept as it is, so an
    ordinary name prints unchanged. The result holds no control or format character."""
    if text.isprintable():  # the common case: nothing to escape
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)
