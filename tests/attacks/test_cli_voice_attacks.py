"""Terminal control characters from files never reach the terminal raw through verify, hash,
check, lock and convert (issue 37 item 4, issue 38): a lockfile line, a file's own name, a tensor
name inside a damaged file. A hostile file must not move the cursor, colour, clear the screen,
reorder text (bidi overrides) or print a line that looks like a verdict of its own."""

from __future__ import annotations

import os

import pytest
import torch

import tensorcanon

from support import run_cli

# ESC (a CSI that clears the screen), CR (back to the line's start), C1 CSI, DEL, a bidi override
HOSTILE = "x\x1b[2J\r\x9b31m\x7f\u202eok"
RAW = ("\x1b", "\r", "\x9b", "\x7f", "\u202e")


def _clean(*texts: str) -> None:
    for text in texts:
        for c in RAW:
            assert c not in text, (c, text)


def test_a_lockfile_line_cannot_write_to_the_terminal(tmp_path):
    (tmp_path / "t.lock").write_text(f"tensorcanon-lock 3\nxxh3-128:{'0' * 32} 10 {HOSTILE}.safetensors\n")
    code, out, err = run_cli("check", "t.lock", cwd=tmp_path)
    assert code == 1 and out.startswith("MISSING")
    _clean(out, err)
    assert "\\x1b[2J\\r\\x9b31m\\x7f\\u202eok.safetensors" in out, out


@pytest.mark.skipif(os.name != "posix", reason="file names with control characters")
def test_a_file_name_cannot_write_to_the_terminal(tmp_path):
    name = f"{HOSTILE}.safetensors"
    tensorcanon.save({"w": torch.ones(2), "step": 1}, tmp_path / name)
    for argv in (["verify", name], ["hash", name], ["lock", name, "-o", "t.lock"],  # (lock refuses the name)
                 ["convert", name, "out-" + name], ["verify", "missing" + name], ["check", name]):
        code, out, err = run_cli(*argv, cwd=tmp_path)
        _clean(out, err)
        assert "\\x1b[2J" in out + err, (argv, out, err)


def test_a_tensor_name_in_a_damaged_file_cannot_write_to_the_terminal(tmp_path):
    path = tmp_path / "damaged.safetensors"
    tensorcanon.save({HOSTILE: torch.ones(3)}, path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(data)
    code, out, err = run_cli("verify", str(path))
    assert code == 1 and out.startswith("CORRUPT")
    _clean(out, err)
