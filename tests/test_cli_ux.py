"""What a CI user meets on the command line (issue 23): convert refuses an output named like another
format, inspect fits long paths to the terminal and shows per-rank paths once quoted, check takes
several lockfiles, verify and check report files in the order given while hashing several at once,
a sharded checkpoint passed to ``load`` says how to read it, ``read_metadata`` of a plain
safetensors file gives its metadata, and docs/CLI.md's inspect example is what inspect prints."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file

import tensorcanon
from tensorcanon.tools import cli

from support import run_cli

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
INPUTS = os.path.join(HERE, "cli", "inputs")
SHARDED = os.path.join(HERE, "golden", "sharded", "two_ranks")


@pytest.fixture
def inputs(cli_inputs):
    return cli_inputs


@pytest.mark.parametrize("out", ["w.pt", "w.PTH", "pytorch_model.bin", "w.npz", "w.npy"])
def test_convert_refuses_an_output_named_as_another_format(inputs, out):
    code, stdout, stderr = run_cli("convert", "plain.safetensors", out)
    assert code == 2 and stdout == "" and not os.path.exists(out)
    assert stderr.startswith("tensorcanon convert: error: OUT ") and "name it .safetensors" in stderr, stderr


def test_convert_writes_other_names(inputs):
    for out in ("w.safetensors", "last.ckpt", "weights"):
        code, stdout, stderr = run_cli("convert", "weights.pt", out)
        assert code == 0 and stderr == "", stderr
        assert tensorcanon.verify(out) == tensorcanon.fingerprint(tensorcanon.load(out))


def test_inspect_shows_per_rank_paths_quoted_once():
    code, stdout, _ = run_cli("inspect", SHARDED)
    assert code == 0
    assert 'per-rank values at $["rng"]\n' in stdout, stdout


def _long_path_file(folder) -> tuple[str, str]:
    """A file holding a tensor at a path as long as a Lightning checkpoint's optimizer state."""
    key = "model." + ".".join(f"encoder_layer_{i}" for i in range(12)) + ".self_attention.weight"
    path = os.path.join(folder, "long.safetensors")
    tensorcanon.save({"state_dict": {key: torch.ones(2)}, "epoch": 3}, path)
    return path, f'$["state_dict"]["{key}"]'


def test_inspect_fits_long_paths_to_the_terminal(inputs, monkeypatch):
    """A path longer than its column is never cut: on a line of its own, whole (a pipe), or wrapped
    between its keys to the terminal's width."""
    path, long = _long_path_file(inputs)
    assert len(long) > 200
    code, stdout, _ = run_cli("inspect", path)  # not a terminal, no $COLUMNS: a path on one line
    assert code == 0 and long in stdout.splitlines()
    monkeypatch.setenv("COLUMNS", "120")
    code, stdout, _ = run_cli("inspect", path)
    assert code == 0 and long not in stdout
    rows = stdout.split("\n\n")[1].splitlines()
    assert all(len(line) <= 120 for line in rows), rows
    start = next(i for i, line in enumerate(rows) if line.startswith('$["state_dict"]["model.'))
    end = next(i for i in range(start + 1, len(rows)) if not re.match(r"  \S", rows[i]))  # continued: 2 spaces
    assert "".join([rows[start], *(line[2:] for line in rows[start + 1:end])]) == long
    assert rows[end].split()[:4] == ["tensor", "float32", "[2]", "8"]  # its cells on the next line
    code, stdout, _ = run_cli("inspect", "--json", path)  # JSON keeps every path whole
    assert long in [e["path"] for e in json.loads(stdout)["entries"]]


def test_check_takes_several_lockfiles(inputs):
    code, stdout, stderr = run_cli("check", "good.lock", "bad.lock")
    assert code == 1 and stderr == ""
    lines = stdout.splitlines()
    assert lines[0] == "good.lock:" and lines[1] == "  ok          base.safetensors"
    assert lines[3] == "  all 2 files match" and lines[4] == "bad.lock:" and lines[-1] == "  3 of 5 files failed"
    code, stdout, _ = run_cli("check", "--json", "good.lock", "malformed.lock")
    report = json.loads(stdout)
    assert code == 2 and report["ok"] is False
    assert [r["lockfile"] for r in report["lockfiles"]] == ["good.lock", "malformed.lock"]
    assert report["lockfiles"][0]["ok"] and "error" in report["lockfiles"][1]
    single = json.loads(run_cli("check", "--json", "good.lock")[1])
    assert single == report["lockfiles"][0]  # one lockfile: the object itself, as before


def test_several_files_are_reported_in_the_order_given(inputs, monkeypatch):
    names = ["base.safetensors", "corrupt.safetensors", "nope.safetensors", "one_element.safetensors",
             "plain.safetensors", SHARDED, "truncated.safetensors", "base.safetensors"]
    parallel = run_cli("verify", *names)
    monkeypatch.setattr(cli, "WORKERS", 1)
    monkeypatch.setattr(cli, "_each", lambda fn, items, parallel=True: map(fn, items))
    assert parallel == run_cli("verify", *names)
    assert parallel[0] == 2
    shown = [line.split()[1].rstrip(":") for line in parallel[1].splitlines()]
    assert shown == [n for n in names if n not in ("nope.safetensors", "plain.safetensors")]  # (truncated: CORRUPT)


def test_check_lock_hashes_several_files_at_once_with_the_same_results(inputs):
    from tensorcanon import lockfile

    assert lockfile.check_lock("bad.lock", workers=4) == lockfile.check_lock("bad.lock")


def test_loading_a_sharded_checkpoint_directory_points_to_load_unsharded(tmp_path):
    with pytest.raises(tensorcanon.FormatError, match=r"tensorcanon\.dcp\.load_unsharded\(path\)"):
        tensorcanon.load(SHARDED)
    with pytest.raises(tensorcanon.FormatError,
                       match=r"is a directory, not a tensorcanon file or a sharded checkpoint \(it holds no "
                             r"index\.safetensors\)$"):
        tensorcanon.load(tmp_path)


def test_read_metadata_of_a_plain_safetensors_file(tmp_path):
    save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors", metadata={"k": "v", "format": "pt"})
    assert tensorcanon.read_metadata(tmp_path / "m.safetensors") == {"k": "v", "format": "pt"}
    save_file({"w": torch.ones(2)}, tmp_path / "none.safetensors")
    assert tensorcanon.read_metadata(tmp_path / "none.safetensors") is None


def test_the_docs_inspect_example_is_what_inspect_prints(tmp_path, monkeypatch):
    """docs/CLI.md shows a format-2 file: base.safetensors of tests/cli/inputs (a format-1 file)
    saved again, with its digest in every example of the page."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("COLUMNS", raising=False)
    src = os.path.join(INPUTS, "base.safetensors")
    d = tensorcanon.save(tensorcanon.load(src), "base.safetensors", metadata=tensorcanon.read_metadata(src))
    doc = open(os.path.join(ROOT, "docs", "CLI.md"), encoding="utf-8").read()
    block = re.search(r"```console\n\$ tensorcanon inspect base\.safetensors\n(.*?)```", doc, flags=re.S).group(1)
    assert run_cli("inspect", "base.safetensors")[1] == block
    assert f"format version {tensorcanon.FORMAT_VERSION})" in block
    hashes = set(re.findall(r"xxh3-128:([0-9a-f]{32})[ \n]+(?:\d+ )?(?:ckpt/)?base\.safetensors", doc))
    hashes |= set(re.findall(r"base\.safetensors +xxh3-128:([0-9a-f]{32})", doc))
    assert hashes == {d.split(":")[1]}, hashes
