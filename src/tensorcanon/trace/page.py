"""``diverge --html OUT``: one self-contained page (no fetches): steps x modules, coloured by distance.

Each cell is the largest distance (compare.distance) of the records of one step and one grid
column (compare.column): white equal, yellow to red as the relative difference of the norms
grows, dark red where the two runs recorded different things. The first divergence's cell is
marked, and its record's details are beside the grid. A small script (inline) finds the marked
cell and reports it in the page's ``data-first`` attribute, and shows a cell's details on a click.
"""

from __future__ import annotations

import html
import json
import math
import os

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
td.none { background: #f4f4f4; }
#details { max-width: 40em; font-size: 13px; }
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


def render(result: Divergence) -> str:
    """The page's HTML text."""
    steps = sorted({s for s, _ in result.grid})
    columns: list[str] = []
    for _, c in sorted(result.grid, key=lambda k: k[0]):
        if c not in columns:
            columns.append(c)
    first = result.first
    first_key = (first["step"], column_of(first)) if first else None
    head = "".join(f'<th class="col">{html.escape(c)}</th>' for c in columns)
    rows = []
    for s in steps:
        cells = []
        for c in columns:
            d = result.grid.get((s, c))
            if d is None:
                cells.append(f'<td class="cell none" data-step="{s}" data-col="{html.escape(c)}" data-d="0"></td>')
                continue
            mark = " first" if (s, c) == first_key else ""
            text = "inf" if math.isinf(d) else f"{d:.3g}"
            cells.append(f'<td class="cell{mark}" style="background:{_colour(d)}" data-step="{s}" '
                         f'data-col="{html.escape(c)}" data-d="{text}" title="step {s}, {html.escape(c)}: {text}">'
                         "</td>")
        rows.append(f"<tr><th>step {s}</th>{''.join(cells)}</tr>")
    details = html.escape("\n".join(result.lines()))
    record = html.escape(json.dumps(first, indent=1, default=str)) if first else "(none)"
    title = "same" if result.same else f"first divergence: step {first['step'] if first else '?'}"
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>tensorcanon diverge: {title}</title>"
            f"<style>{_STYLE}</style></head><body>"
            f"<h1>{html.escape(os.path.basename(result.a))} vs {html.escape(os.path.basename(result.b))}</h1>"
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
