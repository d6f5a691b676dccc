"""``tensorcanon diverge --html``: one self-contained page, rendered in a real headless browser
(Debian's chromium, which .ci/run installs), whose marked cell is the first divergence."""

from __future__ import annotations

import html.parser
import re
import shutil
import subprocess

import pytest
from test_trace_file import D1, rec, write

from tensorcanon.tools.cli import main as cli


def _traces(tmp_path):
    a, b = tmp_path / "a.trace", tmp_path / "b.trace"
    records = [rec(s, name=n, call=0) for s in range(5) for n in ("aten.mm.default", "aten.add.Tensor")]
    records += [rec(s, kind="module", name=m) for s in range(5) for m in ("blocks.0", "blocks.1")]
    records.sort(key=lambda r: r.step)
    write(a, records)
    changed = [r._replace(digest=D1, sumsq=2.0) if (r.step, r.name) in ((2, "blocks.1"), (3, "blocks.0"),
                                                                         (4, "aten.mm.default")) else r
               for r in records]
    changed = [r._replace(dtype="float64") if (r.step, r.name) == (3, "aten.add.Tensor") else r  # an inf cell
               for r in changed]
    write(b, changed)
    return a, b


class _Refs(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.refs += [v for k, v in attrs if k in ("src", "href") and v]


def test_the_page_is_self_contained_and_marks_the_first_divergence_in_a_browser(tmp_path):
    a, b = _traces(tmp_path)
    page = tmp_path / "page.html"
    assert cli(["diverge", "--html", str(page), str(a), str(b)]) == 1
    text = page.read_text(encoding="utf-8")
    refs = _Refs()
    refs.feed(text)
    assert refs.refs == [] and "@import" not in text and "url(" not in text  # nothing fetched
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:  # (CI installs it, and there a skip fails the run: tests/conftest.py)
        pytest.skip("the page test needs a Chromium browser (Debian: apt-get install -y chromium; .ci/run installs it)")
    profile = tmp_path / "profile"
    dom = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--no-first-run", "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
         "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120).stdout
    body = re.search(r"<body([^>]*)>", dom)
    assert body, dom[:2000]
    attrs = dict(re.findall(r'data-([\w-]+)="([^"]*)"', body.group(1)))
    # the page's script ran in the browser, found the marked cell, and it is the first divergence
    assert attrs.get("first") == "2|blocks.1", attrs
    assert attrs.get("earliest-differing") == "2|blocks.1", attrs
    assert int(attrs["first-index"]) >= 0
    # the details beside the grid name the record
    assert "first divergence: step 2" in dom and "blocks.1" in dom
    # the legend: every swatch drawn, and each the colour the grid gives its distance
    legend = re.search(r'<ul id="legend"[^>]*>(.*?)</ul>', dom, re.S)
    assert legend, dom[:2000]
    swatches = re.findall(r'<li><span class="sw ?([a-z]*)"(?: style="background:\s*([^";]+);?")? '
                          r'data-d="([^"]*)"></span>([^<]+)</li>', legend.group(1))
    assert int(attrs["legend-shown"]) == len(swatches) == 8, swatches
    by_d = {d: colour for cls, colour, d, _ in swatches if colour}
    assert set(by_d) == {"0", "1e-09", "1e-06", "0.001", "1", "inf"}
    assert {cls for cls, *_ in swatches} == {"", "none", "first"}
    cells = re.findall(r'<td class="cell( first)?" style="background:\s*([^";]+);?"[^>]*data-d="([^"]*)"', dom)
    assert {d for _, _, d in cells} >= {"0", "inf", "0.293"}, cells
    for _, colour, d in cells:
        if d in by_d:  # equal cells white, cells of another path dark red, as the legend says
            assert colour == by_d[d], (d, colour, by_d)
    assert any("the runs recorded different things" in text for *_, text in swatches)


def test_the_page_is_never_written_onto_a_trace_being_compared(tmp_path, capsys):
    """OUT that is A or B by name, by symlink or by hard link: exit 2 before anything is written,
    the trace unchanged (docs/TRACE.md "Comparing")."""
    import os

    a, b = _traces(tmp_path)
    before = a.read_bytes()
    (tmp_path / "link").symlink_to(a)
    os.link(b, tmp_path / "hard")
    for out, trace in ((a, a), (tmp_path / "link", a), (tmp_path / "hard", b)):
        assert cli(["diverge", "--html", str(out), str(a), str(b)]) == 2
        err = capsys.readouterr().err
        assert f"cannot write the page to {out}: it is the trace {trace} being compared" in err
        assert "Traceback" not in err
    assert a.read_bytes() == before and (tmp_path / "hard").read_bytes() == b.read_bytes()


def test_the_page_is_written_whole_or_not_at_all(tmp_path, capsys):
    """A missing folder is an error naming it; an existing page is replaced whole, no temp file left."""
    a, b = _traces(tmp_path)
    assert cli(["diverge", "--html", str(tmp_path / "no" / "page.html"), str(a), str(b)]) == 2
    assert f"the folder {str(tmp_path / 'no')!r} does not exist" in capsys.readouterr().err
    page = tmp_path / "page.html"
    page.write_text("old")
    assert cli(["diverge", "--html", str(page), str(a), str(b)]) == 1
    assert page.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.trace", "b.trace", "page.html"]
