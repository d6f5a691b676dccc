"""``tensorcanon diff`` that a person reads (issue 38 item 2, issue 37 item 4 for diff).

A list of values that differs is one line, a random state names the generators that differ, long
lines fit the terminal (or a fixed width when piped) with the differing part visible on both
sides, a tolerance never reads "identical" when values differ, structural differences are not
called "bit-exact", numbers carry the digits their dtype holds, plurals agree, and no control
character from a file reaches the terminal.
"""

from __future__ import annotations

import contextlib
import io
import random

import numpy as np
import pytest
import torch

import tensorcanon
from tensorcanon.tools import cli


def _cli(*args, columns: str = "") -> tuple[int, list[str]]:
    """``tensorcanon ARGS`` in this process, stdout captured (not a terminal: ``columns`` is $COLUMNS)."""
    out, err = io.StringIO(), io.StringIO()
    mp = pytest.MonkeyPatch()
    mp.setenv("COLUMNS", columns)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main([str(a) for a in args])
    finally:
        mp.undo()
    assert not err.getvalue(), err.getvalue()
    return code, out.getvalue().splitlines()


def _pair(tmp_path, a, b, **save):
    pa, pb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    tensorcanon.save(a, pa, **save)
    tensorcanon.save(b, pb, **save)
    return pa, pb


def _body(lines: list[str]) -> list[str]:
    """The difference lines: without the A:/B: lines and the summary."""
    return lines[2:-1]


# ------------------------------------------------------------------ lists, random states


def test_pythons_random_state_that_differs_is_one_line(tmp_path):
    random.seed(1)
    a = random.getstate()
    random.random()
    pa, pb = _pair(tmp_path, {"python_rng": a, "w": torch.ones(2)},
                   {"python_rng": random.getstate(), "w": torch.ones(2)})
    code, lines = _cli("diff", pa, pb)
    assert code == 1
    (line,) = _body(lines)  # was 623 lines, one per word of the Mersenne Twister state
    assert line.startswith('$["python_rng"][1]: ') and " of 625 items differ; first at [" in line, line
    assert lines[-1] == "1 difference (bit-exact)"
    (d,) = tensorcanon.diff(pa, pb)
    assert d.kind == "items" and d.total == 625 and d.count > 600 and d.first.kind == "value"
    assert d.first.path.startswith('$["python_rng"][1][')


def test_a_list_with_one_item_that_differs_names_the_item(tmp_path):
    ids = list(range(100, 140))
    changed = list(ids)
    changed[5] = 7
    pa, pb = _pair(tmp_path, {"ids": ids, "t": (1, 2, 3)}, {"ids": changed, "t": (1, 5, 6)})
    code, lines = _cli("diff", pa, pb)
    assert _body(lines) == ['$["ids"][5]: value 105 -> 7', '$["t"]: 2 of 3 items differ; first at [1]: 2 -> 5']
    assert lines[-1] == "2 differences (bit-exact)"


def test_a_log_of_records_that_differs_is_one_line(tmp_path):
    log = [{"step": i, "loss": 1.0 / (i + 1)} for i in range(500)]
    other = [dict(r, loss=r["loss"] * 2) if r["step"] >= 3 else r for r in log]
    pa, pb = _pair(tmp_path, {"log": log}, {"log": other})
    code, lines = _cli("diff", pa, pb)
    assert _body(lines) == ['$["log"]: 497 of 500 items differ; first at [3]["loss"]: 0.25 -> 0.5']


def test_an_rng_state_names_the_generators_that_differ(tmp_path):
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    a = tensorcanon.RngState.capture()
    random.random()
    torch.rand(1)
    pa, pb = _pair(tmp_path, {"rng": a}, {"rng": tensorcanon.RngState.capture()})
    code, lines = _cli("diff", pa, pb)
    (line,) = _body(lines)  # was one line whose two sides were cut to the same text
    assert line == '$["rng"]: random state differs: python, torch cpu (numpy equal)', line
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert tensorcanon.diff({"g": g1}, {"g": g2}).identical  # (was: compared by identity, always different)
    torch.rand(1, generator=g2)
    (d,) = tensorcanon.diff({"g": g1}, {"g": g2})
    assert str(d) == '$["g"]: random state differs: torch.Generator (cpu)'


# ------------------------------------------------------------------ width


def test_long_values_keep_the_place_where_they_differ_visible(tmp_path):
    a = {"note": "x" * 300 + "AAA" + "y" * 50, "key" * 40: 1}
    b = {"note": "x" * 300 + "BBB" + "y" * 50, "key" * 40: 2}
    pa, pb = _pair(tmp_path, a, b)
    from tensorcanon.tools import diffview
    for columns, width in (("80", 80), ("", diffview.PIPED_WIDTH), ("200", 200)):
        code, lines = _cli("diff", pa, pb, columns=columns)
        assert all(len(line) <= width for line in lines), (columns, lines)
        note = next(line for line in lines if line.startswith('$["note"]'))
        left, right = note.split(" -> ")
        assert "AAA" in left and "BBB" in right, note  # (was: both cut to the same 57 characters)
        key = next(line for line in lines if "keykey" in line)
        assert key.endswith("value 1 -> 2"), key  # a long path keeps its end


