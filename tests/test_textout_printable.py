"""textout.printable: the one escaping of text that comes from files, for every text report.

A file controls keys, values, names and messages that quote them. Printed raw, an ESC starts a
terminal control sequence (colours, clearing the screen, moving the cursor), a CR returns to the
line's start and overwrites what was printed, a newline fakes a line of the report, and U+202E
(RIGHT-TO-LEFT OVERRIDE) shows text reversed. printable() shows each such character as the
escape Python's repr gives it, and leaves printable text of any script as it is.
"""

from __future__ import annotations

import inspect
import unicodedata

import pytest

from tensorcanon.tools import textout
from tensorcanon.tools.textout import printable

HOSTILE = {
    "ESC (a CSI sequence)": ("loss\x1b[2J\x1b[31m", "loss\\x1b[2J\\x1b[31m"),
    "CR": ("same: ok\rDIFF", "same: ok\\rDIFF"),
    "LF": ("a\nsame: $", "a\\nsame: $"),
    "tab": ("a\tb", "a\\tb"),
    "NUL": ("a\x00b", "a\\x00b"),
    "DEL": ("a\x7fb", "a\\x7fb"),
    "C1 CSI": ("a\x9b31mb", "a\\x9b31mb"),
    "bidi override U+202E": ("abc\u202edef", "abc\\u202edef"),
    "bidi isolate U+2066": ("\u2066x\u2069", "\\u2066x\\u2069"),
    "zero width space": ("a\u200bb", "a\\u200bb"),
    "line separator U+2028": ("a\u2028b", "a\\u2028b"),
    "no-break space": ("a\u00a0b", "a\\xa0b"),
    "a tag character (astral, format)": ("a\U000e0041", "a\\U000e0041"),
    "a file name byte that is not UTF-8": ("bad\udcffname", "bad\\xffname"),
}


def test_the_signature_other_modules_rely_on():
    sig = inspect.signature(printable)
    assert list(sig.parameters) == ["text"]
    assert sig.parameters["text"].annotation in ("str", str) and sig.return_annotation in ("str", str)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_control_and_format_characters_are_escaped(name):
    raw, shown = HOSTILE[name]
    assert printable(raw) == shown
    out = printable(raw)
    assert out.isprintable(), repr(out)  # nothing a terminal interprets is left


@pytest.mark.parametrize("text", ["plain", "$[\"model\"][\"fc.weight\"]", "é ü ß", "日本語", "emoji 😀", "a \\x1b b",
                                  "", "  spaces  "])
def test_printable_text_is_unchanged(text):
    assert printable(text) == text


def test_every_non_printable_code_point_of_the_first_planes_is_escaped():
    """Exhaustive over the BMP and the first astral plane: the output never holds a character a
    terminal would act on (categories Cc, Cf, Zl, Zp, and the blanks other than the space)."""
    for code in range(0x20000):
        ch = chr(code)
        if 0xD800 <= code <= 0xDFFF:
            continue  # (surrogates: file name bytes, tested above)
        out = printable(ch)
        if ch.isprintable():
            assert out == ch
        else:
            assert out.isprintable() and out.startswith("\\"), (hex(code), unicodedata.category(ch))
            assert not any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in out)


def test_for_stream_still_writes_what_an_ascii_stream_can():
    class Ascii:
        encoding = "ascii"

    assert textout.for_stream("é\udcff", Ascii()) == "\\xe9\\xff"
