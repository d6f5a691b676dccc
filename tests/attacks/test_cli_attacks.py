"""Attacks on the command line (issue 29): any input gives exit status 2 and tensorcanon's message,
never a traceback or a foreign exception; in ``check`` one bad file is reported while the others
are still checked; file names that are not UTF-8 are shown escaped (valid UTF-8 everywhere, JSON
included) and refused by ``lock``; ``consolidate`` never writes over the checkpoint it reads."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest

import tensorcanon

from support import run_cli

HERE = os.path.dirname(os.path.abspath(__file__))
SHARDED = os.path.join(os.path.dirname(HERE), "golden", "sharded", "two_ranks")


def _npy_claiming(path, shape, descr="<f8", data=b"\0" * 64):
    header = repr({"descr": descr, "fortran_order": False, "shape": shape})
    header += " " * (118 - len(header)) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + data)


def _hostile_numpy_files(folder) -> dict[str, str]:
    """name -> the words the error must hold."""
    _npy_claiming(folder / "huge.npy", (1 << 40,))  # 8 TiB of float64 claimed, 64 bytes there
    np.save(folder / "object.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.savez(folder / "object.npz", a=np.array([{"a": 1}], dtype=object))
    np.savez_compressed(folder / "zlib.npz", a=np.arange(1000.0))
    data = bytearray((folder / "zlib.npz").read_bytes())
    start = data.find(b"a.npy") + 60
    data[start:start + 20] = b"\xff" * 20  # damaged deflate stream
    (folder / "zlib.npz").write_bytes(bytes(data))
    with zipfile.ZipFile(folder / "huge.npz", "w") as z:  # a member claiming 8 TiB
        header = repr({"descr": "<f8", "fortran_order": False, "shape": (1 << 40,)})
        header += " " * (118 - len(header)) + "\n"
        z.writestr("a.npy", b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + b"\0" * 8)
    _npy_claiming(folder / "badheader.npy", (2,), descr="<q8zz")
    (folder / "truncated.npy").write_bytes(b"\x93NUMPY\x01\x00")
    return {"huge.npy": "claims 8796093022208 bytes", "object.npy": "object array",
            "object.npz": "object array", "zlib.npz": "member 'a.npy'", "huge.npz": "claims 8796093022208 bytes",
            "badheader.npy": "not a valid .npy", "truncated.npy": "not a valid .npy"}


@pytest.mark.parametrize("command", ["hash", "inspect", "lock", "convert", "diff"])
def test_hostile_numpy_files_are_exit_2_with_a_message(tmp_path, command):
    bad = _hostile_numpy_files(tmp_path)
    np.save(tmp_path / "good.npy", np.arange(3.0))
    for name, words in bad.items():
        argv = {"hash": ["hash", name], "inspect": ["inspect", name], "lock": ["lock", name],
                "convert": ["convert", name, "out.safetensors"], "diff": ["diff", "good.npy", name]}[command]
        code, out, err = run_cli(*argv, cwd=tmp_path)
        assert code == 2, (name, code, out, err)
        assert err.startswith("tensorcanon: error: ") and words in err and "Traceback" not in err, (name, err)
        assert len(err.splitlines()) == 1, err


def test_a_subprocess_shows_no_traceback(tmp_path):
    _hostile_numpy_files(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "tensorcanon", "hash", "huge.npy", "zlib.npz"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.count("error:") == 2


def test_check_reports_each_bad_file_and_checks_the_others(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(3.0))
    tensorcanon.save({"w": np.ones(2)}, str(tmp_path / "z.safetensors"))
    assert run_cli("lock", "a.npy", "z.safetensors", "huge.npy", cwd=tmp_path)[0] == 2  # not there yet
    assert run_cli("lock", "a.npy", "z.safetensors", cwd=tmp_path)[0] == 0
    lines = (tmp_path / "tensors.lock").read_text().splitlines()
    bad = _hostile_numpy_files(tmp_path)
    extra = [f"{lines[1].split(' ', 1)[0]} 64 {name}" for name in sorted(bad)]
    (tmp_path / "tensors.lock").write_text("\n".join([lines[0], *sorted(lines[1:] + extra)]) + "\n")
    code, out, err = run_cli("check", "tensors.lock", cwd=tmp_path)
    assert code == 1 and err == "", err
    status = {line.split()[1].rstrip(":"): line.split()[0] for line in out.splitlines()[:-1]}
    assert status == {"a.npy": "ok", "z.safetensors": "ok", **{n: "UNREADABLE" for n in bad}}, out


NAME = os.fsdecode(b"bad-\xff\xfe-name.safetensors")  # not UTF-8: held as surrogate escapes


@pytest.fixture
def badly_named(tmp_path):
    tensorcanon.save({"w": np.ones(2)}, os.path.join(str(tmp_path), NAME))
    return tmp_path


def test_names_that_are_not_utf8_under_a_strict_stdout(badly_named):
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}
    for argv in (["hash", NAME], ["verify", NAME], ["inspect", NAME], ["hash", "--json", NAME],
                 ["verify", "--json", NAME], ["hash", "missing-\udcff.safetensors"]):
        proc = subprocess.run([sys.executable, "-m", "tensorcanon", *argv], cwd=badly_named, capture_output=True,
                              env=env, timeout=120)
        assert b"Traceback" not in proc.stderr, (argv, proc.stderr)
        out = proc.stdout.decode("utf-8")  # valid UTF-8, or this raises
        proc.stderr.decode("utf-8")
        if "missing" in argv[-1]:
            # (a message quoting a name with repr() escapes it as repr does: \\udcff)
            assert proc.returncode == 2 and (b"missing-\\xff" in proc.stderr or b"missing-\\udcff" in proc.stderr)
            continue
        assert proc.returncode == 0, proc.stderr
        if "--json" in argv:
            assert json.loads(out)["files"][0]["path"] == "bad-\\xff\\xfe-name.safetensors"
        else:
            assert "bad-\\xff\\xfe-name.safetensors" in out


def test_lock_refuses_a_name_that_is_not_utf8_clearly(badly_named):
    tensorcanon.save({"w": np.zeros(2)}, str(badly_named / "good.safetensors"))
    code, out, err = run_cli("lock", ".", cwd=badly_named)
    assert code == 2 and out == "" and not (badly_named / "tensors.lock").exists()
    assert "bad-\\xff\\xfe-name.safetensors" in err and "not UTF-8" in err and "rename" in err, err
    err.encode("utf-8")


@pytest.fixture
def checkpoint(tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(SHARDED, folder)
    return folder


def _files(folder) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def test_consolidate_refuses_to_write_over_the_checkpoint_it_reads(checkpoint, tmp_path):
    before = _files(checkpoint)
    rank = next(n for n in before if n.startswith("rank-"))
    os.symlink(checkpoint / rank, tmp_path / "link.safetensors")
    os.link(checkpoint / "index.safetensors", tmp_path / "hard.safetensors")
    for out in (checkpoint / "index.safetensors", checkpoint / rank, checkpoint, tmp_path / "link.safetensors",
                tmp_path / "hard.safetensors"):
        code, stdout, err = run_cli("consolidate", str(checkpoint), str(out))
        assert code == 2 and stdout == "", (out, err)
        assert "part of the checkpoint" in err or "being read" in err, err
        assert _files(checkpoint) == before
        with pytest.raises(tensorcanon.UsageError, match="being read"):
            tensorcanon.sharded.consolidate(checkpoint, out)
    assert tensorcanon.verify(str(checkpoint))
    code, _, err = run_cli("consolidate", str(checkpoint), str(tmp_path / "whole.safetensors"))
    assert code == 0, err


def test_damaged_files_of_every_format_give_a_message_never_a_foreign_exception(tmp_path):
    """Files of each format with random bytes changed or cut (a fixed seed, so the same files each
    run): every command ends with exit 0, 1 or 2 and tensorcanon's own message; the last-resort
    message (a failure tensorcanon did not foresee: "this is a bug") never appears. Found zipfile's
    UnicodeDecodeError and NotImplementedError, numpy's TokenError and torch's TypeError."""
    import random

    inputs = os.path.join(os.path.dirname(HERE), "cli", "inputs")
    np.save(tmp_path / "seed.npy", np.arange(10.0))
    np.savez(tmp_path / "seed.npz", a=np.arange(10.0), b=np.ones((2, 3), np.int32))
    seeds = {".npy": (tmp_path / "seed.npy").read_bytes(), ".npz": (tmp_path / "seed.npz").read_bytes(),
             ".safetensors": open(os.path.join(inputs, "base.safetensors"), "rb").read(),
             ".pt": open(os.path.join(inputs, "weights.pt"), "rb").read()}
    rng = random.Random(20261127)
    for trial in range(120):
        suffix = rng.choice(sorted(seeds))
        data = bytearray(seeds[suffix])
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.2:
            data = data[: rng.randrange(len(data))]
        name = f"t{trial}{suffix}"
        (tmp_path / name).write_bytes(bytes(data))
        for argv in (["hash", name], ["inspect", name], ["verify", name], ["diff", name, name]):
            code, out, err = run_cli(*argv, cwd=tmp_path)
            assert code in (0, 1, 2) and "this is a bug" not in err, (argv, bytes(data[:64]), err)
            assert code == 0 or err.startswith("tensorcanon: error: ") or out, (argv, err)
