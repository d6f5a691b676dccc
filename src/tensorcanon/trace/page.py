"""``diverge --html OUT``: one self-contained page (no fetches): steps x modules, coloured by distance.

Each cell is the largest distance (compare.distance) of the records of one step and one grid
column (compare.column): white equal, yellow to red as the relative difference of the norms
grows, dark red where no norm measures the difference (another dtype or shape, a record that is
not a float, a sum of squares that is not finite, or the two runs recorded different things); a
legend above the grid says which colour is which. The first divergence's cell is marked, and its
record's details are beside the grid. Every name from the traces is shown escaped
(format/text.printable, then HTML-escaped). A small script (inline) finds the marked
cell and reports it in the page's ``data-first`` attribute (and how many legend swatches it
drew in ``data-legend-shown``), and shows a cell's details on a click.
"""

from __future__ import annotations

import html
import json
import math
import os

from ..format.text import printable
from ..io.writer import replace_atomically
from .compare import Divergence, column

_SCRIPT = """
(function () {
  var cells = document.querySelectorAll('td.cell');
  var first = document.querySelector('td.first');
  var order = Array.prototype.indexOf.call(cells, first);
  var earliest = null;
  for (var i = 0; i < cells.length && earliest === null; i++) {
    if (cells[i].dataset.d !== '0') { earliest = cells[i]; }
  }
  document.body.dataset.first = first ? first.dataset.step + '|' + first.dataset.col : '';
  document.body.dataset.firstIndex = String(order);
  document.body.dataset.earliestDiffering = earliest ? earliest.dataset.step + '|' + earliest.dataset.col : '';
  var shown = 0;
  document.querySelectorAll('#legend .sw').forEach(function (sw) {
    var box = sw.getBoundingClientRect();
    if (box.width > 0 && box.height > 0) { shown++; }
  });
  document.body.dataset.legendShown = String(shown);
  var info = document.getElementById('cellinfo');
  cells.forEach(function (c) {
    c.addEventListener('click', function () {
      info.textContent = 'step ' + c.dataset.step + ', ' + c.dataset.col + ': distance ' + c.dataset.d;
    });
  });
})();
"""

_STYLE = """
body { font-family: sans-serif; margin: 1em; }
#wrap { display: flex; gap: 2em; align-items: flex-start; }
table { border-collapse: collapse; font-size: 11px; }
th { font-weight: normal; padding: 2px 4px; }
th.col { writing-mode: vertical-rl; transform: rotate(180deg); max-height: 14em; }
td.cell { width: 14px; height: 14px; border: 1px solid #ddd; }
td.first { outline: 3px solid #0050ff; outline-offset: -2px; }
td.none, #legend .none { background: #f4f4f4; }
#details { max-width: 40em; font-size: 13px; }
#legend { font-size: 12px; margin: 0 0 1em 0; padding: 0; list-style: none;
          display: flex; flex-wrap: wrap; gap: 0.4em 1.2em; }
#legend li { display: flex; align-items: center; gap: 0.4em; }
#legend .sw { display: inline-block; width: 14px; height: 14px; border: 1px solid #ddd; box-sizing: border-box; }
#legend .sw.first { outline: 3px solid #0050ff; outline-offset: -2px; }
pre { white-space: pre-wrap; }
"""


def _colour(d: float) -> str:
    if d == 0.0:
        return "#ffffff"
    if math.isinf(d):
        return "#600000"
    # log scale: 1e-9 (just the bits) pale yellow ... 1 (all) red
    x = min(1.0, max(0.0, (math.log10(max(d, 1e-12)) + 9) / 9))
    g = int(230 - 200 * x)
    return f"#ff{g:02x}{int(150 * (1 - x)):02x}"


