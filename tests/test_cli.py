"""The command line in real processes, progress bars, lockfiles, convert and repro details.

The golden cases (tests/test_cli_golden.py) run in one helper interpreter; the
first tests here run ``python -m tensorcanon`` and the installed
``tensorcanon`` script as separate processes and require the very same output.
"""

import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import tensorcanon
from tensorcanon import lockfile
from tensorcanon.format.errors import FormatError
from tensorcanon.tools import progress

from support import run_cli

HERE = os.path.dirname(os.path.abspath(__file__))
INPUTS = os.path.join(HERE, "cli", "inputs")
EXPECTED = os.path.join(HERE, "cli", "expected")
WRITE_ARTIFACT = os.path.join(HERE, "cli", "write_artifact.py")


@pytest.fixture
def inputs(tmp_path):
    folder = tmp_path / "inputs"
    shutil.copytree(INPUTS, folder)
    return folder


def _golden_parts(name):
    text = open(os.path.join(EXPECTED, name + ".txt"), encoding="utf-8").read()
    head, rest = text.split("\n--- stdout\n", 1)
    stdout, stderr = rest.split("\n--- stderr\n", 1)
    code = int(head.splitlines()[1].removeprefix("[exit ").removesuffix("]"))
    return code, stdout, stderr.rstrip("\n")


