"""Checkpoint directories in tensorcanon.verify, the command line and lockfiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import tensorcanon
import tensorcanon.dcp as tcd
from tensorcanon.sharded import layout
from tensorcanon.tools.diff import load_file

from helpers import flip_byte
from states import logical_digest, logical_state, sharded_state
from support import run_cli
from threaded import run_ranks


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The same state saved by 2 and by 3 ranks, and another state by 2."""
    base = tmp_path_factory.mktemp("cli")
    two, three, other = str(base / "two"), str(base / "three"), str(base / "other")
    run_ranks(2, lambda r: tcd.save(sharded_state(2, r), two))
    run_ranks(3, lambda r: tcd.save(sharded_state(3, r), three))
    run_ranks(2, lambda r: tcd.save(sharded_state(2, r, seed=1), other))
    return base, two, three, other


def test_tensorcanon_verify_accepts_a_directory(ckpts):
    _, two, three, _ = ckpts
    assert tensorcanon.verify(two) == tensorcanon.verify(three) == logical_digest()
    assert tensorcanon.verify(two, expect=logical_digest()) == logical_digest()
    with pytest.raises(tensorcanon.IntegrityError, match="expected"):
        tensorcanon.verify(two, expect="xxh3-128:" + "0" * 32)


def test_hash_and_verify(ckpts):
    _, two, three, _ = ckpts
    code, out, _ = run_cli("hash", two, three)
    assert code == 0 and out.splitlines() == [f"{logical_digest()}  {two}", f"{logical_digest()}  {three}"]
    code, out, _ = run_cli("hash", "--json", "--verify", two)
    assert json.loads(out)["files"][0] == {"path": two, "status": "ok", "digest": logical_digest(),
                                           "format": "tensorcanon-sharded", "verified": True}
    code, out, _ = run_cli("verify", "--expect", logical_digest(), two, three)
    assert code == 0 and out.count("OK ") == 2


def test_verify_names_the_damage(ckpts, tmp_path):
    import shutil

    _, two, _, _ = ckpts
    broken = str(tmp_path / "broken")
    shutil.copytree(two, broken)
    path = layout.read(broken).file_path(0)
    flip_byte(path, -1, 4)
    code, out, _ = run_cli("verify", broken)
    assert code == 1 and out.startswith("CORRUPT") and os.path.basename(path) in out
    os.unlink(os.path.join(broken, layout.INDEX_NAME))
    code, _, err = run_cli("verify", broken)
    assert code == 2 and "interrupted save" in err


def test_diff_compares_logical_content(ckpts):
    _, two, three, other = ckpts
    code, out, _ = run_cli("diff", two, three)
    assert code == 0 and "identical" in out.splitlines()[-1]
    code, out, _ = run_cli("diff", "--json", two, other)
    data = json.loads(out)
    assert code == 1 and any(d["path"] == '$["model"]["layer.weight"]' for d in data["differences"])
    consolidated = os.path.join(os.path.dirname(two), "two.safetensors")
    tcd.consolidate(two, consolidated)
    code, _, _ = run_cli("diff", consolidated, three)         # a file against a directory
    assert code == 0


def test_diff_api_reads_directories_as_the_command_line_does(ckpts):
    _, two, three, other = ckpts
    assert tensorcanon.diff(two, three).identical
    result = tensorcanon.diff(two, other)
    assert not result.identical and result.a == two and result.b == other
    assert '$["model"]["layer.weight"]' in [d.path for d in result.differences]
    assert tensorcanon.diff(logical_state(), three).identical  # an object against a directory
    loaded = load_file(two)
    assert loaded.format == "tensorcanon-sharded" and loaded.path == two


def test_inspect_shows_the_logical_tree_and_the_layout(ckpts):
    _, _, three, _ = ckpts
    code, out, _ = run_cli("inspect", three)
    assert code == 0 and logical_digest() in out and "sharded checkpoint, 3 rank file(s)" in out
    assert '$["model"]["layer.weight"]' in out and "float32" in out
    code, out, _ = run_cli("inspect", "--json", three)
    data = json.loads(out)
    assert data["format"] == "tensorcanon-sharded" and data["layout"]["world_size"] == 3
    assert len(data["layout"]["chunks"]["model.layer.weight"]) == 3
    assert data["totals"]["tensors"] >= 10


def test_consolidate_command(ckpts, tmp_path):
    _, _, three, _ = ckpts
    out_path = str(tmp_path / "one.safetensors")
    code, out, _ = run_cli("consolidate", three, out_path)
    assert code == 0 and logical_digest() in out
    with open(out_path, "rb") as fh:
        assert fh.read() == tensorcanon.dumps(logical_state())
    code, _, err = run_cli("consolidate", str(tmp_path / "nowhere"), out_path)
    assert code == 2 and "does not exist" in err


def test_lock_and_check_treat_a_checkpoint_as_one_entry(ckpts):
    base, two, three, _ = ckpts
    lock = str(base / "tensors.lock")
    code, _, _ = run_cli("lock", str(base), "-o", lock)
    assert code == 0
    entries = tensorcanon.tools.lockfile.read_lock(lock)
    by_path = {e.path: e for e in entries}
    assert {"two", "three", "other"} <= set(by_path)                      # directories, not their files
    assert not any(p.startswith("two/") for p in by_path)
    assert by_path["two"].digest == by_path["three"].digest == logical_digest()
    assert by_path["two"].size == by_path["three"].size == len(tensorcanon.dumps(logical_state()))
    code, out, _ = run_cli("check", lock)
    assert code == 0 and "all" in out.splitlines()[-1]


def test_import_tensorcanon_does_not_import_dcp():
    """torch itself imports torch.distributed's core; tensorcanon must not add DCP or DTensor."""
    code = ("import sys, tensorcanon, tensorcanon.sharded;"
            "bad = [m for m in ('torch.distributed.checkpoint', 'torch.distributed.tensor', "
            "'torch.distributed.fsdp', 'tensorcanon.dcp') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = subprocess.run([sys.executable, "-c", "import tensorcanon.dcp, sys; "
                           "print('torch.distributed.checkpoint' in sys.modules)"], capture_output=True, text=True)
    assert proc.stdout.strip() == "True"