# the legend: (class, distance it shows or None, text); the colours are _colour's own
_LEGEND = (
    ("", 0.0, "equal"),
    ("", 1e-9, "bits differ, norms equal (or within 1e-9)"),
    ("", 1e-6, "norms 1e-6 apart (relative)"),
    ("", 1e-3, "1e-3 apart"),
    ("", 1.0, "1 apart (the largest)"),
    ("", math.inf, "no norm to compare: another dtype or shape, not a float, a sum of squares not finite "
                   "(NaN, inf), or the runs recorded different things"),
    ("none", None, "nothing recorded here"),
    ("first", 0.0, "the first divergence"),
)


def legend() -> str:
    """The colour legend above the grid: which colour is which distance (docs/TRACE.md "Comparing")."""
    items = []
    for cls, d, text in _LEGEND:
        style = f' style="background:{_colour(d)}"' if d is not None and cls != "first" else ""
        shown = "" if d is None else ("inf" if math.isinf(d) else f"{d:.3g}")
        items.append(f'<li><span class="sw {cls}"{style} data-d="{shown}"></span>{html.escape(text)}</li>')
    return ('<ul id="legend" title="distance: the relative difference of the L2 norms of the records of a cell, '
            f'the largest of the cell">{"".join(items)}</ul>')


def render(result: Divergence) -> str:
    """The page's HTML text."""
    steps = sorted({s for s, _ in result.grid})
    columns: list[str] = []
    for _, c in sorted(result.grid, key=lambda k: k[0]):
        if c not in columns:
            columns.append(c)
    first = result.first
    first_key = (first["step"], column_of(first)) if first else None
    shown = {c: html.escape(printable(c)) for c in columns}  # names from the traces: escaped twice over
    head = "".join(f'<th class="col">{shown[c]}</th>' for c in columns)
    rows = []
    for s in steps:
        cells = []
        for c in columns:
            d = result.grid.get((s, c))
            if d is None:
                cells.append(f'<td class="cell none" data-step="{s}" data-col="{shown[c]}" data-d="0"></td>')
                continue
            mark = " first" if (s, c) == first_key else ""
            text = "inf" if math.isinf(d) else f"{d:.3g}"
            cells.append(f'<td class="cell{mark}" style="background:{_colour(d)}" data-step="{s}" '
                         f'data-col="{shown[c]}" data-d="{text}" title="step {s}, {shown[c]}: {text}">'
                         "</td>")
        rows.append(f"<tr><th>step {s}</th>{''.join(cells)}</tr>")
    details = html.escape("\n".join(result.lines()))
    record = html.escape(json.dumps(first, indent=1, default=str)) if first else "(none)"
    title = "same" if result.same else f"first divergence: step {first['step'] if first else '?'}"
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>tensorcanon diverge: {title}</title>"
            f"<style>{_STYLE}</style></head><body>"
            f"<h1>{html.escape(printable(os.path.basename(result.a)))} vs "
            f"{html.escape(printable(os.path.basename(result.b)))}</h1>{legend()}"
            f"<div id=\"wrap\"><table id=\"grid\"><tr><th></th>{head}</tr>{''.join(rows)}</table>"
            f"<div id=\"details\"><h2>{html.escape(title)}</h2><pre id=\"report\">{details}</pre>"
            f"<h3>first differing record</h3><pre id=\"record\">{record}</pre><p id=\"cellinfo\"></p></div></div>"
            f"<script>{_SCRIPT}</script></body></html>\n")


def column_of(first: dict) -> str:
    """The grid column of the first divergence (as compare.column gives for its record)."""
    from .layout import Record

    return column(Record(first["step"], first["phase"], first["kind"], first["scope"], first["name"],
                         first["call"], first["role"], "", (), b"", 0.0, ""))


def write_page(result: Divergence, path: str) -> None:
    """Write the page to ``path`` all at once (io/writer.replace_atomically): a failure leaves
    whatever was at ``path`` untouched, and a missing folder is a MissingFileError naming it."""
    data = render(result).encode("utf-8")
    replace_atomically(path, lambda f, _tmp: f.write(data))