@pytest.mark.parametrize("name, argv", [
    ("verify_corrupt", ["verify", "base.safetensors", "corrupt.safetensors"]),
    ("hash_unreadable", ["hash", "truncated.safetensors", "notes.txt", "nope.safetensors"]),
])
def test_python_dash_m_matches_golden(inputs, name, argv):
    proc = subprocess.run([sys.executable, "-m", "tensorcanon", *argv], cwd=inputs, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": ""})  # not a terminal of any width
    code, stdout, stderr = _golden_parts(name)
    assert proc.returncode == code
    assert proc.stdout.rstrip("\n") == stdout.rstrip("\n")
    assert proc.stderr.rstrip("\n") == stderr


def _console_command() -> list:
    """The ``tensorcanon`` script installed beside this interpreter (not whichever one PATH finds
    first), or ``python -m tensorcanon`` where it has none (an install without scripts): both
    run tensorcanon.tools.cli:main. The built wheel's script is tested by .ci/smoke_wheel.py."""
    script = os.path.join(os.path.dirname(sys.executable), "tensorcanon")
    return [script] if os.access(script, os.X_OK) else [sys.executable, "-m", "tensorcanon"]


def test_console_script_matches_golden(inputs):
    proc = subprocess.run([*_console_command(), "check", "bad.lock"], cwd=inputs, capture_output=True, text=True)
    code, stdout, stderr = _golden_parts("check_failures")
    assert (proc.returncode, proc.stdout.rstrip("\n"), proc.stderr.rstrip("\n")) == (code, stdout.rstrip("\n"), stderr)


# ---------------------------------------------------------------- progress


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def _bars(stderr: str) -> str:
    """What verify wrote to stderr but its one note (what torch.load would drop of base.safetensors)."""
    return "".join(line for line in stderr.splitlines(keepends=True) if not line.startswith("tensorcanon: note: "))


def test_progress_bar_drawn_on_a_terminal_and_erased(inputs, monkeypatch):
    monkeypatch.setattr(progress, "MIN_BYTES", 0)
    tty = FakeTTY()
    code, out, _ = run_cli("verify", "base.safetensors", cwd=inputs, stderr=tty)
    assert code == 0 and out.startswith("OK ")
    drawn = _bars(tty.getvalue())
    assert "\rverify base.safetensors [" in drawn and "%" in drawn
    assert drawn.endswith("\r")  # the last thing written erases the bar
    assert drawn.split("\r")[-2].strip() == ""


def test_no_progress_bar_for_small_files_pipes_or_no_progress(inputs, monkeypatch):
    tty = FakeTTY()
    run_cli("verify", "base.safetensors", cwd=inputs, stderr=tty)
    assert _bars(tty.getvalue()) == ""  # under MIN_BYTES
    monkeypatch.setattr(progress, "MIN_BYTES", 0)
    tty = FakeTTY()
    run_cli("verify", "--no-progress", "base.safetensors", cwd=inputs, stderr=tty)
    assert _bars(tty.getvalue()) == ""
    pipe = io.StringIO()
    run_cli("verify", "base.safetensors", cwd=inputs, stderr=pipe)
    assert _bars(pipe.getvalue()) == ""


def test_progress_file_counts_every_byte(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(bytes(range(256)) * 100)
    stream = FakeTTY()
    bar = progress.Progress(25600, "read", stream=stream, min_bytes=0)
    with open(path, "rb") as fh:
        f = progress.ProgressFile(fh, bar)
        assert f.read(100) == bytes(range(100))
        buf = bytearray(25500)
        assert f.readinto(buf) == 25500
    assert bar.done == 25600
    assert "read [" in stream.getvalue() and stream.getvalue().endswith("\r")


# ---------------------------------------------------------------- lockfiles


def test_lockfile_paths_are_relative_to_the_lockfile_and_may_hold_spaces(tmp_path):
    data = tmp_path / "data dir"
    (data / "sub").mkdir(parents=True)
    tensorcanon.save({"w": torch.ones(2)}, data / "sub" / "a b.safetensors")
    tensorcanon.save({"w": torch.zeros(2)}, data / "c.safetensors")
    (data / "README").write_text("not collected from a folder")
    locks = tmp_path / "locks"
    locks.mkdir()
    # files outside the lockfile's folder are locked, and checked, only where allowed explicitly
    assert run_cli("lock", str(data), "-o", "locks/t.lock", cwd=tmp_path)[0] == 2
    code, out, err = run_cli("lock", "--allow", str(data), str(data), "-o", "locks/t.lock", cwd=tmp_path)
    assert code == 0, err
    text = (locks / "t.lock").read_text()
    lines = text.splitlines()
    assert lines[0] == "tensorcanon-lock 3"
    assert [line.split(" ", 2)[2] for line in lines[1:]] == ["../data dir/c.safetensors",
                                                            "../data dir/sub/a b.safetensors"]
    assert run_cli("check", "locks/t.lock", cwd=tmp_path)[0] == 2
    assert run_cli("check", "--allow", str(data), "locks/t.lock", cwd=tmp_path)[0] == 0
    # A change of one file is one changed line, and check names it.
    tensorcanon.save({"w": torch.ones(2) * 2}, data / "c.safetensors")
    code, out, _ = run_cli("check", "--allow", str(data), "t.lock", cwd=locks)
    assert code == 1
    assert out.splitlines()[0].startswith("MISMATCH    ../data dir/c.safetensors: digest ")
    assert out.splitlines()[1] == "ok          ../data dir/sub/a b.safetensors"


def test_lockfile_rejects_other_versions_and_duplicates():
    with pytest.raises(FormatError, match="version '4' is not supported"):
        lockfile.parse_lock("tensorcanon-lock 4\n")
    line = "xxh3-128:" + "0" * 32 + " 4 a.safetensors"
    with pytest.raises(FormatError, match="line 3: 'a.safetensors' is listed twice"):
        lockfile.parse_lock(f"tensorcanon-lock 1\n{line}\n{line}\n")
    with pytest.raises(FormatError, match="line 2"):
        lockfile.parse_lock("tensorcanon-lock 1\nxxh3-128:00 4 a\n")
    with pytest.raises(FormatError, match="line 2"):  # Python refuses int() of over 4,300 digits
        lockfile.parse_lock(f"tensorcanon-lock 2\nxxh3-128:{'0' * 32} {'1' * 5000} a\n")
    entries = lockfile.parse_lock(f"tensorcanon-lock 1\r\n{line}\r\n")  # checked out with CRLF
    assert entries == [lockfile.LockEntry("a.safetensors", "xxh3-128:" + "0" * 32, 4)]
    assert lockfile.format_lock(entries) == f"tensorcanon-lock 3\n{line}\n"


def test_older_lockfiles_keep_checking_plain_files_with_their_formats_digests(tmp_path):
    """Lockfiles written before format 2 (3) record format-1 (format-2) fingerprints of
    non-tensorcanon files; check computes the same, so a CI lockfile survives the upgrade, and a
    new lock is version 3. Lists packed in format 3 (a .pt file's token ids) change the digest."""
    from safetensors.torch import save_file

    save_file({"w": torch.arange(3.0)}, str(tmp_path / "plain.safetensors"))
    torch.save({"ids": list(range(50))}, tmp_path / "ids.pt")
    names = ["ids.pt", "plain.safetensors"]
    digests = {v: [lockfile.content_digest(tmp_path / n, format_version=v)[0] for n in names] for v in (1, 2, 3)}
    assert len({d for ds in digests.values() for d in ds}) == 6
    assert digests[3] == [lockfile.content_digest(tmp_path / n)[0] for n in names]
    sizes = [(tmp_path / n).stat().st_size for n in names]
    for version in (1, 2, 3):
        lines = "".join(f"{d} {s} {n}\n" for d, s, n in zip(digests[version], sizes, names, strict=True))
        (tmp_path / "old.lock").write_text(f"tensorcanon-lock {version}\n{lines}")
        assert [r.status for r in lockfile.check_lock(tmp_path / "old.lock")] == ["ok", "ok"]
        other = 1 + version % 3
        (tmp_path / "old.lock").write_text(f"tensorcanon-lock {other}\n{lines}")
        assert [r.status for r in lockfile.check_lock(tmp_path / "old.lock")] == ["mismatch", "mismatch"]
    entries = lockfile.make_lock([str(tmp_path / n) for n in names], tmp_path / "new.lock")
    assert [e.digest for e in entries] == digests[3]
    assert lockfile.format_lock(entries).startswith("tensorcanon-lock 3\n")


def test_check_reports_a_size_change_even_when_content_is_equal(tmp_path):
    torch.save({"w": torch.ones(3)}, tmp_path / "a.pt")
    entries = lockfile.make_lock([str(tmp_path / "a.pt")], tmp_path / "t.lock")
    wrong = [lockfile.LockEntry(e.path, e.digest, e.size + 1) for e in entries]
    lockfile.write_lock(wrong, tmp_path / "t.lock")
    (result,) = lockfile.check_lock(tmp_path / "t.lock")
    assert result.status == "mismatch" and result.message == f"size {entries[0].size}, expected {entries[0].size + 1}"


# ---------------------------------------------------------------- convert


def test_convert_pt_gives_the_digest_hash_reports(inputs):
    code, out, _ = run_cli("hash", "--json", "weights.pt", cwd=inputs)
    expected = json.loads(out)["files"][0]["digest"]
    assert run_cli("convert", "weights.pt", "w.safetensors", cwd=inputs)[0] == 0
    assert tensorcanon.verify(inputs / "w.safetensors") == expected
    assert run_cli("hash", "w.safetensors", cwd=inputs)[1] == f"{expected}  w.safetensors\n"


def test_convert_to_plain_safetensors_and_back(inputs):
    assert run_cli("convert", "base.safetensors", "flat.safetensors", cwd=inputs)[0] == 0
    flat = load_file(inputs / "flat.safetensors")
    base = tensorcanon.load(inputs / "base.safetensors")
    assert sorted(flat) == ["ids", "mask", "model.fc.bias", "model.fc.weight"]
    assert torch.equal(flat["model.fc.weight"], base["model"]["fc.weight"])
    assert torch.equal(flat["mask"], base["mask"])
    assert run_cli("convert", "flat.safetensors", "back.safetensors", cwd=inputs)[0] == 0
    assert tensorcanon.verify(inputs / "back.safetensors") == tensorcanon.fingerprint(flat)


def test_convert_refuses_dtypes_plain_safetensors_cannot_hold(tmp_path):
    tensorcanon.save({"z": torch.ones(2, dtype=torch.complex128)}, tmp_path / "c.safetensors")
    code, out, err = run_cli("convert", "--to", "safetensors", "c.safetensors", "o.safetensors", cwd=tmp_path)
    assert code == 2
    assert 'tensor $["z"] has dtype complex128, which plain safetensors cannot hold' in err
    assert not (tmp_path / "o.safetensors").exists()


def test_convert_keeps_numpy_arrays_and_metadata(inputs):
    assert run_cli("convert", "arrays.npz", "a.safetensors", cwd=inputs)[0] == 0
    a = tensorcanon.load(inputs / "a.safetensors")
    assert isinstance(a["fc.weight"], np.ndarray) and a["fc.weight"].dtype == np.float32
    assert run_cli("convert", "--to", "tensorcanon", "base.safetensors", "copy.safetensors", cwd=inputs)[0] == 0
    # base.safetensors is a format-1 file: converting writes the current version, same content.
    base = (inputs / "base.safetensors").read_bytes()
    assert (inputs / "copy.safetensors").read_bytes() == tensorcanon.dumps(
        tensorcanon.loads(base), metadata=tensorcanon.read_metadata(base))
    # and converting a current-version file changes no byte
    assert run_cli("convert", "--to", "tensorcanon", "copy.safetensors", "copy2.safetensors", cwd=inputs)[0] == 0
    assert (inputs / "copy2.safetensors").read_bytes() == (inputs / "copy.safetensors").read_bytes()


# ---------------------------------------------------------------- diff, inspect


def test_diff_reports_recorded_devices(tmp_path):
    """A file that records cuda:0 is compared by its recorded device even on a CPU-only machine."""
    tensorcanon.save({"w": torch.ones(2)}, tmp_path / "cpu.safetensors")
    data = (tmp_path / "cpu.safetensors").read_bytes()
    # Rewrite the header as a writer would for the same tensor on cuda:0 (devices are not in the digest).
    from tensorcanon.format import container, manifest
    from tensorcanon.io import reader

    with reader.open_file(tmp_path / "cpu.safetensors") as cf:
        header, m = cf.header, cf.manifest
    meta = manifest.header_metadata(m.raw, ["cuda:0"])
    new_header = container.build(header.entries, meta)
    (tmp_path / "gpu.safetensors").write_bytes(new_header + data[len(header.raw):])
    code, out, _ = run_cli("diff", "cpu.safetensors", "gpu.safetensors", cwd=tmp_path)
    # the same content (one digest) placed elsewhere: identical, the device said as a note
    assert code == 0
    assert '$["w"]: device cpu -> cuda:0 (placement: the digest does not cover it)' in out.splitlines()
    assert out.splitlines()[-1].startswith("identical: the same content digest xxh3-128:")
    code, out, _ = run_cli("inspect", "--json", "gpu.safetensors", cwd=tmp_path)
    assert [e["device"] for e in json.loads(out)["entries"] if e["dtype"]] == ["cuda:0"]


def test_inspect_marks_shared_tensors_and_registered_objects(tmp_path):
    t = torch.arange(4.0)
    tensorcanon.save({"a": t, "b": t, "s": {1, 2}, "c": 1 + 2j}, tmp_path / "x.safetensors")
    code, out, _ = run_cli("inspect", "--json", "x.safetensors", cwd=tmp_path)
    data = json.loads(out)
    rows = {e["path"]: e for e in data["entries"]}
    assert rows['$["b"]']["same_as"] == '$["a"]'
    assert rows['$["s"]']["type"] == "set" and rows['$["c"]']["value"] == "(1+2j)"
    assert data["totals"]["tensors"] == 2 and data["totals"]["unique_tensors"] == 1
    assert data["totals"]["tensor_bytes"] == 16


# ---------------------------------------------------------------- repro


def test_repro_compares_every_file_of_an_output_folder(tmp_path):
    script = tmp_path / "write_dir.py"
    script.write_text(
        "import os, subprocess, sys\n"
        "os.makedirs('out', exist_ok=True)\n"
        f"subprocess.run([sys.executable, {WRITE_ARTIFACT!r}, 'out/a.safetensors', '--vary', 'state'], check=True)\n"
        f"subprocess.run([sys.executable, {WRITE_ARTIFACT!r}, 'out/b.safetensors'], check=True)\n"
    )
    code, out, err = run_cli("repro", "--out", "out", "--", sys.executable, str(script), cwd=tmp_path)
    assert code == 1, err
    lines = out.splitlines()
    assert lines[0] == "out: differs between run 1 and run 2"
    assert lines[1] == "  out/a.safetensors:"
    assert lines[4].startswith('    first differing tensor: $["w"]: 1 of 4 elements differ')
    assert "out/b.safetensors" not in out  # identical files are not listed
    assert sorted(os.listdir(tmp_path / "out")) == ["a.safetensors", "b.safetensors"]  # last run's output kept


def test_repro_refuses_an_output_folder_holding_the_current_folder(tmp_path):
    code, _, err = run_cli("repro", "--out", ".", "--", sys.executable, "-c", "pass", cwd=tmp_path)
    assert code == 2 and "contains the current folder" in err


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_repro_never_touches_what_is_already_at_out(tmp_path, kind):
    # Whatever the user has at an --out path (an earlier result, a folder of their files) is not
    # moved, overwritten or deleted: repro refuses before running anything, and says what to do.
    marker = tmp_path / "ran"
    if kind == "file":
        (tmp_path / "model.safetensors").write_bytes(b"the user's earlier result")
        out_path = "model.safetensors"
    else:
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "notes.txt").write_text("mine")
        out_path = "out"
    before = {str(p.relative_to(tmp_path)): (p.read_bytes(), p.stat().st_mtime_ns)
              for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    argv = ["repro", "--out", out_path, "fresh.safetensors", "--", sys.executable, "-c",
            f"open({str(marker)!r}, 'w').close()"]
    code, out, err = run_cli(*argv, cwd=tmp_path)
    assert code == 2 and out == ""
    assert f"--out {out_path!r} already exists" in err and "never deletes or overwrites" in err
    assert "move it away" in err
    after = {str(p.relative_to(tmp_path)): (p.read_bytes(), p.stat().st_mtime_ns)
             for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    assert after == before and not marker.exists()


def test_repro_leaves_the_last_runs_output_and_refuses_to_replace_it(tmp_path):
    argv = ["repro", "--out", "m.safetensors", "--", sys.executable, WRITE_ARTIFACT, "m.safetensors"]
    code, out, err = run_cli(*argv, cwd=tmp_path)
    assert code == 0, err
    written = (tmp_path / "m.safetensors").read_bytes()
    assert "w" in tensorcanon.load(tmp_path / "m.safetensors")  # the last run's output, in place
    # a second repro would have to remove it first: it refuses, and the file stays
    code, _, err = run_cli(*argv, cwd=tmp_path)
    assert code == 2 and "'m.safetensors' already exists" in err
    assert (tmp_path / "m.safetensors").read_bytes() == written
    assert os.listdir(tmp_path) == ["m.safetensors"]
