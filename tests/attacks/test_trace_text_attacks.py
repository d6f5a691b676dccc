"""Attacks on diverge's reports through the texts of a trace (docs/SECURITY.md "The command line"):
names, notes and argument texts holding terminal controls (ESC, CR, a C1 CSI, U+202E, a line
separator, NUL) and markup are printed as escapes, so a hostile trace cannot erase a line, move
the cursor or print a fake ``same:`` line, nor inject markup into ``diverge --html``'s page."""

from __future__ import annotations

import re

import msgpack

from tensorcanon import first_divergence
from tensorcanon.tools.cli import main as cli
from tensorcanon.trace import layout
from tensorcanon.trace.layout import Record

D0, D1 = bytes(16), bytes(range(16))


def rec(scope: str, name: str, role: str = "out", digest: bytes = D0) -> Record:
    return Record(0, "forward", "op", scope, name, 0, role, "float32", (2, 3), digest, 1.0, "")


def text(scope: str, name: str, note: str) -> Record:
    return Record(0, "forward", "op", scope, name, 0, "args", "text", (), layout.text_digest(note, "xxh3-128"),
                  0.0, note)


def write(path, records, end: bool = True) -> None:
    with open(path, "wb") as fh:
        fh.write(layout.MAGIC)
        w = layout.Writer(fh)
        w.frame(msgpack.packb(layout.Header("ops", "xxh3-128", 0, 1).payload()))
        for r in records:
            w.record(r)
        if end:
            w.end()


_HOSTILE = "w\x1b[2K\rsame: 99 records compared, all equal\x9b31m\u202etxt.exe\u2028x\x00"


def test_control_characters_from_a_trace_never_reach_the_terminal(tmp_path, capsys):
    """A trace whose names hold ESC, CR, CSI (C1), U+202E, a line separator, NUL: diverge's report
    prints them as escapes (a fake "same:" line cannot be printed), in every line that names them."""
    a = [rec(_HOSTILE, _HOSTILE, role="in.0"), text(_HOSTILE, _HOSTILE, note=_HOSTILE),
         rec(_HOSTILE, _HOSTILE, role=_HOSTILE)]
    b = [a[0], a[1], a[2]._replace(digest=D1)]
    x, y = tmp_path / "a\x1b]0;title\x07.trace", tmp_path / "b.trace"
    write(x, a, end=False)  # (a crashed run's trace: the note names its path)
    write(y, b)
    assert cli(["diverge", str(x), str(y)]) == 1
    out = capsys.readouterr().out
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202e\u2028]", out), repr(out)
    assert "\\x1b[2K\\rsame: 99 records compared" in out and "\\u202etxt.exe\\u2028x\\x00" in out
    assert not any(line.startswith("same:") for line in out.splitlines())
    assert out.splitlines()[0].startswith("first divergence: step 0, phase forward, op w\\x1b[2K\\rsame: ")
    assert "\\x1b]0;title\\x07.trace" in out  # the path given too
    # the report's lines from the API, the same
    for line in first_divergence(x, y).lines():
        assert line.isprintable(), repr(line)


def test_names_from_a_trace_are_escaped_on_the_html_page(tmp_path):
    evil = "<script>alert(1)</script>\x1b[31m\u202e"
    a = [rec(evil, "aten.mm.default", role="in.0"), rec(evil, "aten.mm.default")]
    x, y = tmp_path / "a.trace", tmp_path / "b.trace"
    write(x, a)
    write(y, [a[0], a[1]._replace(digest=D1)])
    page = tmp_path / "page.html"
    assert cli(["diverge", "--html", str(page), str(x), str(y)]) == 1
    html_text = page.read_text(encoding="utf-8")
    assert "<script>alert" not in html_text and "&lt;script&gt;alert(1)&lt;/script&gt;\\x1b[31m\\u202e" in html_text
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202e]", html_text)
    assert html_text.count("<script>") == 1  # the page's own


def test_the_capture_line_quotes_a_name_for_the_shell(tmp_path, capsys):
    """The report's "rerun both runs with TENSORCANON_TRACE_CAPTURE='...'" line, pasted into a shell,
    sets the variable to the spec and runs nothing else, whatever quotes the module's name holds."""
    import os
    import subprocess

    evil = "x'; touch pwned; echo '"
    a = [rec("", evil, role="in.0"), rec("", evil)]
    a = [r._replace(kind="module") for r in a]
    x, y = tmp_path / "a.trace", tmp_path / "b.trace"
    write(x, a)
    write(y, [a[0], a[1]._replace(digest=D1)])
    assert cli(["diverge", str(x), str(y)]) == 1
    line = next(line for line in capsys.readouterr().out.splitlines() if "to see the tensors" in line)
    assignment = line.split("rerun both runs with ", 1)[1].split(" (or ", 1)[0]
    proc = subprocess.run(["bash", "-c", f'{assignment}; printf %s "$TENSORCANON_TRACE_CAPTURE"'], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"]})
    assert proc.stdout == f"0|module||{evil}|0" and not (tmp_path / "pwned").exists()


def test_json_reports_write_terminal_controls_as_json_escapes(tmp_path, capsys):
    """``diverge --json`` (and every command's --json, through one writer): the C1 controls, DEL and
    the bidi overrides and isolates a trace's names hold are written as JSON escapes (``\\u202e``), as
    ``inspect --json`` writes them, so the JSON shown on a terminal cannot reorder or recolour it;
    parsed, it holds the same strings."""
    import json

    a = [rec(_HOSTILE, _HOSTILE, role="in.0"), rec(_HOSTILE, _HOSTILE)]
    x, y = tmp_path / "a\u202e.trace", tmp_path / "b.trace"
    write(x, a)
    write(y, [a[0], a[1]._replace(digest=D1)])
    assert cli(["diverge", "--json", str(x), str(y)]) == 1
    out = capsys.readouterr().out
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", out), repr(out)
    assert "\\u202etxt.exe\\u2028x" in out and "\\u009b31m" in out
    got = json.loads(out)
    assert got["first"]["name"] == _HOSTILE and got["a"] == str(x)  # (the same strings, parsed)
    assert not re.search(r"[\u2028\u2029]", out)  # (line separators too, as every report escapes them)
    marks = [rec("\u200f\u061c\xa0x", "y\u200e", role="in.0"), rec("\u200f\u061c\xa0x", "y\u200e")]
    write(x, marks)
    write(y, [marks[0], marks[1]._replace(digest=D1)])
    assert cli(["diverge", "--json", str(x), str(y)]) == 1
    out = capsys.readouterr().out
    assert all(line.isprintable() for line in out.split("\n")), repr(out)  # (bidi marks, no-break spaces)
    assert json.loads(out)["first"]["scope"] == "\u200f\u061c\xa0x"