def test_tensor_statistics_wrap_rather_than_being_cut(tmp_path):
    a = {"model": {"layers.0.attention.query_key_value.weight" * 2: torch.zeros(3, 4)}}
    b = {"model": {"layers.0.attention.query_key_value.weight" * 2: torch.full((3, 4), 0.5)}}
    pa, pb = _pair(tmp_path, a, b)
    code, lines = _cli("diff", pa, pb, columns="80")
    assert all(len(line) <= 80 for line in lines), lines
    text = " ".join(line.strip() for line in _body(lines))
    assert "12 of 12 elements differ" in text and "first at [0, 0]: 0.0 -> 0.5" in text, text
    assert _body(lines)[1].startswith("    ")  # continued, indented


# ------------------------------------------------------------------ wording


def test_a_tolerance_never_reads_identical_when_values_differ(tmp_path):
    pa, pb = _pair(tmp_path, {"w": torch.tensor([1.0, 2.0, 3.0]), "lr": 0.1},
                   {"w": torch.tensor([1.0, 2.5, 3.0]), "lr": 0.2})
    code, lines = _cli("diff", "--atol", "10", pa, pb)
    assert code == 0
    assert lines[-1] == "equal within atol=10, rtol=0 (not identical: 2 values differ within it)", lines
    r = tensorcanon.diff(pa, pb, atol=10)
    assert not r and not r.identical and r.tolerated == 2
    code, lines = _cli("diff", "--atol", "10", pa, pa)
    assert code == 0 and lines[-1].startswith("identical: the same content digest xxh3-128:")
    code, lines = _cli("diff", "--rtol", "0.1", pa, pb)
    assert code == 1 and lines[-1] == "2 differences beyond atol=0, rtol=0.1", lines


def test_structural_differences_are_not_called_bit_exact(tmp_path):
    pa, pb = _pair(tmp_path, {"a": 1, "w": torch.ones(2)}, {"b": 1, "w": torch.ones(2, dtype=torch.float64)})
    code, lines = _cli("diff", pa, pb)
    assert lines[-1] == "3 differences", lines
    pa, pb = _pair(tmp_path, {"a": 1}, {"a": 2})
    assert _cli("diff", pa, pb)[1][-1] == "1 difference (bit-exact)"


def test_numbers_have_the_digits_of_their_dtype():
    (d,) = tensorcanon.diff(torch.tensor([7382.8965], dtype=torch.float32),
                            torch.tensor([7382.897], dtype=torch.float32))
    assert (d.stats.first_a, d.stats.first_b) == (7382.8965, 7382.897)
    assert str(d).endswith("first at [0]: 7382.8965 -> 7382.897"), str(d)
    (d,) = tensorcanon.diff(torch.tensor([0.1], dtype=torch.bfloat16), torch.tensor([0.2], dtype=torch.bfloat16))
    assert str(d).endswith("first at [0]: 0.1 -> 0.2"), str(d)  # (the shortest text of the bfloat16 value)


def test_plurals_agree():
    from tensorcanon.tools import diffview

    r = tensorcanon.diff({"a": 1, "b": 2, "c": 3}, {"a": 2, "b": 3, "c": 4})
    lines = diffview.lines(r, 120, limit=2)
    assert lines[-1] == "... and 1 more difference"
    lines = diffview.lines(r, 120, limit=1)
    assert lines[-1] == "... and 2 more differences"
    assert tensorcanon.diff({"a": 1}, {"a": 2}).summary() == "1 difference (bit-exact)"
    (d,) = tensorcanon.diff([1, 2], [1])
    assert str(d) == "$: length 2 items -> 1 item"


# ------------------------------------------------------------------ control characters


HOSTILE = "ok\x1b[2J\x1b[1;1Hsame: \r\u202etxt.exe\x00\n"


def test_no_control_character_from_a_file_reaches_the_terminal(tmp_path):
    a = {HOSTILE: 1, "v": HOSTILE, "s": {HOSTILE}, "meta": np.array([HOSTILE])}
    b = {HOSTILE: 2, "v": HOSTILE + "!", "s": {HOSTILE + "!"}, "meta": np.array([HOSTILE + "!"])}
    pa, pb = _pair(tmp_path, a, b, metadata={HOSTILE: HOSTILE})
    code, lines = _cli("diff", pa, pb)
    text = "\n".join(lines)
    for ch in "\x1b\r\x00\u202e":
        assert ch not in text, repr(ch)
    assert len(lines) == 2 + 4 + 1  # no line added by a newline from the file
    assert any("\\x1b[2J" in line and "\\u202e" in line for line in lines), lines
    r = tensorcanon.diff(pa, pb)
    assert not any(ch in str(r) for ch in "\x1b\r\x00\u202e")
    # the data keeps what the file holds (paths as FORMAT.md §3.1 writes them); the text escapes it
    assert any(d.path.startswith('$["ok\\u001b') and "\u202e" in d.path for d in r)


def test_file_names_are_escaped_too(tmp_path):
    name = tmp_path / "evil\x1b[31m\u202e.safetensors"
    tensorcanon.save({"a": 1}, name)
    code, lines = _cli("diff", name, name)
    assert code == 0 and "\\x1b[31m\\u202e" in lines[0] and "\x1b" not in "".join(lines)
