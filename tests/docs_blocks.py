"""The code blocks of README.md and docs/*.md, and the marks that say how each one is checked.

Read with a CommonMark parser (markdown-it-py), so a block is exactly what a reader sees as one.
tests/test_docs_pages.py checks every page; tests/docs_runner.py runs one page's examples.

How a block is checked, by its language (the word after the opening fence):

- ``python`` / ``py``: run, each page's blocks in order in one namespace, like a notebook, in a
  fresh interpreter whose working directory is an empty folder of its own.
- ``bash`` / ``sh`` / ``shell``: run with ``bash -euo pipefail`` in that folder; it must exit 0.
- ``console``: a shell session: each ``$ `` line is run in that folder and the lines after it, up
  to the next ``$ ``, are its expected output (stdout and stderr together). A command's ``$ `` is
  followed by the command itself, not more blank space, so output lines that start with ``$`` and
  spaces (the root row ``$      dict`` of ``tensorcanon inspect``) stay output. A line ``...`` matches
  any number of lines, and ``...`` inside a line any text; trailing spaces are ignored.
- ``yaml`` / ``yml``, ``json``: parsed (PyYAML, json): they are never run.
- ``text``: not code (a diagram, a file layout, output). A block without a language fails: every
  block says what it is, so no example goes unchecked by mistake.
- Any other language fails: add it here.

Marks are HTML comments (invisible once rendered) on the lines just before a block, blank lines
allowed in between; several may be stacked:

- ``<!-- doctest: skip REASON -->``: the block cannot run here (a package index, a GPU, a CI
  service); REASON is required and says why. It is still parsed (python: compile(); bash and
  console commands: ``bash -n``).
- ``<!-- doctest: setup`` … ``-->``: hidden Python, run in the page's namespace just before the
  block: what the reader brings (their model, their dataset). Prefer visible code; use this for
  what the text says the reader supplies. Shell blocks see ``os.environ`` as setup code left it.
- ``<!-- doctest: files DIR -->``: copy DIR (relative to the repository root) into the working
  folder first, e.g. ``tests/cli/inputs`` for command-line examples.
- ``<!-- doctest: needs s3 BUCKET... -->``: the page's interpreter starts moto's S3 server on
  127.0.0.1 (once), makes the buckets, sets dummy AWS credentials in the environment and
  ``S3_ENDPOINT`` (its URL) in the namespace, for setup code to pass as ``endpoint_url``.
- ``<!-- doctest: output -->``, on a ``text`` block: the block is what the Python block before it
  prints, compared with the same ``...`` rules as a console block.

One mark for a whole page, anywhere in it: ``<!-- doctest-page: python run-by TESTFILE -->``:
the page's Python blocks need something this runner cannot give (docs/DISTRIBUTED.md: a torchrun
job of several ranks) and TESTFILE runs them; here they are only compiled, and TESTFILE must
exist and name the page.

A failure names the page and the line of the block's opening fence (``docs/RNG.md:34``), and a
Python traceback points into the Markdown file itself (blocks are compiled at their own lines).
"""

from __future__ import annotations

import dataclasses
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PYTHON = ("python", "py")
SHELL = ("bash", "sh", "shell")
CONSOLE = ("console",)
DATA = ("yaml", "yml", "json")
TEXT = ("text",)
KEYWORDS = ("skip", "setup", "files", "needs", "output")


class DocsError(Exception):
    """A page whose blocks or marks this module cannot read; the message names the file and line."""


@dataclasses.dataclass
class Mark:
    keyword: str
    arg: str       # the rest of the first line
    body: str      # the lines after the first (setup code)
    line: int      # 1-based line of the comment's first line
    body_line: int  # 1-based line of the body's first line


@dataclasses.dataclass
class Block:
    page: str      # path relative to the repository root
    line: int      # 1-based line of the opening fence
    lang: str
    code: str
    code_line: int  # 1-based line of the code's first line
    marks: list[Mark]

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def mark(self, keyword: str) -> Mark | None:
        return next((m for m in self.marks if m.keyword == keyword), None)

    @property
    def skip_reason(self) -> str | None:
        m = self.mark("skip")
        return m.arg if m else None


@dataclasses.dataclass
class Page:
    path: str
    blocks: list[Block]
    run_by: dict[str, str]      # language group ("python") -> the test file that runs those blocks
    headings: list[str]         # as CommonMark renders them
    text: str
    indented: list[int]         # lines of indented code blocks (examples there would go unchecked)
    misnumbered: list[str]      # 'line N: item 6 where 4 renders' in ordered lists (CommonMark renumbers)


def pages() -> list[str]:
    """README.md and every docs/*.md, relative to the repository root."""
    docs = sorted(f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))
    return ["README.md", *docs]


_MARK = re.compile(r"<!--\s*doctest(-page)?:\s*(.*?)\s*-->\s*$", re.S)


def _parse_mark(content: str, line: int, where: str) -> tuple[bool, Mark]:
    m = _MARK.match(content.strip())
    if not m:
        raise DocsError(f"{where}:{line}: a doctest comment must read '<!-- doctest: KEYWORD ... -->'")
    page_level, inner = bool(m.group(1)), m.group(2)
    first, _, body = inner.partition("\n")
    keyword, _, arg = first.strip().partition(" ")
    if page_level:
        return True, Mark(keyword, arg.strip(), body, line, line + 1)
    if keyword not in KEYWORDS:
        raise DocsError(f"{where}:{line}: unknown doctest mark {keyword!r} (known: {', '.join(KEYWORDS)})")
    if keyword == "skip" and not arg.strip():
        raise DocsError(f"{where}:{line}: 'doctest: skip' needs a reason: why can this block not run here?")
    return False, Mark(keyword, arg.strip(), body, line, line + 1)


