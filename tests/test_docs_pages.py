"""Every example in README.md and docs/*.md runs, and every page renders as meant.

How blocks are run and marked (skip with a reason, hidden setup, files, an S3 server, output):
tests/docs_blocks.py's docstring. Each page's runnable blocks run in one fresh interpreter
(tests/docs_runner.py), in order, like a notebook; a failure names the page and the line of the
block. docs/DISTRIBUTED.md's Python blocks need a torchrun job and run in
tests/dcp/test_docs_examples.py (the page says so with a doctest-page mark).

To check one page by hand: ``cd tests && python docs_runner.py docs/RNG.md /tmp/somewhere``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import docs_blocks
import pytest

PAGES = docs_blocks.pages()
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("page", PAGES)
def test_page_renders_with_the_headings_it_means(page):
    """CommonMark (markdown-it-py) finds the headings a writer means (lines starting with '#' outside
    fences), and no fence is left open: a stray fence turns prose into code and headings vanish."""
    parsed = docs_blocks.parse(page)
    meant, unclosed = docs_blocks.naive_headings(parsed.text)
    assert not unclosed, f"{page}:{unclosed[0]}: this fence never closes"
    rendered = parsed.headings
    assert not parsed.misnumbered, f"{page}: a numbered list out of order: {parsed.misnumbered}"
    missing = [h for h in meant if h not in rendered]
    assert rendered == meant, (f"{page}: CommonMark renders {len(rendered)} headings where the page means "
                               f"{len(meant)}; not rendered as headings: {missing} (look for a fence that does "
                               f"not close where it seems to: a closing fence has nothing after it on its line)")


@pytest.mark.parametrize("page", PAGES)
def test_every_block_is_labelled_and_parses(page):
    """Each block's language is one the runner knows; data blocks parse; Python compiles and shell
    parses, including the blocks marked skip (they cannot run here, so this is their check)."""
    import yaml

    parsed = docs_blocks.parse(page)
    assert not parsed.indented, (f"{page}:{parsed.indented[0]}: an indented code block: use a fenced block with a "
                                 "language (```python, ```bash, ```text, ...) so that it is run or checked")
    for test in parsed.run_by.values():
        path = os.path.join(docs_blocks.ROOT, test)
        assert os.path.exists(path), f"{page}: the doctest-page mark names {test}, which does not exist"
        assert os.path.basename(page) in open(path, encoding="utf-8").read() or \
            _names_page_via_helper(path, page), f"{page}: {test} does not mention the page it is said to run"
    known = docs_blocks.PYTHON + docs_blocks.SHELL + docs_blocks.CONSOLE + docs_blocks.DATA + docs_blocks.TEXT
    for block in parsed.blocks:
        where = block.where
        assert block.lang, (f"{where}: a block without a language: label it (```text for a diagram or output, "
                            "```python, ```bash or ```console for an example: tests/docs_blocks.py)")
        assert block.lang in known, \
            f"{where}: unknown language {block.lang!r}: use one of {known} (tests/docs_blocks.py)"
        if block.lang in docs_blocks.TEXT:
            assert not docs_blocks.looks_like_a_session(block.code), \
                f"{where}: a text block that looks like a session: label it console (or python)"
            assert not block.mark("skip"), f"{where}: a text block cannot be skipped: it never runs"
            if block.mark("output"):
                assert block.lang == "text", f"{where}: label an output block 'text'"
        elif block.lang in docs_blocks.PYTHON:
            compile("\n" * (block.code_line - 1) + block.code, os.path.join(docs_blocks.ROOT, page), "exec")
        elif block.lang in docs_blocks.SHELL:
            _bash_parses(block.code, where)
        elif block.lang in docs_blocks.CONSOLE:
            for offset, command, _ in docs_blocks.console_commands(block.code):
                _bash_parses(command, f"{page}:{block.code_line + offset}")
        elif block.lang in ("yaml", "yml"):
            try:
                yaml.safe_load(block.code)
            except yaml.YAMLError as e:
                pytest.fail(f"{where}: the YAML does not parse: {e}")
        elif block.lang == "json":
            try:
                json.loads(block.code)
            except ValueError as e:
                pytest.fail(f"{where}: the JSON does not parse: {e}")
        setup = block.mark("setup")
        if setup:
            compile("\n" * (setup.body_line - 1) + setup.body, os.path.join(docs_blocks.ROOT, page), "exec")


def _names_page_via_helper(test_path: str, page: str) -> bool:
    """tests/dcp/test_docs_examples.py runs DISTRIBUTED.md through its helper docs_examples.py."""
    helper = os.path.join(os.path.dirname(test_path), "docs_examples.py")
    return os.path.exists(helper) and os.path.basename(page) in open(helper, encoding="utf-8").read()


def _bash_parses(code: str, where: str) -> None:
    proc = subprocess.run(["bash", "-n", "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, f"{where}: bash cannot parse this:\n{proc.stderr}"


def _runnable(page: str) -> bool:
    parsed = docs_blocks.parse(page)
    for block in parsed.blocks:
        if block.skip_reason:
            continue
        if block.lang in docs_blocks.PYTHON and "python" not in parsed.run_by:
            return True
        if block.lang in docs_blocks.SHELL + docs_blocks.CONSOLE or block.mark("output"):
            return True
    return False


def run_page(page: str, work: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    # No example may need the network: the Hugging Face libraries are told so (a download would fail fast).
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, os.path.join(HERE, "docs_runner.py"), page, work], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)


@pytest.mark.parametrize("page", [p for p in PAGES if _runnable(p)])
def test_examples_run_in_a_subprocess(page, tmp_path):
    proc = run_page(page, str(tmp_path))
    assert proc.returncode == 0 and f"{page}: every example passed" in proc.stdout, proc.stdout[-8000:]


def test_the_runner_names_the_line_of_a_broken_example_in_a_subprocess(tmp_path):
    """The mechanism itself: a setup comment, an output block, a console block, copied files and a
    Python block that raises, each reported at its own line; then a console block whose output
    differs."""
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n"                                   # 1
        "\n"                                           # 2
        "<!-- doctest: setup\n"                        # 3
        "hidden = 41\n"                                # 4
        "-->\n"                                        # 5
        "```python\n"                                  # 6
        "print(hidden + 1)\n"                          # 7
        "```\n"                                        # 8
        "<!-- doctest: output -->\n"                   # 9
        "```text\n"                                    # 10
        "42\n"                                         # 11
        "```\n"                                        # 12
        "```console\n"                                 # 13
        "$ echo one; echo two\n"                       # 14
        "one\n"                                        # 15
        "...\n"                                        # 16
        "```\n"                                        # 17
        "<!-- doctest: files tests/cli/inputs -->\n"   # 18
        "```console\n"                                 # 19
        "$ ls base.safetensors\n"                      # 20
        "base.safetensors\n"                           # 21
        "```\n"                                        # 22
        "```python\n"                                  # 23
        "x = 1\n"                                      # 24
        "raise ValueError('broken on purpose')\n"      # 25
        "```\n"                                        # 26
    )
    proc = run_page(str(page), str(tmp_path / "work"), timeout=60)
    assert proc.returncode == 1, proc.stdout
    assert f"FAILED {page}:23 (python)" in proc.stdout, proc.stdout
    assert f'File "{page}", line 25' in proc.stdout and "broken on purpose" in proc.stdout, proc.stdout
    assert f"{page}:10 [text]: output compared" in proc.stdout, proc.stdout
    assert f"{page}:13 [console]: ran, output compared" in proc.stdout, proc.stdout
    assert f"{page}:19 [console]: ran, output compared" in proc.stdout, proc.stdout  # the files were copied

    page.write_text(page.read_text().replace("one\n...\n", "three\n"))
    proc = run_page(str(page), str(tmp_path / "work2"), timeout=60)
    assert f"FAILED {page}:13 (console)" in proc.stdout and f"line {page}:14" in proc.stdout, proc.stdout
    assert "--- the page shows\nthree\n--- it printed\none\ntwo" in proc.stdout, proc.stdout


def test_marks_that_mark_nothing_or_lack_a_reason_are_errors(tmp_path):
    bad = {
        "<!-- doctest: skip -->\n```bash\ntrue\n```\n": "needs a reason",
        "<!-- doctest: skip network -->\n\nA paragraph.\n\n```bash\ntrue\n```\n": "not followed by a code block",
        "<!-- doctest: frobnicate -->\n```bash\ntrue\n```\n": "unknown doctest mark 'frobnicate'",
        "```bash\ntrue\n```\n<!-- doctest: skip network -->\n": "marks no block",
    }
    for text, message in bad.items():
        page = tmp_path / "bad.md"
        page.write_text(text)
        with pytest.raises(docs_blocks.DocsError, match=message) as info:
            docs_blocks.parse(str(page))
        assert str(info.value).startswith(f"{page}:"), info.value


def test_output_matching():
    m = docs_blocks.matches
    assert m(["a", "...", "d"], ["a", "b", "c", "d"])
    assert m(["a", "...", "b"], ["a", "b"])
    assert m(["x: ... end"], ["x: anything at all end  "])
    assert not m(["a", "b"], ["a", "c"])
    assert not m(["a"], ["a", "b"])
    assert m(["", "a", ""], ["a"])