def parse(page: str) -> Page:
    """The blocks, marks and headings of one page (a path relative to the repository root)."""
    from markdown_it import MarkdownIt

    with open(os.path.join(ROOT, page), encoding="utf-8") as fh:
        text = fh.read()
    tokens = MarkdownIt("commonmark").parse(text)
    blocks: list[Block] = []
    run_by: dict[str, str] = {}
    headings: list[str] = []
    pending: list[Mark] = []
    for i, tok in enumerate(tokens):
        start = tok.map[0] + 1 if tok.map else 0
        if tok.type == "html_block" and re.match(r"\s*<!--\s*doctest", tok.content):
            page_level, mark = _parse_mark(tok.content, start, page)
            if page_level:
                verb, _, test = mark.arg.partition(" ")
                if mark.keyword != "python" or verb != "run-by" or not test.strip():
                    raise DocsError(f"{page}:{start}: a page mark reads "
                                    "'<!-- doctest-page: python run-by TESTFILE -->'")
                run_by["python"] = test.strip()
            else:
                pending.append(mark)
        elif tok.type == "fence":
            lang = tok.info.strip().split(" ")[0].lower() if tok.info.strip() else ""
            blocks.append(Block(page, start, lang, tok.content, start + 1, pending))
            pending = []
        elif pending and tok.type in ("paragraph_open", "heading_open", "table_open", "bullet_list_open",
                                      "ordered_list_open", "blockquote_open", "hr", "code_block"):
            raise DocsError(f"{page}:{pending[0].line}: a doctest mark is not followed by a code block "
                            f"(a {tok.type.replace('_open', '')} at line {start} comes first)")
        if tok.type == "heading_open":
            headings.append(tokens[i + 1].content)
    if pending:
        raise DocsError(f"{page}:{pending[0].line}: a doctest mark at the end of the page marks no block")
    indented = [tok.map[0] + 1 for tok in tokens if tok.type == "code_block" and tok.map]
    return Page(page, blocks, run_by, headings, text, indented, _misnumbered(tokens))


def _misnumbered(tokens: list) -> list[str]:
    """Ordered-list items whose written number is not the one CommonMark shows (it counts on from
    the first item's number whatever the others say)."""
    out: list[str] = []
    stack: list[int | None] = []  # per open list: the number the next item renders as (None: bullets)
    for tok in tokens:
        if tok.type == "ordered_list_open":
            stack.append(-1)
        elif tok.type == "bullet_list_open":
            stack.append(None)
        elif tok.type in ("ordered_list_close", "bullet_list_close"):
            stack.pop()
        elif tok.type == "list_item_open" and stack and stack[-1] is not None:
            written = int(tok.info)
            shown = written if stack[-1] == -1 else stack[-1]
            if written != shown:
                out.append(f"line {tok.map[0] + 1}: item {written} renders as {shown}")
            stack[-1] = shown + 1
    return out


def naive_headings(text: str) -> tuple[list[str], list[int]]:
    """The headings a writer means: lines starting with '#' outside fences, fences found by a simple
    scan (a line starting with ``` or ~~~ opens or closes one). Also the lines of fences left open."""
    headings: list[str] = []
    fence: tuple[str, int] | None = None
    for n, line in enumerate(text.split("\n"), 1):
        stripped = line.lstrip(" ")
        marker = stripped[:3]
        if marker in ("```", "~~~") and len(line) - len(stripped) <= 3:
            fence = None if fence else (marker, n)
            continue
        if fence is None and re.match(r"#{1,6}(\s|$)", line):
            headings.append(re.sub(r"\s+#+\s*$", "", line.lstrip("#").strip()))
    return headings, ([fence[1]] if fence else [])


def looks_like_a_session(code: str) -> bool:
    return any(line.startswith(("$ ", ">>> ")) for line in code.split("\n"))


def console_commands(code: str) -> list[tuple[int, str, list[str]]]:
    """(line offset in the block, command, expected output lines) for each ``$ `` line."""
    out: list[tuple[int, str, list[str]]] = []
    for n, line in enumerate(code.rstrip("\n").split("\n")):
        if re.match(r"\$ \S", line):
            out.append((n, line[2:], []))
        elif out:
            out[-1][2].append(line)
        elif line.strip():
            raise DocsError(f"a console block starts with output, not a '$ ' command: {line!r}")
    return out


def matches(expected: list[str], actual: list[str]) -> bool:
    """Whether actual lines match expected ones: a line '...' stands for any number of lines,
    '...' within a line for any text; trailing spaces and blank lines at either end are ignored."""
    exp = _trim([e.rstrip() for e in expected])
    act = _trim([a.rstrip() for a in actual])

    def line_matches(e: str, a: str) -> bool:
        pattern = ".*".join(re.escape(part) for part in e.split("..."))
        return re.fullmatch(pattern, a) is not None

    # a small dynamic programme over (expected index, actual index)
    reach = {(0, 0)}
    for i, e in enumerate(exp):
        nxt = set()
        for (ei, ai) in reach:
            if ei != i:
                continue
            if e == "...":
                nxt.update((i + 1, k) for k in range(ai, len(act) + 1))
            elif ai < len(act) and line_matches(e, act[ai]):
                nxt.add((i + 1, ai + 1))
        reach = nxt
    return (len(exp), len(act)) in reach


def _trim(lines: list[str]) -> list[str]:
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines
